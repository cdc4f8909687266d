"""A large fan-out cannot starve a small request (issue 22): through the real gateway, ledger
and worker, a request sent while `n=60` runs on a batch of 4 is served after at most the
fan-out's window of sequences (gateway.fanout), not after all 60, and the fan-out's choices are
the same whether paced or not (seeded samples)."""

from __future__ import annotations

import asyncio

from gateway.fanout import FANOUT_WINDOW
from services.transport import redis_streams
from services.wire import codec
from services.wire.messages import OutputBatch
from tests.harness.gateway_stack import gateway_on
from tests.harness.stack import Stack

N = 60
BATCH = 4  # max_num_seqs: the ledger runs 4 sequences at a time


async def test_a_request_sent_during_a_large_fan_out_is_not_queued_behind_it(redis_url, tiny_model):
    stack = await Stack(redis_url, tiny_model, num_blocks=128, max_num_seqs=BATCH).start()
    try:
        async with gateway_on(stack, max_queue=128) as client:
            common = {"max_tokens": 24, "ignore_eos": True, "temperature": 1.0}
            fan = asyncio.ensure_future(
                client.post(
                    "/v1/completions",
                    json={"prompt": "fan out", "n": N, "seed": 3, "request_id": "fan", **common},
                )
            )
            while len(stack.ledger.scheduler.requests) < FANOUT_WINDOW:  # the fan-out is in
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # enqueued at once, all of it would be in by now
            outputs = stack.streams.outputs("gw-stack")
            sent_at = (await stack.r.xrevrange(outputs, count=1))[0][0]
            solo = await client.post(
                "/v1/completions", json={"prompt": "solo", "request_id": "solo", **common}
            )
            assert solo.status == 200, await solo.text()
            resp = await fan
            body = await resp.json()
            assert resp.status == 200, body
            entries = await stack.r.xrange(outputs, min=f"({sent_at.decode()}")
    finally:
        await stack.stop()
    finished = [
        out.req_id
        for _, fields in entries
        for out in codec.decode(fields[redis_streams.FIELD], OutputBatch).outputs
        if out.finished
    ]
    # The fan-out's sequences that finished between the solo request's arrival and its end: it
    # queued behind the window of waiting children and the batch running when it came, not
    # behind the whole fan-out (most of its N sequences when enqueued all at once).
    ahead = next(i for i, r in enumerate(finished) if r.startswith("cmpl-solo"))
    print(f"{ahead} of the fan-out's {N} sequences finished while the solo request waited")
    assert ahead <= FANOUT_WINDOW + 2 * BATCH
    assert len(body["choices"]) == N and body["usage"]["completion_tokens"] == 24 * N
