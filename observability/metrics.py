"""Prometheus metrics: vLLM's names, labels and buckets (vllm/v1/metrics/loggers.py) where vLLM
has the metric, `kvledger:*` for our own (the same colon scheme, so a dashboard reads both alike). Each service builds its metrics on its own registry,
never the global default, so tests and `kvledger up` can hold several side by side.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, fields

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = CONTENT_TYPE_LATEST
# vLLM labels every engine metric with the served model and the engine index (data parallel
# rank); kvledger has one ledger, engine "0", so vLLM dashboards work unchanged.
VLLM_LABELS = ("model_name", "engine")

# fmt: off
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
# vLLM shares this list between e2e latency, queue, inference, prefill and decode time.
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)
# Ours: a step is a dispatch to the workers and back, milliseconds on a GPU, more on a CPU.
STEP_DURATION_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
# fmt: on


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


@dataclass(frozen=True, slots=True)
class LedgerSnapshot:
    """The ledger's gauges and counter totals, small enough to publish in its status key so
    that the gateway's /metrics can show them (`GatewayMetrics.mirror_ledger`)."""

    kv_cache_usage: float = 0.0
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    evicted_blocks: int = 0
    kv_events_published: int = 0

    def to_dict(self) -> dict[str, float | int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, float | int]) -> LedgerSnapshot:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})  # type: ignore[arg-type]


# (metric name, documentation, LedgerSnapshot field) for what the gateway mirrors.
_MIRRORED_GAUGES = (
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
    (
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        "num_requests_running",
    ),
    (
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        "num_requests_waiting",
    ),
)
_MIRRORED_COUNTERS = (
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "num_preemptions"),
    (
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        "prefix_cache_queries",
    ),
    (
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        "prefix_cache_hits",
    ),
    (
        "kvledger:evicted_blocks",
        "Cached KV blocks evicted to make room for allocations.",
        "evicted_blocks",
    ),
    (
        "kvledger:kv_events_published",
        "KV-cache events (BlockStored, BlockRemoved, "
        "AllBlocksCleared) appended to the events stream.",
        "kv_events_published",
    ),
)


class LedgerMetrics:
    """What the ledger knows: scheduler state, KV-cache usage, prefix cache, preemptions,
    queue time, evictions, events and step latency. Counters go up by the amount given."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine: str = "0") -> None:
        self.registry = registry
        self.labels = {"model_name": model_name, "engine": engine}
        self._gauges = {name: self._gauge(name, doc) for name, doc, _ in _MIRRORED_GAUGES}
        self._counters = {name: self._counter(name, doc) for name, doc, _ in _MIRRORED_COUNTERS}
        self._queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            VLLM_LABELS,
            registry=registry,
            buckets=REQUEST_LATENCY_BUCKETS,
        ).labels(**self.labels)
        self._step_duration = Histogram(
            "kvledger:step_duration_seconds",
            "Scheduler step latency: dispatch to the workers until their results are applied.",
            VLLM_LABELS,
            registry=registry,
            buckets=STEP_DURATION_BUCKETS,
        ).labels(**self.labels)
        self._dead_letters = dead_letters_counter(registry)
        self._redis_outages = redis_outages_counter(registry)
        self._worker_info = Gauge(
            "kvledger:worker_info",
            "1 for each live worker, labelled with its device and the attention backend it runs.",
            ("worker_id", "device", "attention_backend"),
            registry=registry,
        )
        self._worker_labels: set[tuple[str, str, str]] = set()
        self._zmq_dropped = Counter(
            "kvledger:kv_events_zmq_dropped",
            "KV-event batches not published over ZMQ because the publisher's queue was full "
            "(--kv-events-config max_queue_size); a subscriber sees the gap and resyncs.",
            VLLM_LABELS,
            registry=registry,
        ).labels(**self.labels)
        self._routed_expected = self._counter(
            "kvledger:routed_expected_hit_tokens",
            "Prompt tokens routers expected this replica to hold when they sent it requests "
            "(GenerateRequest.expected_cached_tokens), counted at each request's admission.",
        )
        self._shortfall_requests = self._counter(
            "kvledger:routed_hit_shortfall_requests",
            "Requests admitted with fewer cached tokens than their router expected (blocks "
            "evicted between routing and admission, or a pending prefill not yet cached).",
        )
        self._shortfall_tokens = self._counter(
            "kvledger:routed_hit_shortfall_tokens",
            "Cached tokens routers expected and admissions did not find.",
        )
        # The CPU tier (--kv-offloading-size): vLLM's connector lookups, in tokens, then ours.
        self._external_queries = self._counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in "
            "terms of number of queried tokens.",
        )
        self._external_hits = self._counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in "
            "terms of number of cached tokens.",
        )
        self._tier_loaded = self._counter(
            "kvledger:cpu_tier_loaded_blocks",
            "KV blocks loaded from the CPU tier into the GPU cache instead of being computed.",
        )
        self._tier_stored = self._counter(
            "kvledger:cpu_tier_stored_blocks",
            "KV blocks stored from the GPU cache into the CPU tier.",
        )
        self._tier_evicted = self._counter(
            "kvledger:cpu_tier_evicted_blocks",
            "KV blocks the CPU tier evicted to make room for stores (published as BlockRemoved "
            "with medium CPU).",
        )
        self._tier_held = self._gauge(
            "kvledger:cpu_tier_blocks",
            "KV blocks the CPU tier holds now (stored, or being stored).",
        )
        # vLLM's names for the transfers (its OffloadingConnector's and CPU tier's metrics).
        self._offload = {
            name: self._counter(name, doc)
            for name, doc in (
                ("vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage to GPU."),
                ("vllm:kv_offload_load_time",
                 "Total load time from offload storage to GPU, in seconds."),
                ("vllm:kv_offload_store_bytes", "Total bytes stored from GPU to offload storage."),
                ("vllm:kv_offload_store_time",
                 "Total store time from GPU to offload storage, in seconds."),
                ("vllm:kv_offload_stores_skipped",
                 "Number of KV offload stores skipped because the reuse threshold was not "
                 "reached."),
            )
        }  # fmt: skip
        self._offload_usage = self._gauge(
            "vllm:kv_offload_cpu_cache_usage_perc",
            "Fraction of CPU KV-cache space currently pinned by active transfers (0.0 = idle, "
            "1.0 = saturated). Sustained high values indicate transfers (stores or promotions) "
            "may be dropped due to insufficient capacity.",
        )
        # The shared tier (--kv-shared-tier), behind the CPU tier: this ledger's copies.
        self._shared_counters = {
            name: self._counter(f"kvledger:shared_tier_{name}", text)
            for name, text in (
                ("promoted_blocks", "KV blocks promoted from the shared tier into the CPU tier "
                 "(then loaded into the GPU cache instead of being computed)."),
                ("promotion_failures", "KV blocks a promotion found missing, truncated or "
                 "corrupt: recomputed, and removed from the shared tier's catalog."),
                ("cascaded_blocks", "KV blocks written from the CPU tier to the shared tier."),
                ("cascade_failures", "KV blocks the workers could not write to the shared tier."),
                ("evicted_blocks", "KV blocks this ledger's writes evicted from the shared tier "
                 "(past its size bound, those used longest ago)."),
                ("unreachable_blocks", "KV blocks whose promotion or cascade failed because the "
                 "store could not be reached or read (recomputed; the catalog keeps them, and "
                 "this ledger leaves the tier alone for a while)."),
            )
        }  # fmt: skip
        self._shared_seen: dict[str, int] = dict.fromkeys(self._shared_counters, 0)
        # vLLM's tiering metrics (its TieringOffloadingManager's secondary tiers), tier "shared".
        self._tiering = {
            name: Counter(name, doc, (*VLLM_LABELS, "tier"), registry=registry).labels(
                **self.labels, tier="shared"
            )
            for name, doc in (
                ("vllm:kv_offload_tiering_read_bytes", "Bytes read from a secondary tier."),
                ("vllm:kv_offload_tiering_read_time", "Seconds spent reading from a secondary "
                 "tier."),
                ("vllm:kv_offload_tiering_write_bytes", "Bytes written to a secondary tier."),
                ("vllm:kv_offload_tiering_write_time", "Seconds spent writing to a secondary "
                 "tier."),
            )
        }  # fmt: skip
        self._shared_size = Gauge(
            "kvledger:shared_tier_size",
            "What the shared tier's catalog lists, in blocks and bytes (every replica's).",
            (*VLLM_LABELS, "unit"),
            registry=registry,
        )
        self._prompt_computed = self._counter(
            "kvledger:prompt_tokens_computed",
            "Prompt positions the workers computed (those a prefix-cache hit or a CPU-tier load "
            "provided are not; a preempted request's are again).",
        )
        self._failed_requests = Counter(
            "kvledger:failed_requests",
            "Requests failed because a worker step failed with them: named by the worker "
            "(worker_error) or after too many failed steps (quarantined).",
            ("reason",),
            registry=registry,
        )

    def set_workers(self, workers: Mapping[str, tuple[str, str]]) -> None:
        """The live workers: worker id -> (device, attention backend)."""
        labels = {(w, device, backend) for w, (device, backend) in workers.items()}
        for gone in self._worker_labels - labels:
            self._worker_info.remove(*gone)
        for label in labels:
            self._worker_info.labels(*label).set(1)
        self._worker_labels = labels

    def set_scheduler_state(
        self, *, num_running: int, num_waiting: int, kv_cache_usage: float
    ) -> None:
        """After each step: running/waiting requests and the share of blocks in use (0..1)."""
        self._gauges["vllm:num_requests_running"].set(num_running)
        self._gauges["vllm:num_requests_waiting"].set(num_waiting)
        # Clamped rather than raised: a metrics update must never stop the scheduler.
        self._gauges["vllm:kv_cache_usage_perc"].set(min(1.0, max(0.0, kv_cache_usage)))

    def record_prefix_cache(self, *, queried_tokens: int, hit_tokens: int) -> None:
        """One prefix-cache lookup, in tokens as vLLM counts them."""
        self._counters["vllm:prefix_cache_queries"].inc(queried_tokens)
        self._counters["vllm:prefix_cache_hits"].inc(hit_tokens)

    def record_external_prefix_cache(self, *, queried_tokens: int, hit_tokens: int) -> None:
        """The CPU tier's lookups past the GPU hits, in tokens as vLLM counts them."""
        self._external_queries.inc(queried_tokens)
        self._external_hits.inc(hit_tokens)

    def record_cpu_tier(
        self, *, loaded_blocks: int, stored_blocks: int, bytes_per_block: int = 0
    ) -> None:
        """Blocks the CPU tier loaded and stored since the last call, and their bytes (one
        block of every worker: `bytes_per_block`)."""
        self._tier_loaded.inc(loaded_blocks)
        self._tier_stored.inc(stored_blocks)
        self._offload["vllm:kv_offload_load_bytes"].inc(loaded_blocks * bytes_per_block)
        self._offload["vllm:kv_offload_store_bytes"].inc(stored_blocks * bytes_per_block)

    def record_tier_transfer_time(self, *, load_s: float, store_s: float) -> None:
        """One step's copies, as its workers timed them."""
        self._offload["vllm:kv_offload_load_time"].inc(load_s)
        self._offload["vllm:kv_offload_store_time"].inc(store_s)

    def record_cpu_tier_evictions(self, num_blocks: int) -> None:
        self._tier_evicted.inc(num_blocks)

    def record_stores_skipped(self, count: int) -> None:
        self._offload["vllm:kv_offload_stores_skipped"].inc(count)

    def set_cpu_tier_state(self, *, held_blocks: int, usage: float) -> None:
        """The CPU tier's blocks held now, and the share of it pinned by transfers (0..1)."""
        self._tier_held.set(held_blocks)
        self._offload_usage.set(min(1.0, max(0.0, usage)))

    def record_shared_tier(self, totals: Mapping[str, int]) -> None:
        """The shared tier's counts since start (promoted_blocks, promotion_failures,
        cascaded_blocks, cascade_failures, evicted_blocks, unreachable_blocks): what grew since
        the last call."""
        for name, counter in self._shared_counters.items():
            total = totals.get(name, 0)
            if total > self._shared_seen[name]:
                counter.inc(total - self._shared_seen[name])
                self._shared_seen[name] = total

    def record_shared_tier_bytes(self, read: int, written: int) -> None:
        self._tiering["vllm:kv_offload_tiering_read_bytes"].inc(read)
        self._tiering["vllm:kv_offload_tiering_write_bytes"].inc(written)

    def record_shared_tier_time(self, read_s: float, write_s: float) -> None:
        """One step's shared-tier copies, as its slowest worker timed them."""
        self._tiering["vllm:kv_offload_tiering_read_time"].inc(read_s)
        self._tiering["vllm:kv_offload_tiering_write_time"].inc(write_s)

    def set_shared_tier_size(self, blocks: int, size_bytes: int) -> None:
        self._shared_size.labels(**self.labels, unit="blocks").set(blocks)
        self._shared_size.labels(**self.labels, unit="bytes").set(size_bytes)

    def record_prompt_tokens_computed(self, count: int) -> None:
        self._prompt_computed.inc(count)

    def record_preemptions(self, count: int = 1) -> None:
        self._counters["vllm:num_preemptions"].inc(count)

    def record_queue_time(self, seconds: float) -> None:
        """Enqueue to first admission of one request."""
        self._queue_time.observe(seconds)

    def record_routed_hits(self, *, expected_tokens: int, found_tokens: int) -> None:
        """One routed request's admission: the prefix its router expected, the one it found."""
        self._routed_expected.inc(expected_tokens)
        if found_tokens < expected_tokens:
            self._shortfall_requests.inc()
            self._shortfall_tokens.inc(expected_tokens - found_tokens)

    def record_evictions(self, num_blocks: int) -> None:
        self._counters["kvledger:evicted_blocks"].inc(num_blocks)

    def record_kv_events(self, count: int) -> None:
        self._counters["kvledger:kv_events_published"].inc(count)

    def record_kv_events_zmq_dropped(self, batches: int) -> None:
        self._zmq_dropped.inc(batches)

    def record_step(self, seconds: float) -> None:
        self._step_duration.observe(seconds)

    def record_dead_letter(self, stream: str) -> None:
        self._dead_letters.labels(stream=stream).inc()

    def record_redis_outage(self, loop: str) -> None:
        self._redis_outages.labels(loop=loop).inc()

    def record_failed_requests(self, reason: str, count: int) -> None:
        self._failed_requests.labels(reason=reason).inc(count)

    def snapshot(self) -> LedgerSnapshot:
        """The current values, read back from the registry so they match the exposition."""
        values = _sample_values(self.registry, self.labels)
        by_field = {field: values[name] for name, _, field in _MIRRORED_GAUGES}
        by_field |= {field: int(values[f"{name}_total"]) for name, _, field in _MIRRORED_COUNTERS}
        return LedgerSnapshot(**by_field)  # type: ignore[arg-type]

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, VLLM_LABELS, registry=self.registry).labels(**self.labels)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, VLLM_LABELS, registry=self.registry).labels(**self.labels)


class GatewayMetrics:
    """What the gateway sees per request (time to first token, end-to-end latency, tokens,
    finish reason), plus the ledger's latest snapshot under the same vLLM names."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine: str = "0") -> None:
        self.registry = registry
        self.labels = {"model_name": model_name, "engine": engine}
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            VLLM_LABELS,
            registry=registry,
            buckets=TTFT_BUCKETS,
        ).labels(**self.labels)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            VLLM_LABELS,
            registry=registry,
            buckets=REQUEST_LATENCY_BUCKETS,
        ).labels(**self.labels)
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            VLLM_LABELS,
            registry=registry,
        ).labels(**self.labels)
        self._generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            VLLM_LABELS,
            registry=registry,
        ).labels(**self.labels)
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*VLLM_LABELS, "finished_reason"),
            registry=registry,
        )
        self._dead_letters = dead_letters_counter(registry)
        self._redis_outages = redis_outages_counter(registry)
        self._mirror = _LedgerMirror(self.labels)
        registry.register(self._mirror)

    def record_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def record_request_finished(
        self,
        *,
        e2e_seconds: float,
        prompt_tokens: int,
        generation_tokens: int,
        finished_reason: str = "stop",
    ) -> None:
        """One finished request; finished_reason as vLLM's: stop, length, abort, error."""
        self._e2e.observe(e2e_seconds)
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(generation_tokens)
        self._success.labels(**self.labels, finished_reason=finished_reason).inc()

    def record_dead_letter(self, stream: str) -> None:
        self._dead_letters.labels(stream=stream).inc()

    def record_redis_outage(self, loop: str) -> None:
        self._redis_outages.labels(loop=loop).inc()

    def mirror_ledger(self, snapshot: LedgerSnapshot) -> None:
        """Show the ledger's latest gauges and totals on this /metrics (nothing until called)."""
        self._mirror.snapshot = snapshot


class _LedgerMirror(Collector):
    """Exposes a LedgerSnapshot as vLLM metrics; counters are the ledger's totals, not deltas."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.snapshot: LedgerSnapshot | None = None

    def describe(self) -> list[Metric]:
        return []  # nothing fixed to describe: metrics appear once a snapshot arrives

    def collect(self) -> Iterator[Metric]:
        snapshot = self.snapshot
        if snapshot is None:
            return
        names, values = list(self.labels), list(self.labels.values())
        for name, doc, field in _MIRRORED_GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=names)
            gauge.add_metric(values, getattr(snapshot, field))
            yield gauge
        for name, doc, field in _MIRRORED_COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=names)
            counter.add_metric(values, getattr(snapshot, field))
            yield counter


def dead_letters_counter(registry: CollectorRegistry) -> Counter:
    """Stream entries that did not parse and were moved to the dead-letter stream."""
    return Counter(
        "kvledger:dead_letters",
        "Stream entries rejected and appended to the dead-letter stream.",
        ("stream",),
        registry=registry,
    )


def redis_outages_counter(registry: CollectorRegistry) -> Counter:
    """Times a loop lost its Redis connection (counted once per outage, when it begins)."""
    return Counter(
        "kvledger:redis_outages",
        "Redis outages seen by a service loop (one per outage, however long).",
        ("loop",),
        registry=registry,
    )


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of `registry`; serve it with CONTENT_TYPE."""
    return generate_latest(registry)


def metrics_handler(
    registry: CollectorRegistry,
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An aiohttp handler for GET /metrics: `app.router.add_get("/metrics", metrics_handler(r))`."""

    async def handle_metrics(_: web.Request) -> web.Response:
        # headers, not content_type=: aiohttp refuses a content type that carries a charset.
        return web.Response(body=render(registry), headers={"Content-Type": CONTENT_TYPE})

    return handle_metrics


def _sample_values(registry: CollectorRegistry, labels: dict[str, str]) -> dict[str, float]:
    """One pass over the registry: sample name -> value, for samples carrying exactly `labels`."""
    return {
        sample.name: sample.value
        for metric in registry.collect()
        for sample in metric.samples
        if sample.labels == labels
    }
