"""The request's trace holds its work: the worker puts each prefill chunk and each run of decode
steps in the trace of the request (real ledger and worker in process, a real redis-server, spans
from the real SDK), the step spans stay traces of their own, and the two link both ways."""

from __future__ import annotations

from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased

from gpu_worker.request_spans import RequestSpans
from observability import inject_traceparent
from observability.tracing import kvledger_sampler
from services.wire.messages import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    StepMessage,
)
from tests.engine.test_ledger_service import prompts
from tests.harness.spans import SpanCollector, named, traces_by_request
from tests.harness.stack import Stack, dense_greedy


def request_root(collector: SpanCollector, name: str) -> str:
    """A stand-in for the gateway's span: its traceparent goes on the request."""
    span = collector.tracer("test-gateway").start_span(name)
    traceparent = inject_traceparent(span)
    span.end()
    assert traceparent is not None
    return traceparent


async def test_prefill_chunks_and_decode_run_sit_in_the_requests_trace(redis_url, tiny_model):
    spans = SpanCollector()
    stack = Stack(
        redis_url, tiny_model, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=16,
        worker_tracer=spans.tracer("kvledger-worker"),
    )  # fmt: skip
    await stack.start()
    try:
        prompt = prompts(1, 40, seed=5)[0]
        await stack.submit("r0", prompt, 6, traceparent=request_root(spans, "r0"))
        result = (await stack.wait(["r0"]))["r0"]
        assert result.tokens == dense_greedy(tiny_model, prompt, 6)
        # The next step tells the worker that r0 finished, which ends its decode run.
        await stack.submit("r1", prompts(1, 8, seed=6)[0], 2)
        await stack.wait(["r1"])
    finally:
        await stack.stop()

    trace = traces_by_request(spans.spans)["r0"]
    (root,) = [s for s in trace if s["parent_span_id"] is None]
    prefills = named(trace, "kvledger.prefill")
    # 40 tokens at a budget of 16: chunks of 16, 16 and 8, the last sampling the first token.
    assert [
        (p["attributes"]["kvledger.prefill.start"], p["attributes"]["kvledger.num_computed_tokens"])
        for p in prefills
    ] == [(0, 16), (16, 16), (32, 8)]
    assert [p["attributes"]["kvledger.prefill.done"] for p in prefills] == [False, False, True]
    assert {p["attributes"]["kvledger.recompute"] for p in prefills} == {False}
    assert {p["attributes"]["kvledger.num_cached_tokens"] for p in prefills} == {0}
    (decode,) = named(trace, "kvledger.decode")
    a = decode["attributes"]
    # Five more tokens, one decode step each, ended when the worker heard r0 had finished.
    assert (a["kvledger.num_steps"], a["kvledger.num_computed_tokens"]) == (5, 5)
    assert a["kvledger.segment.end"] == "finished"
    assert a["kvledger.last_step_id"] - a["kvledger.first_step_id"] >= 4
    assert decode["events"] == []  # no per-step events without --collect-detailed-traces
    for span in [*prefills, decode]:
        assert span["parent_span_id"] == root["span_id"]
        assert span["service_name"] == "kvledger-worker"
    assert prefills[-1]["end_ns"] <= decode["start_ns"] < decode["end_ns"]

    steps = {s["span_id"]: s for s in named(spans.spans, "kvledger.step")}
    for step in steps.values():
        assert step["parent_span_id"] is None and step["trace_id"] != root["trace_id"]
    # Both ways: each prefill links to its step, which links back to that prefill span.
    for prefill in prefills:
        (link,) = prefill["links"]
        step = steps[link["span_id"]]
        assert step["attributes"]["kvledger.step_id"] == prefill["attributes"]["kvledger.step_id"]
        assert prefill["span_id"] in {x["span_id"] for x in step["links"]}
    # The decode run links to its first and last steps, and its first step links to it (every
    # step would, with --collect-detailed-traces: a link per request per step).
    first, last = (steps[link["span_id"]] for link in decode["links"])
    assert first["attributes"]["kvledger.step_id"] == a["kvledger.first_step_id"]
    assert last["attributes"]["kvledger.step_id"] == a["kvledger.last_step_id"]
    linking = [s for s in steps.values() if decode["span_id"] in {x["span_id"] for x in s["links"]}]
    assert linking == [first]
    computed = [s for s in steps.values() if s["attributes"]["kvledger.num_traced_requests"]]
    assert len(computed) >= 3 + 5  # every step r0 took part in says so
    # Six spans of work for a 40-token prompt and six tokens (three chunks, one decode run).
    assert len([s for s in trace if s["service_name"] == "kvledger-worker"]) == 4


def step_message(step_id: int, new=(), cached=(), scheduled=None, finished=(), preempted=()):
    return StepMessage(
        step_id=step_id, epoch="e1", new_reqs=list(new), cached_reqs=list(cached),
        num_scheduled_tokens=scheduled or {}, finished_req_ids=list(finished),
        preempted_req_ids=list(preempted), block_size=16,
    )  # fmt: skip


def new_req(req_id: str, traceparent: str | None, tokens: int, hit: int = 0, preemptions: int = 0):
    return NewRequestData(
        req_id=req_id, token_ids=list(range(tokens)), num_prompt_tokens=tokens - preemptions,
        block_ids=[1, 2, 3], num_computed_tokens=hit, sampling=SamplingParams(max_tokens=8),
        traceparent=traceparent, num_preemptions=preemptions,
    )  # fmt: skip


def cached_req(req_id: str, position: int):
    return CachedRequestData(
        req_id=req_id, new_token_ids=(), new_block_ids=(), num_computed_tokens=position
    )


def test_recompute_after_preemption_is_marked_and_runs_end_at_preemption():
    spans = SpanCollector()
    tracing = RequestSpans(spans.tracer("kvledger-worker"), "w0", "steps", detailed=True)
    tp = request_root(spans, "a")
    tracing.step(step_message(1, new=[new_req("a", tp, 20, hit=16)], scheduled={"a": 4}), 0, 10)
    tracing.step(step_message(2, cached=[cached_req("a", 20)], scheduled={"a": 1}), 20, 30)
    tracing.step(step_message(3, cached=[cached_req("a", 21)], scheduled={"a": 1}), 40, 50)
    tracing.step(step_message(4, preempted=["a"]), 60, 61)
    # Resumed with its 22 tokens (20 of the prompt, 2 outputs), the prefix cache holding none.
    tracing.step(
        step_message(5, new=[new_req("a", tp, 22, preemptions=1)], scheduled={"a": 22}), 70, 80
    )
    tracing.close_all("shutdown")

    trace = traces_by_request(spans.spans)["a"]
    first, recompute = named(trace, "kvledger.prefill")
    assert first["attributes"]["kvledger.num_cached_tokens"] == 16
    assert first["attributes"]["kvledger.recompute"] is False
    assert recompute["attributes"]["kvledger.recompute"] is True
    assert recompute["attributes"]["kvledger.num_preemptions"] == 1
    assert recompute["attributes"]["kvledger.num_computed_tokens"] == 22
    (decode,) = named(trace, "kvledger.decode")
    assert (decode["start_ns"], decode["end_ns"]) == (20, 50)
    assert decode["attributes"]["kvledger.segment.end"] == "preempted"
    assert decode["attributes"]["kvledger.compute_s"] == 20e-9
    # --collect-detailed-traces: an event per decode step.
    assert [e["attributes"]["kvledger.step_id"] for e in decode["events"]] == [2, 3]


def test_unsampled_requests_cost_no_spans_and_their_steps_follow_the_ratio():
    # Ratio 0: the gateway keeps no trace; a step with no sampled request is not kept either.
    spans = SpanCollector(sampler=kvledger_sampler("parentbased_traceidratio", "0"))
    tracing = RequestSpans(spans.tracer("kvledger-worker"), "w0", "steps")
    tp = request_root(spans, "a")
    assert not int(tp.split("-")[3], 16) & 0x01  # the "gateway" did not sample it
    tracing.step(step_message(1, new=[new_req("a", tp, 8)], scheduled={"a": 8}), 0, 10)
    assert spans.spans == [] and tracing.requests == {}
    # A sampled request's prefill chunk began in step 2: the step links to it, and is kept.
    sampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    tracing.step(step_message(2, new=[new_req("b", sampled, 8)], scheduled={"b": 8}), 20, 30)
    names = sorted(s["name"] for s in spans.spans)
    assert names == ["kvledger.prefill", "kvledger.step"]
    # b decodes: its run begins in step 3 (kept, linked to the run); in steps 4 and 5 it only
    # goes on decoding, and the ratio (0) decides them as any other root: not kept.
    for step_id in (3, 4, 5):
        cached = [cached_req("b", 8 + step_id - 3)]
        tracing.step(
            step_message(step_id, cached=cached, scheduled={"b": 1}), step_id * 10, step_id * 10 + 5
        )
    tracing.close_all("shutdown")
    steps = named(spans.spans, "kvledger.step")
    assert [s["attributes"]["kvledger.step_id"] for s in steps] == [2, 3]
    assert [len(s["links"]) for s in steps] == [1, 1]
    assert [s["attributes"]["kvledger.num_traced_requests"] for s in steps] == [1, 1]
    # Every link resolves, both ways: the request's work links only to the steps kept.
    (prefill,) = named(spans.spans, "kvledger.prefill")
    (decode,) = named(spans.spans, "kvledger.decode")
    assert decode["attributes"]["kvledger.num_steps"] == 3
    assert (
        decode["attributes"]["kvledger.first_step_id"],
        decode["attributes"]["kvledger.last_step_id"],
    ) == (3, 5)
    for work, step in ((prefill, steps[0]), (decode, steps[1])):
        assert [link["span_id"] for link in work["links"]] == [step["span_id"]]
        assert [link["span_id"] for link in step["links"]] == [work["span_id"]]


def test_the_default_sampler_is_parent_based_and_keeps_linked_roots():
    assert "ParentBased" in kvledger_sampler().get_description()
    assert ParentBased(ALWAYS_ON).get_description() in kvledger_sampler().get_description()
    ratio = kvledger_sampler("parentbased_traceidratio", "0.25").get_description()
    assert TraceIdRatioBased(0.25).get_description() in ratio
