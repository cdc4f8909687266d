"""Issue 5 end to end: a real run (every process, a real redis-server) exporting to an OTLP/HTTP
receiver. Each request is one trace rooted at the gateway's span; preemptions, re-admissions and
evictions appear in the right traces, evictions link to the requests that stored the blocks,
logs carry trace ids, and /metrics agrees with the ledger."""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict

import aiohttp
import pytest

from tests.e2e.conftest import launch, metric_value, serving
from tests.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.slow


def token_prompts(n: int, length: int, seed: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    common = [rng.randrange(32, 127) for _ in range(shared)]
    return [common + [rng.randrange(32, 127) for _ in range(length - shared)] for _ in range(n)]


async def complete(
    session: aiohttp.ClientSession,
    url: str,
    prompt: list[int],
    max_tokens: int,
    stream: bool,
    first_token: asyncio.Event | None = None,
) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        if not stream:
            return await resp.json()
        out = {"choices": [{"token_ids": [], "text": ""}]}
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                out["id"] = chunk["id"]
                for choice in chunk["choices"]:
                    out["choices"][0]["token_ids"] += choice.get("token_ids") or []
                    out["choices"][0]["text"] += choice.get("text", "")
                if first_token is not None and out["choices"][0]["token_ids"]:
                    first_token.set()
                if chunk.get("usage"):
                    out["usage"] = chunk["usage"]
        return out


@pytest.fixture(scope="module")
def traced_run():
    receiver = OtlpReceiver().start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    stack = launch(
        "default",
        num_gpu_blocks=24,
        max_model_len=112,
        extra_args=("--max-num-batched-tokens", "256"),
        env=env,
    )
    with serving(stack) as (served,):

        async def run() -> tuple[list[dict], list[dict], str, str]:
            async with aiohttp.ClientSession() as session:
                wave1 = await asyncio.gather(
                    *(
                        complete(session, served.url, p, 40, stream=i % 2 == 0)
                        for i, p in enumerate(token_prompts(4, 60, seed=1, shared=32))
                    )
                )
                # Wave 2 must preempt whatever the timing: a long "anchor" request is already
                # decoding (it has 80 tokens to go) when three 70-token prompts are admitted
                # beside it; all four grow to 7 blocks, 28 > the pool's 23.
                started = asyncio.Event()
                anchor_prompt, *others = token_prompts(4, 70, seed=2)
                anchor = asyncio.create_task(
                    complete(session, served.url, anchor_prompt[:30], 80, True, started)
                )
                await asyncio.wait_for(started.wait(), 120)
                wave2 = await asyncio.gather(
                    *(complete(session, served.url, p, 30, stream=False) for p in others)
                )
                wave2.append(await anchor)
                await asyncio.sleep(
                    1.5
                )  # the ledger refreshes its status (mirrored metrics) every second
                gateway_metrics = await (await session.get(f"{served.url}/metrics")).text()
                ledger_metrics = await (await session.get(served.ledger_metrics_url)).text()
            return wave1, wave2, gateway_metrics, ledger_metrics

        wave1, wave2, gateway_metrics, ledger_metrics = asyncio.run(run())
    # The stack is stopped: every service flushed its spans on the way out.
    spans = receiver.spans
    receiver.close()
    return {
        "wave1": wave1,
        "wave2": wave2,
        "spans": spans,
        "served": served,
        "gateway_metrics": gateway_metrics,
        "ledger_metrics": ledger_metrics,
    }


def by_trace(spans: list[dict]) -> dict[str, list[dict]]:
    traces: dict[str, list[dict]] = defaultdict(list)
    for span in spans:
        traces[span["trace_id"]].append(span)
    return traces


def service(span: dict) -> str:
    return span["resource"]["service.name"]


def request_traces(run) -> dict[str, list[dict]]:
    """req_id -> the spans of its trace, found through the gateway's root span."""
    traces = by_trace(run["spans"])
    out = {}
    for spans in traces.values():
        roots = [s for s in spans if not s["parent_span_id"] and s["kind"] == "SERVER"]
        if roots:
            out[roots[0]["attributes"]["kvledger.request_id"]] = spans
    return out


def test_every_request_is_one_trace_rooted_at_the_gateway_span(traced_run):
    traces = request_traces(traced_run)
    responses = traced_run["wave1"] + traced_run["wave2"]
    assert sorted(traces) == sorted(r["id"] for r in responses)
    for response in responses:
        spans = traces[response["id"]]
        by_id = {s["span_id"]: s for s in spans}
        (root,) = [s for s in spans if not s["parent_span_id"]]
        assert service(root) == "kvledger-gateway" and root["kind"] == "SERVER"
        for span in spans:  # every span hangs off the root
            node = span
            while node["parent_span_id"]:
                node = by_id[node["parent_span_id"]]
            assert node is root
        names = [s["name"] for s in spans]
        assert "kvledger.queue" in names and "kvledger.admit" in names
        usage = response["usage"]
        assert root["attributes"]["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert root["attributes"]["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
        assert (
            root["attributes"]["gen_ai.usage.cache_read.input_tokens"]
            == usage["prompt_tokens_details"]["cached_tokens"]
        )
        # The request's work is in its own trace: the worker's prefill chunks and decode runs.
        assert {service(s) for s in spans} == {
            "kvledger-gateway",
            "kvledger-ledger",
            "kvledger-worker",
        }
        assert "kvledger.prefill" in names and "kvledger.decode" in names


def test_a_preempted_request_shows_its_preemption_and_its_second_admission(traced_run):
    traces = request_traces(traced_run)
    preempted = {
        rid: spans
        for rid, spans in traces.items()
        if any(s["name"] == "kvledger.preempt" for s in spans)
    }
    assert preempted, "the small pool should have forced a preemption"
    for spans in preempted.values():
        preempts = [s for s in spans if s["name"] == "kvledger.preempt"]
        admits = sorted(
            (s for s in spans if s["name"] == "kvledger.admit"), key=lambda s: s["start_ns"]
        )
        assert len(admits) == len(preempts) + 1
        assert [a["attributes"]["kvledger.resumed"] for a in admits] == [False] + [True] * len(
            preempts
        )
        for p in preempts:
            assert p["attributes"]["kvledger.preempt.reason"] == "kv_cache_full"
            assert p["attributes"]["kvledger.blocks_freed"] > 0
            assert p["attributes"]["kvledger.caused_by.request_id"] in traces
        assert len([s for s in spans if s["name"] == "kvledger.queue"]) == len(admits)


def test_an_eviction_links_to_the_traces_of_the_requests_that_stored_the_blocks(traced_run):
    traces = request_traces(traced_run)
    trace_of = {rid: spans[0]["trace_id"] for rid, spans in traces.items()}
    wave1 = {r["id"] for r in traced_run["wave1"]}
    evicts = [
        (rid, s) for rid, spans in traces.items() for s in spans if s["name"] == "kvledger.evict"
    ]
    assert evicts
    linked_to_wave1 = 0
    for rid, span in evicts:
        attrs = span["attributes"]
        assert (
            attrs["kvledger.num_evicted_blocks"] == len(attrs["kvledger.evicted_block_hashes"]) > 0
        )
        assert span["links"]
        for link in span["links"]:
            owner = link["attributes"]["kvledger.request_id"]
            assert link["trace_id"] == trace_of[owner]  # the link resolves to the owner's trace
            linked_to_wave1 += owner in wave1 and rid not in wave1
    assert linked_to_wave1 > 0  # the second wave evicted the first wave's cached prefixes


def test_worker_steps_link_to_every_request_in_their_batch(traced_run):
    traces = request_traces(traced_run)
    trace_ids = {spans[0]["trace_id"] for spans in traces.values()}
    steps = [s for s in traced_run["spans"] if s["name"] == "kvledger.step"]
    assert steps and all(service(s) == "kvledger-worker" and s["kind"] == "CONSUMER" for s in steps)
    for step in steps:
        assert not step["parent_span_id"]
        assert len(step["links"]) == step["attributes"]["kvledger.batch_size"] > 0
        assert {link["trace_id"] for link in step["links"]} <= trace_ids


def test_log_lines_inside_a_request_carry_its_trace_id(traced_run):
    traces = request_traces(traced_run)
    trace_of = {rid: spans[0]["trace_id"] for rid, spans in traces.items()}
    records = traced_run["served"].log_records(
        "request_enqueued", "request_finished", "request_preempted"
    )
    per_request = [r for r in records if r.get("req_id") in trace_of]
    assert {r["event"] for r in per_request} >= {
        "request_enqueued",
        "request_finished",
        "request_preempted",
    }
    for record in per_request:
        assert record["trace_id"] == trace_of[record["req_id"]], record
        assert len(record["span_id"]) == 16


def test_metrics_agree_with_the_ledger_and_the_traces(traced_run):
    gateway, ledger = traced_run["gateway_metrics"], traced_run["ledger_metrics"]
    for name in (
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert metric_value(gateway, name) == metric_value(ledger, name), name
    preempt_spans = sum(1 for s in traced_run["spans"] if s["name"] == "kvledger.preempt")
    assert metric_value(ledger, "vllm:num_preemptions_total") == preempt_spans > 0
    queried = sum(r["usage"]["prompt_tokens"] for r in traced_run["wave1"] + traced_run["wave2"])
    assert (
        metric_value(ledger, "vllm:prefix_cache_queries_total") == queried
    )  # first admissions only
    hits = sum(
        r["usage"]["prompt_tokens_details"]["cached_tokens"]
        for r in traced_run["wave1"] + traced_run["wave2"]
    )
    assert metric_value(ledger, "vllm:prefix_cache_hits_total") == hits
    assert (
        metric_value(gateway, "vllm:kv_cache_usage_perc")
        == metric_value(ledger, "vllm:kv_cache_usage_perc")
        == 0.0
    )
    evicted = sum(
        len(s["attributes"]["kvledger.evicted_block_hashes"])
        for s in traced_run["spans"]
        if s["name"] == "kvledger.evict"
    )
    assert metric_value(ledger, "kvledger:evicted_blocks_total") == evicted
