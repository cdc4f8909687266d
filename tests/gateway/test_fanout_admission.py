"""Fan-out pays its share (issue 22): every sequence a request asks for (prompts x n, or x
best_of) takes a place in max_queue; a request that could never fit gets a 400 naming the field
and the limit at once, before its body is tokenized; a full gateway refuses before reading the
body; and a fan-out keeps at most FANOUT_WINDOW sequences waiting on the ledger at a time."""

from __future__ import annotations

import asyncio
import time

from gateway import generate
from gateway.fanout import FANOUT_WINDOW, in_flight_bound
from gateway.prompts import MAX_N_SEQUENCES
from services.transport import redis_streams
from services.wire import codec
from services.wire.messages import LedgerStatus, OutputBatch, RequestOutput, RoutingCosts
from tests.gateway.fake_ledger import Script
from tests.gateway.helpers import GATEWAY_ID, assert_error


async def test_a_request_that_could_never_fit_gets_a_400_naming_the_field(
    start_gateway, start_ledger, monkeypatch
):
    ledger = await start_ledger()
    client = await start_gateway()  # the default max_queue: 512
    tokenized: list[str] = []
    parse = generate._parse
    monkeypatch.setattr(generate, "_parse", lambda *a: tokenized.append("x") or parse(*a))
    cases = [
        ({"prompt": "x", "n": MAX_N_SEQUENCES}, "n", "16384 sequences"),
        ({"prompt": "x", "n": 513}, "n", "at most 512 sequences in flight (max_queue"),
        ({"prompt": "x", "best_of": 600}, "best_of", "600 sequences"),
        ({"prompt": ["a", "b"], "n": 300}, "n", "2 prompt(s) x 300 samples"),
        ({"prompt": ["a"] * 1024, "max_tokens": 1}, "prompt", "1024 sequences"),
    ]
    for body, param, fragment in cases:
        started = time.monotonic()
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 400, body
        assert_error(await resp.json(), param, fragment)
        assert time.monotonic() - started < 5  # at once, not after a wait
    resp = await client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 600}
    )
    assert resp.status == 400
    assert_error(await resp.json(), "n", "600 sequences")
    assert tokenized == [] and ledger.requests == []  # refused before any tokenizing
    # vLLM's own limit stays the upper bound whatever max_queue is.
    big = await start_gateway(max_queue=10**6)
    resp = await big.post("/v1/completions", json={"prompt": ["a", "b"], "n": 10_000})
    assert resp.status == 400
    assert_error(await resp.json(), "n", f"at most {MAX_N_SEQUENCES} are allowed")


async def test_each_sequence_takes_a_place_in_max_queue(start_gateway, start_ledger, redis):
    ledger = await start_ledger(Script(silent=True))
    client = await start_gateway(max_queue=8)
    held = asyncio.ensure_future(
        client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 3, "max_tokens": 2})
    )
    await ledger.wait_for_requests(6)
    health = await (await client.get("/health")).json()
    assert health["in_flight"] == 6
    resp = await client.post("/v1/completions", json={"prompt": "x", "n": 3, "max_tokens": 2})
    assert resp.status == 429 and resp.headers["Retry-After"] == "1"
    assert_error(
        await resp.json(), None, "6 sequences in flight (max_queue=8); this request needs 3"
    )
    resp = await client.post("/v1/completions", json={"prompt": ["a"] * 3, "max_tokens": 2})
    assert resp.status == 429  # a batch of prompts counts each
    fits = asyncio.ensure_future(
        client.post("/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 2})
    )
    await ledger.wait_for_requests(8)
    assert (await (await client.get("/health")).json())["in_flight"] == 8
    started = time.monotonic()
    resp = await client.post("/v1/completions", data=b'{"prompt": "x"}')
    assert resp.status == 429  # full: refused before the body is read
    assert time.monotonic() - started < 5
    held.cancel()
    fits.cancel()
    await asyncio.gather(held, fits, return_exceptions=True)


async def test_a_fan_out_keeps_a_window_of_sequences_waiting_on_the_ledger(
    start_gateway, start_ledger, redis, prefix
):
    ledger = await start_ledger(Script(silent=True))  # it reads requests and answers none
    client = await start_gateway(max_queue=64)
    total = FANOUT_WINDOW + 24
    task = asyncio.ensure_future(
        client.post("/v1/completions", json={"prompt": "x", "n": total, "max_tokens": 2})
    )
    await _settles_at(ledger, FANOUT_WINDOW)  # the rest wait for a sequence to start

    # Three sequences start (their first token): three more are enqueued, no others.
    outputs = f"{prefix}:{{default}}:outputs:{GATEWAY_ID}"
    for req in ledger.requests[:3]:
        first = RequestOutput(req.req_id, [72], position=0, num_prompt_tokens=2)
        await redis.xadd(outputs, {redis_streams.FIELD: codec.encode(OutputBatch([first]))})
    await _settles_at(ledger, FANOUT_WINDOW + 3)
    # Seeds in order, one per sample, as when enqueued at once.
    assert len({r.req_id for r in ledger.requests}) == FANOUT_WINDOW + 3

    # The client leaves: every enqueued sequence is aborted, and nothing more is enqueued.
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    deadline = time.monotonic() + 10
    while len(ledger.aborts) < FANOUT_WINDOW + 3:
        assert time.monotonic() < deadline, len(ledger.aborts)
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    assert len(ledger.requests) == FANOUT_WINDOW + 3
    assert {a.req_id for a in ledger.aborts} == {r.req_id for r in ledger.requests}


async def test_a_fan_out_holds_at_most_half_the_ledgers_batch_in_flight(
    start_gateway, start_ledger, redis, prefix
):
    """On a ledger whose steps hold 12 sequences (max_num_seqs, from its status), a fan-out of
    40 keeps at most 6 in flight (enqueued, not ended): the next goes in as one ends, not as
    one starts. Before, started ones were replaced at once, and the fan-out filled the batch."""
    ledger = await start_ledger(Script(silent=True), max_num_seqs=12)
    client = await start_gateway(max_queue=64)
    task = asyncio.ensure_future(
        client.post("/v1/completions", json={"prompt": "x", "n": 40, "max_tokens": 2})
    )
    outputs = f"{prefix}:{{default}}:outputs:{GATEWAY_ID}"

    async def answer(reqs: list, finished: bool) -> None:
        for req in reqs:
            out = RequestOutput(req.req_id, [72], position=int(finished), num_prompt_tokens=2)
            out.finished, out.finish_reason = finished, "length" if finished else None
            await redis.xadd(outputs, {redis_streams.FIELD: codec.encode(OutputBatch([out]))})

    await _settles_at(ledger, 6)
    await answer(ledger.requests[:6], finished=False)  # every one starts: none more goes in
    await asyncio.sleep(0.5)
    assert len(ledger.requests) == 6
    await answer(ledger.requests[:2], finished=True)  # two end: two more go in
    await _settles_at(ledger, 8)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_fan_out_shares_its_bound_with_the_requests_beside_it(
    start_gateway, start_ledger, redis, prefix
):
    """A bound of 6 (a batch of 12), shared among the gateway's requests in flight: beside two
    normal requests the fan-out's part is 6 // 3 = 2, so of its 6 sequences in flight, 4 that
    end are not replaced (before, each was at once: the normal requests' steps kept holding 6
    of the fan-out's); once the normal requests are answered, it takes its whole bound again."""
    ledger = await start_ledger(Script(silent=True), max_num_seqs=12)
    client = await start_gateway(max_queue=64)
    fan = asyncio.ensure_future(
        client.post("/v1/completions", json={"prompt": "x", "n": 40, "max_tokens": 2})
    )
    outputs = f"{prefix}:{{default}}:outputs:{GATEWAY_ID}"

    async def finish(reqs: list) -> None:
        for req in reqs:
            out = RequestOutput(req.req_id, [72], position=0, num_prompt_tokens=2)
            out.finished, out.finish_reason = True, "length"
            await redis.xadd(outputs, {redis_streams.FIELD: codec.encode(OutputBatch([out]))})

    await ledger.wait_for_requests(6)
    fan_outs = list(ledger.requests)
    normals = [
        asyncio.ensure_future(
            client.post("/v1/completions", json={"prompt": f"normal {i}", "max_tokens": 1})
        )
        for i in range(2)
    ]
    await ledger.wait_for_requests(8)
    await asyncio.sleep(0.3)
    assert len(ledger.requests) == 8
    beside = ledger.requests[6:]
    assert {r.req_id for r in beside}.isdisjoint(r.req_id for r in fan_outs)
    await finish(fan_outs[:4])  # 2 of the fan-out's left in flight: its part, no more goes in
    await asyncio.sleep(0.5)
    assert len(ledger.requests) == 8, [r.prompt_token_ids for r in ledger.requests[8:]]
    await finish(fan_outs[4:5])  # 1 left: one more goes in
    await _settles_at(ledger, 9)
    await finish(beside)
    assert [(await n).status for n in normals] == [200, 200]
    # Alone again: its whole bound of 6, of which 2 are in flight, so 4 more go in.
    await _settles_at(ledger, 13)
    fan.cancel()
    await asyncio.gather(fan, return_exceptions=True)


async def test_a_fan_out_whose_sequences_stop_on_a_stop_string_stays_within_its_bound(
    start_gateway, start_ledger
):
    """A sequence the gateway ends (its stop string) is aborted on the ledger at once, not when
    the whole response ends, so the next one going in does not take the fan-out past its bound
    on the ledger (before, each stopped one ran on to max_tokens there: all 20 at once)."""
    ledger = await start_ledger(Script(delay_s=0.02), max_num_seqs=8)  # a bound of 4
    client = await start_gateway(max_queue=64)
    body = {"prompt": "x", "n": 20, "max_tokens": 60, "stop": "from"}
    resp = await client.post("/v1/completions", json=body)
    answer = await resp.json()
    assert resp.status == 200, answer
    assert {c["text"] for c in answer["choices"]} == {"Hello "}
    assert {c["finish_reason"] for c in answer["choices"]} == {"stop"}
    assert ledger.peak_answering <= 4, ledger.peak_answering
    assert len(ledger.aborts) == 20 and {a.reason for a in ledger.aborts} == {"stop_string"}


async def _settles_at(ledger, count: int) -> None:
    """The ledger gets `count` requests and, half a second on, still no more."""
    await ledger.wait_for_requests(count)
    await asyncio.sleep(0.5)
    assert len(ledger.requests) == count


def _status(max_num_seqs: int, costs: RoutingCosts | None = None) -> LedgerStatus:
    return LedgerStatus(
        epoch="e", started_at=0.0, updated_at=0.0, model_name="m", max_model_len=64,
        vocab_size=258, block_size=16, num_gpu_blocks=100, capacity_line="", hash_algo="sha256",
        num_workers=1, max_num_seqs=max_num_seqs, costs=costs,
    )  # fmt: skip


def test_the_in_flight_bound_follows_the_ledgers_batch_and_measured_step_costs():
    # A ledger that does not say what its steps hold: no bound (the window only).
    assert in_flight_bound(None) is None and in_flight_bound(_status(0)) is None
    # Step costs not measured yet: half the batch.
    assert in_flight_bound(_status(64)) == 32
    assert in_flight_bound(_status(64, RoutingCosts(step_base_s=0.1))) == 32
    # Measured on the CPU (benchmarks/fanout.py's worker: 0.1 s a step, 10.5 ms a sequence):
    # 9 sequences double a step (16 before: the window was a floor, and normal requests beside
    # the fan-out's first sequences ran in steps of twice their own sequences).
    cpu = RoutingCosts(step_base_s=0.0977, step_s_per_seq=0.0106)
    assert in_flight_bound(_status(64, cpu)) == 9
    # A sequence that costs more than a step's fixed part: one at a time.
    assert in_flight_bound(_status(64, RoutingCosts(step_base_s=0.01, step_s_per_seq=0.02))) == 1
    # An accelerator's step hardly grows with its sequences: half the batch binds.
    accelerator = RoutingCosts(step_base_s=0.012, step_s_per_seq=0.00004)
    assert in_flight_bound(_status(256, accelerator)) == 128
    # In between: what doubles a step.
    assert in_flight_bound(_status(256, RoutingCosts(step_base_s=0.05, step_s_per_seq=0.001))) == 50
    # A batch smaller than the window: half of it, at least one.
    assert in_flight_bound(_status(4, cpu)) == 2
    assert in_flight_bound(_status(1)) == 1


async def test_a_fan_out_past_the_window_is_answered_whole(start_gateway, start_ledger):
    await start_ledger(Script(vary_by_seed=True))
    client = await start_gateway(max_queue=128)
    n = FANOUT_WINDOW * 3 + 5
    resp = await client.post(
        "/v1/completions", json={"prompt": "x", "n": n, "max_tokens": 3, "seed": 1}
    )
    body = await resp.json()
    assert resp.status == 200, body
    assert [c["index"] for c in body["choices"]] == list(range(n))
    assert body["usage"]["completion_tokens"] == 3 * n
    resp = await client.post(
        "/v1/completions", json={"prompt": "x", "best_of": 40, "max_tokens": 2, "seed": 1}
    )
    assert resp.status == 200
    assert len((await resp.json())["choices"]) == 1
