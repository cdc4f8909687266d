"""Issue 22: a worker lost for good ends the requests it held with a 503 and Retry-After (the
service cannot serve them now; a worker that comes back would), not a 500 (a crash). The real
gateway, ledger and worker in process; the worker is stopped and nothing restarts it."""

from __future__ import annotations

import asyncio

from tests.gateway.helpers import assert_error
from tests.harness.gateway_stack import gateway_on
from tests.harness.stack import Stack


async def test_requests_held_when_the_last_worker_is_lost_get_503_with_retry_after(
    redis_url, tiny_model
):
    stack = await Stack(redis_url, tiny_model, num_blocks=64, no_worker_timeout_s=1.0).start()
    try:
        async with gateway_on(stack, stall_timeout_s=60.0) as client:
            body = {"prompt": "a request the worker will not finish", "max_tokens": 200,
                    "temperature": 0}  # fmt: skip
            held = asyncio.ensure_future(client.post("/v1/completions", json=body))
            while not stack.ledger.scheduler.running:
                assert not held.done(), await (await held).text()
                await asyncio.sleep(0.01)
            await stack.kill_worker("w0")
            resp = await asyncio.wait_for(held, 30)
            assert resp.status == 503, await resp.text()
            assert resp.headers["Retry-After"] == "1"
            payload = await resp.json()
            assert_error(payload, None, "no worker of group 'default'")
            assert payload["error"]["type"] == "ServiceUnavailableError"
    finally:
        await stack.stop()
