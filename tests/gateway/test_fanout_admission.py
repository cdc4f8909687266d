"""Fan-out pays its share (issue 22): every sequence a request asks for (prompts x n, or x
best_of) takes a place in max_queue; a request that could never fit gets a 400 naming the field
and the limit at once, before its body is tokenized; a full gateway refuses before reading the
body; and a fan-out keeps at most FANOUT_WINDOW sequences waiting on the ledger at a time."""

from __future__ import annotations

import asyncio
import time

from gateway import generate
from gateway.fanout import FANOUT_WINDOW
from gateway.prompts import MAX_N_SEQUENCES
from services.transport import redis_streams
from services.wire import codec
from services.wire.messages import OutputBatch, RequestOutput
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
    await ledger.wait_for_requests(FANOUT_WINDOW)
    await asyncio.sleep(0.5)
    assert len(ledger.requests) == FANOUT_WINDOW  # the rest wait for a sequence to start

    # Three sequences start (their first token): three more are enqueued, no others.
    outputs = f"{prefix}:{{default}}:outputs:{GATEWAY_ID}"
    for req in ledger.requests[:3]:
        first = RequestOutput(req.req_id, [72], position=0, num_prompt_tokens=2)
        await redis.xadd(outputs, {redis_streams.FIELD: codec.encode(OutputBatch([first]))})
    await ledger.wait_for_requests(FANOUT_WINDOW + 3)
    await asyncio.sleep(0.5)
    assert len(ledger.requests) == FANOUT_WINDOW + 3
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
