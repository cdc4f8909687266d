"""A large fan-out cannot starve a small request (issue 22): through the real gateway, ledger
and worker, `n=60` on a batch of 4 keeps at most half the batch in flight
(gateway.fanout.in_flight_bound), so a request sent meanwhile is admitted at once and waits for
no running sequence of the fan-out to end; and the fan-out's choices are the same whether paced
or not (seeded samples)."""

from __future__ import annotations

import asyncio

from gateway.fanout import in_flight_bound
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
            bound = in_flight_bound(stack.ledger.status())
            assert bound == BATCH // 2
            while len(stack.ledger.scheduler.requests) < bound:  # the fan-out is in
                await asyncio.sleep(0.01)
            peak = 0
            for _ in range(30):  # enqueued at once, all of it would be in by now
                peak = max(peak, len(stack.ledger.scheduler.requests))
                await asyncio.sleep(0.01)
            assert peak <= bound  # half the batch, no more
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
    # The fan-out's sequences that finished between the solo request's arrival and its end: the
    # ones running when it came (half the batch), not the window queued ahead of it and a whole
    # batch's worth (20 with the window alone), nor most of N (enqueued all at once).
    ahead = next(i for i, r in enumerate(finished) if r.startswith("cmpl-solo"))
    print(f"{ahead} of the fan-out's {N} sequences finished while the solo request waited")
    assert ahead <= bound + 2  # 20 of 60 before, with the window alone
    assert len(body["choices"]) == N and body["usage"]["completion_tokens"] == 24 * N
