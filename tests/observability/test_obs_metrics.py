"""Metrics: the rendered exposition has vLLM's names, label sets and bucket lists, the gateway
mirrors the ledger's totals, and registries never leak into each other or the global one."""

from __future__ import annotations

import math

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from observability.metrics import (
    CONTENT_TYPE,
    GatewayMetrics,
    LedgerMetrics,
    LedgerSnapshot,
    metrics_handler,
    new_registry,
    render,
)

# Copied by hand from vllm/v1/metrics/loggers.py (PrometheusStatLogger): the reference, kept
# apart from observability/metrics.py so a typo there cannot agree with itself.
# fmt: off
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                                40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# fmt: on
LABELS = {"model_name": "tiny-llama", "engine": "0"}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _samples(text: bytes) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def _value(samples: Samples, name: str, **extra: str) -> float:
    return samples[(name, tuple(sorted((LABELS | extra).items())))]


def _buckets(samples: Samples, histogram: str) -> list[float]:
    return sorted(
        float(dict(labels)["le"]) for name, labels in samples if name == f"{histogram}_bucket"
    )


def _busy_ledger(registry: CollectorRegistry | None = None) -> LedgerMetrics:
    ledger = LedgerMetrics(registry or new_registry(), "tiny-llama")
    ledger.set_scheduler_state(num_running=3, num_waiting=2, kv_cache_usage=0.25)
    ledger.record_prefix_cache(queried_tokens=64, hit_tokens=48)
    ledger.record_prefix_cache(queried_tokens=32, hit_tokens=16)
    ledger.record_preemptions()
    ledger.record_preemptions()
    ledger.record_queue_time(0.4)
    ledger.record_evictions(5)
    ledger.record_kv_events(4)
    ledger.record_step(0.003)
    ledger.record_dead_letter("kvl:requests")
    return ledger


def test_ledger_exposition_has_vllms_names_labels_and_values() -> None:
    ledger = _busy_ledger()
    text = render(ledger.registry)
    samples = _samples(text)

    assert _value(samples, "vllm:kv_cache_usage_perc") == 0.25
    assert _value(samples, "vllm:num_requests_running") == 3
    assert _value(samples, "vllm:num_requests_waiting") == 2
    assert _value(samples, "vllm:num_preemptions_total") == 2
    assert _value(samples, "vllm:prefix_cache_queries_total") == 96
    assert _value(samples, "vllm:prefix_cache_hits_total") == 64
    assert _value(samples, "vllm:request_queue_time_seconds_count") == 1
    assert _value(samples, "vllm:request_queue_time_seconds_sum") == 0.4
    assert _value(samples, "kvledger:evicted_blocks_total") == 5
    assert _value(samples, "kvledger:kv_events_published_total") == 4
    assert _value(samples, "kvledger:step_duration_seconds_count") == 1
    assert samples[("kvledger:dead_letters_total", (("stream", "kvl:requests"),))] == 1
    # vLLM's exposition, byte for byte: counters end in _total, labels sorted as vLLM's are.
    assert b"# TYPE vllm:num_preemptions_total counter\n" in text
    assert b'vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} 2.0\n' in text
    assert b'vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} 64.0\n' in text
    assert b"# TYPE vllm:kv_cache_usage_perc gauge\n" in text
    # vLLM's labels: model_name and engine, and its tiering metrics (TieringOffloadingMetrics,
    # labelled with TIER_LABEL in vllm/v1/kv_offload/tiering/spec.py) a tier besides.
    tiering = "vllm:kv_offload_tiering_"
    for name, labels in samples:
        if name.startswith("vllm:"):
            expected = {"model_name", "engine"} | ({"tier"} if name.startswith(tiering) else set())
            assert {k for k, _ in labels} - {"le"} == expected, name
    assert _value(samples, "vllm:kv_offload_tiering_read_bytes_total", tier="shared") == 0


def test_gateway_exposition_has_request_metrics_with_vllms_names() -> None:
    gateway = GatewayMetrics(new_registry(), "tiny-llama")
    gateway.record_first_token(0.03)
    gateway.record_request_finished(
        e2e_seconds=1.2, prompt_tokens=40, generation_tokens=8, finished_reason="length"
    )
    samples = _samples(render(gateway.registry))

    assert _value(samples, "vllm:time_to_first_token_seconds_count") == 1
    assert _value(samples, "vllm:time_to_first_token_seconds_bucket", le="0.04") == 1
    assert _value(samples, "vllm:time_to_first_token_seconds_bucket", le="0.02") == 0
    assert _value(samples, "vllm:e2e_request_latency_seconds_sum") == 1.2
    assert _value(samples, "vllm:prompt_tokens_total") == 40
    assert _value(samples, "vllm:generation_tokens_total") == 8
    assert _value(samples, "vllm:request_success_total", finished_reason="length") == 1


def test_histogram_buckets_are_vllms_lists() -> None:
    ledger_samples = _samples(render(_busy_ledger().registry))
    registry = new_registry()
    GatewayMetrics(registry, "tiny-llama").record_first_token(0.5)
    gateway_samples = _samples(render(registry))

    assert _buckets(gateway_samples, "vllm:time_to_first_token_seconds") == [
        *VLLM_TTFT_BUCKETS,
        math.inf,
    ]
    assert _buckets(gateway_samples, "vllm:e2e_request_latency_seconds") == [
        *VLLM_REQUEST_LATENCY_BUCKETS,
        math.inf,
    ]
    assert _buckets(ledger_samples, "vllm:request_queue_time_seconds") == [
        *VLLM_REQUEST_LATENCY_BUCKETS,
        math.inf,
    ]


def test_gateway_mirrors_the_ledgers_gauges_and_totals() -> None:
    ledger = _busy_ledger()
    registry = new_registry()
    gateway = GatewayMetrics(registry, "tiny-llama")
    assert b"vllm:num_preemptions" not in render(registry)  # nothing before the first snapshot

    published = ledger.snapshot().to_dict()  # what the ledger would put in its status key
    gateway.mirror_ledger(LedgerSnapshot.from_dict(published))
    ledger_samples, gateway_samples = _samples(render(ledger.registry)), _samples(render(registry))

    assert ledger.snapshot() == LedgerSnapshot(
        kv_cache_usage=0.25,
        num_requests_running=3,
        num_requests_waiting=2,
        num_preemptions=2,
        prefix_cache_queries=96,
        prefix_cache_hits=64,
        evicted_blocks=5,
        kv_events_published=4,
    )
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "kvledger:evicted_blocks_total",
        "kvledger:kv_events_published_total",
    ):
        assert _value(gateway_samples, name) == _value(ledger_samples, name), name
    assert b"# TYPE vllm:num_preemptions_total counter\n" in render(registry)


def test_registries_are_independent_of_each_other_and_of_the_global_one() -> None:
    first, second = _busy_ledger(), LedgerMetrics(new_registry(), "tiny-llama")
    second.record_preemptions(7)
    assert _value(_samples(render(first.registry)), "vllm:num_preemptions_total") == 2
    assert _value(_samples(render(second.registry)), "vllm:num_preemptions_total") == 7
    assert b"vllm:" not in generate_latest(REGISTRY)


def test_kv_cache_usage_is_clamped_to_zero_one() -> None:
    ledger = LedgerMetrics(new_registry(), "tiny-llama")
    ledger.set_scheduler_state(num_running=0, num_waiting=0, kv_cache_usage=1.2)
    assert ledger.snapshot().kv_cache_usage == 1.0
    ledger.set_scheduler_state(num_running=0, num_waiting=0, kv_cache_usage=-0.1)
    assert ledger.snapshot().kv_cache_usage == 0.0


async def test_metrics_handler_serves_the_exposition_over_http() -> None:
    ledger = _busy_ledger()
    app = web.Application()
    app.router.add_get("/metrics", metrics_handler(ledger.registry))
    async with TestClient(TestServer(app)) as client:
        response = await client.get("/metrics")
        body = await response.read()
    assert response.status == 200
    assert response.headers["Content-Type"] == CONTENT_TYPE
    assert _value(_samples(body), "vllm:num_preemptions_total") == 2
