"""The ledger's spans, cause and effect both ways (real ledger and worker in process over a real
redis-server, spans from the real SDK): a preemption links to the request whose growth forced it,
whose trace names its victims; a request that finds its prefix evicted links to the eviction and
says how many tokens it lost; a queued request says what held it back."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest
import structlog

from observability import configure_logging, inject_traceparent
from tests.engine.test_ledger_service import prompts
from tests.harness.spans import SpanCollector, named, traces_by_request
from tests.harness.stack import Stack


class Traced:
    """A Stack whose ledger and worker trace into one collector, and whose requests each start
    a trace of their own (a root span standing in for the gateway's)."""

    def __init__(self, redis_url, tiny_model, **kwargs) -> None:
        self.spans = SpanCollector()
        self.stack = Stack(
            redis_url, tiny_model,
            ledger_tracer=self.spans.tracer("kvledger-ledger"),
            worker_tracer=self.spans.tracer("kvledger-worker"),
            **kwargs,
        )  # fmt: skip

    async def submit(self, req_id: str, prompt: list[int], max_tokens: int, **kwargs) -> str:
        """Its trace id."""
        root = self.spans.tracer("test-gateway").start_span(req_id)
        traceparent = inject_traceparent(root)
        await self.stack.submit(req_id, prompt, max_tokens, traceparent=traceparent, **kwargs)
        root.end()
        assert traceparent is not None
        return traceparent.split("-")[1]

    def traces(self):
        return traces_by_request(self.spans.spans)


async def test_a_preemption_links_to_its_cause_and_the_cause_names_its_victims(
    redis_url, tiny_model
):
    traced = Traced(redis_url, tiny_model, num_blocks=24, max_model_len=112)
    stack = traced.stack
    await stack.start()
    try:
        # A long request is decoding when three more are admitted beside it: all four grow to
        # 7 blocks, 28 > the 23 the pool lends, so the oldest's growth preempts the youngest.
        anchor, *others = prompts(4, 70, seed=2)
        await traced.submit("anchor", anchor[:30], 80)
        while not stack.results["anchor"].tokens:
            await asyncio.sleep(0.02)
        for i, prompt in enumerate(others):
            await traced.submit(f"r{i}", prompt, 30)
        await stack.wait(["anchor", "r0", "r1", "r2"], timeout=120)
        assert stack.ledger.scheduler.num_preemptions > 0
    finally:
        await stack.stop()

    traces = traced.traces()
    preempts = [s for spans in traces.values() for s in named(spans, "kvledger.preempt")]
    assert len(preempts) == stack.ledger.scheduler.num_preemptions
    span_by_id = {s["span_id"]: s for s in traced.spans.spans}
    for preempt in preempts:
        victim = preempt["attributes"]["kvledger.request_id"]
        cause = preempt["attributes"]["kvledger.caused_by.request_id"]
        assert preempt["attributes"]["kvledger.preempt.reason"] == "kv_cache_full"
        assert cause != victim
        # The link resolves to the cause's kvledger.preempting span, in the cause's trace...
        (link,) = preempt["links"]
        preempting = span_by_id[link["span_id"]]
        assert preempting["name"] == "kvledger.preempting"
        assert preempting["trace_id"] == traces[cause][0]["trace_id"] != preempt["trace_id"]
        # ... which names its victims and links back to this very preemption.
        assert victim in preempting["attributes"]["kvledger.preempted.request_ids"]
        assert preempt["span_id"] in {x["span_id"] for x in preempting["links"]}
        # The victim's trace shows the recompute, after the preemption, on the worker.
        spans = traces[victim]
        admits = named(spans, "kvledger.admit")
        assert [a["attributes"]["kvledger.resumed"] for a in admits][-1] is True
        recomputes = [
            p for p in named(spans, "kvledger.prefill") if p["attributes"]["kvledger.recompute"]
        ]
        assert recomputes and recomputes[0]["start_ns"] >= preempt["start_ns"]
        assert {s["service_name"] for s in spans} >= {"kvledger-ledger", "kvledger-worker"}


async def test_a_request_that_finds_its_prefix_evicted_links_to_the_eviction(redis_url, tiny_model):
    traced = Traced(redis_url, tiny_model, num_blocks=24, max_model_len=112)
    stack = traced.stack
    await stack.start()
    try:
        prompt = prompts(1, 64, seed=11)[0]  # 4 blocks, 3 of them hittable (not the last token)
        await traced.submit("first", prompt, 2)
        await stack.wait(["first"])
        await traced.submit("hit", prompt, 2)  # the same prompt at once: its prefix is cached
        await stack.wait(["hit"])
        # Others fill the pool (28 blocks > the 18 never cached): the first prompt's blocks go.
        fillers = prompts(4, 100, seed=12)
        for pair in ((0, 1), (2, 3)):
            for i in pair:
                await traced.submit(f"fill{i}", fillers[i], 4)
            await stack.wait([f"fill{i}" for i in pair])
        await traced.submit("lost", prompt, 2)  # the same prompt a third time
        await stack.wait(["lost"])
    finally:
        await stack.stop()

    traces = traced.traces()
    # Every request's work is in its trace: a prefill, and a decode run for its later tokens.
    for rid in ("first", "hit", "lost", "fill0", "fill1", "fill2", "fill3"):
        tokens = len(stack.results[rid].tokens)
        runs = named(traces[rid], "kvledger.decode")
        assert named(traces[rid], "kvledger.prefill") and runs, rid
        assert sum(r["attributes"]["kvledger.num_computed_tokens"] for r in runs) == tokens - 1
    (hit,) = named(traces["hit"], "kvledger.admit")
    assert hit["attributes"]["kvledger.prefix_hit.tokens"] == 48
    # Admitted (scheduled) before the worker started on it: the tree reads in order.
    assert hit["start_ns"] <= named(traces["hit"], "kvledger.prefill")[0]["start_ns"]
    assert "kvledger.prefix_lost.tokens" not in hit["attributes"]

    (lost,) = named(traces["lost"], "kvledger.admit")
    a = lost["attributes"]
    # Every hittable block was either still cached or lost to an eviction it can name.
    assert a["kvledger.prefix_lost.blocks"] >= 1
    assert a["kvledger.prefix_hit.blocks"] + a["kvledger.prefix_lost.blocks"] == 3
    assert a["kvledger.prefix_lost.tokens"] == 16 * a["kvledger.prefix_lost.blocks"]
    span_by_id = {s["span_id"]: s for s in traced.spans.spans}
    assert lost["links"]
    for link in lost["links"]:
        evict = span_by_id[link["span_id"]]
        evictor = link["attributes"]["kvledger.request_id"]
        assert evict["name"] == "kvledger.evict"
        assert evict["trace_id"] == traces[evictor][0]["trace_id"]
        assert evictor in a["kvledger.prefix_lost.evicted_by"]
        # The eviction names whose blocks it took, and links to their traces.
        owners = evict["attributes"]["kvledger.evicted_from_request_ids"]
        assert {"first", "hit"} & set(owners)
        owner_traces = {x["trace_id"] for x in evict["links"]}
        assert traces["first"][0]["trace_id"] in owner_traces or (
            traces["hit"][0]["trace_id"] in owner_traces
        )
    # One kvledger.evict per run of a request's allocations, never one per block.
    for spans in traces.values():
        evicts = named(spans, "kvledger.evict")
        assert len(evicts) <= len(named(spans, "kvledger.admit"))
        for evict in evicts:
            attrs = evict["attributes"]
            assert attrs["kvledger.num_evicted_blocks"] == len(
                attrs["kvledger.evicted_block_hashes"]
            )


async def test_a_prefix_lost_to_requests_left_out_is_still_counted_and_named(redis_url, tiny_model):
    """The fillers' traces are left out (the traceparent's flag clear): they cost no span, but
    the ledger remembers what they evicted, so the sampled request that finds its prefix gone
    still says how many tokens it lost and to whom (with no link: nothing to link to)."""
    traced = Traced(redis_url, tiny_model, num_blocks=24, max_model_len=112)
    stack = traced.stack
    await stack.start()
    try:
        prompt = prompts(1, 64, seed=11)[0]
        await traced.submit("first", prompt, 2)
        await stack.wait(["first"])
        fillers = prompts(4, 100, seed=12)
        for pair in ((0, 1), (2, 3)):
            for i in pair:
                left_out = f"00-{i + 1:032x}-{i + 1:016x}-00"
                await stack.submit(f"fill{i}", fillers[i], 4, traceparent=left_out)
            await stack.wait([f"fill{i}" for i in pair])
        await traced.submit("lost", prompt, 2)
        await stack.wait(["lost"])
    finally:
        await stack.stop()

    traces = traced.traces()
    assert not {f"fill{i}" for i in range(4)} & set(traces)  # no span of theirs at all
    assert {s["trace_id"] for s in traced.spans.spans} == {
        traces[rid][0]["trace_id"] for rid in ("first", "lost")
    } | {s["trace_id"] for s in named(traced.spans.spans, "kvledger.step")}
    (lost,) = named(traces["lost"], "kvledger.admit")
    a = lost["attributes"]
    assert a["kvledger.prefix_lost.blocks"] >= 1
    assert a["kvledger.prefix_hit.blocks"] + a["kvledger.prefix_lost.blocks"] == 3
    assert a["kvledger.prefix_lost.tokens"] == 16 * a["kvledger.prefix_lost.blocks"]
    assert set(a["kvledger.prefix_lost.evicted_by"]) <= {f"fill{i}" for i in range(4)}
    assert lost["links"] == []


def queue_of(spans) -> dict:
    (queue,) = named(spans, "kvledger.queue")
    return queue


async def test_the_queue_span_says_what_held_it_back_and_survives_an_abort(redis_url, tiny_model):
    traced = Traced(redis_url, tiny_model, num_blocks=64, max_num_seqs=2)
    stack = traced.stack
    await stack.start()
    try:
        batch = prompts(5, 20, seed=21)
        # r0 ends long before r1, so r2 takes r0's seat while r3 still waits for r1's (ending
        # together, they let r2 and r3 in at one step and r3 never waited at the head).
        for i, (prompt, max_tokens) in enumerate(zip(batch[:4], (4, 24, 12, 12), strict=True)):
            await traced.submit(f"r{i}", prompt, max_tokens)
        await traced.submit("gone", batch[4], 12)
        await stack.abort("gone")  # while two seats are taken and three wait before it
        await stack.wait(["r0", "r1", "r2", "r3", "gone"])
    finally:
        await stack.stop()

    traces = traced.traces()
    # r0 was admitted by the first step after it came: nothing held it but the step loop.
    r0 = queue_of(traces["r0"])["attributes"]
    assert (r0["kvledger.queue.reason"], r0["kvledger.queue.checks"]) == ("next_step", 0)
    # r2 waited at the head for a seat; r3 first behind r2, then at the head for a seat.
    r2 = queue_of(traces["r2"])["attributes"]
    assert (r2["kvledger.queue.reasons"], r2["kvledger.queue.reason"]) == (["seats"], "seats")
    assert r2["kvledger.queue.outcome"] == "admitted"
    r3 = queue_of(traces["r3"])
    a = r3["attributes"]
    assert (a["kvledger.queue.reasons"], a["kvledger.queue.reason"]) == (
        ["queue", "seats"],
        "seats",
    )
    assert sum(a["kvledger.queue.reason_checks"]) == a["kvledger.queue.checks"] > 1
    assert a["kvledger.queue.ahead"] >= 1
    held = [e["attributes"] for e in r3["events"]]
    assert [e["kvledger.queue.reason"] for e in held] == ["queue", "seats"]
    assert held[0]["kvledger.queue.head_request_id"] == "r2"
    # Aborted in the queue: its queue span still says how long, and why.
    gone = queue_of(traces["gone"])["attributes"]
    assert gone["kvledger.queue.outcome"] == "abort"
    assert "kvledger.admit" not in {s["name"] for s in traces["gone"]}


async def test_under_the_priority_policy_the_queue_span_names_priority(redis_url, tiny_model):
    traced = Traced(redis_url, tiny_model, num_blocks=64, max_num_seqs=1, policy="priority")
    stack = traced.stack
    await stack.start()
    try:
        first, low, high = prompts(3, 20, seed=22)
        # Long enough to hold the one seat while the other two arrive, on a loaded machine too
        # (with 8 tokens it could end before they did, and nothing waited).
        await traced.submit("first", first, 96)
        while not stack.results["first"].tokens:
            await asyncio.sleep(0.02)
        await traced.submit("low", low, 4, priority=5)
        await traced.submit("high", high, 4, priority=0)  # comes later, goes first
        await stack.wait(["first", "low", "high"])
    finally:
        await stack.stop()

    traces = traced.traces()
    # low waited behind high (a better priority at the head), then at the head for the seat.
    held = [e["attributes"] for e in queue_of(traces["low"])["events"]]
    assert [e["kvledger.queue.reason"] for e in held][-2:] == ["priority", "seats"]
    assert held[-2]["kvledger.queue.head_request_id"] == "high"
    assert queue_of(traces["high"])["attributes"]["kvledger.queue.reason"] == "seats"


@pytest.fixture
def json_logs():
    """The process's logging as a service configures it (JSON), into a buffer; put back after."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    stream = io.StringIO()
    configure_logging("kvledger-ledger", fmt="json", stream=stream)
    yield stream
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)
    structlog.reset_defaults()


async def test_the_ledgers_lines_about_a_request_carry_its_trace_id(
    redis_url, tiny_model, json_logs
):
    traced = Traced(redis_url, tiny_model, num_blocks=64, max_num_seqs=1, max_model_len=128)
    stack = traced.stack
    await stack.start()
    try:
        first, queued, long = prompts(3, 20, seed=31)
        trace_ids = {"running": await traced.submit("running", first, 60)}
        while not stack.results["running"].tokens:
            await asyncio.sleep(0.02)
        trace_ids["queued"] = await traced.submit("queued", queued, 4)  # no seat: it waits
        await stack.abort("queued")
        await stack.abort("running")
        trace_ids["refused"] = await traced.submit("refused", long * 7, 4)  # past max_model_len
        await stack.wait(["running", "queued", "refused"])
    finally:
        await stack.stop()

    lines = [json.loads(line) for line in json_logs.getvalue().splitlines()]
    about = [line for line in lines if line.get("req_id") in trace_ids]
    assert sorted(line["event"] for line in about) == [
        "request_aborted", "request_aborted", "request_rejected",
    ]  # fmt: skip
    for line in about:
        assert line["trace_id"] == trace_ids[line["req_id"]], line
