"""Issue 22: a large malformed entry goes to the dead letters, truncated, and leaves its source
stream, wherever it was written: the requests stream (the ledger's intake), the results stream
(the ledger's results reader), a steps stream (a worker) and a gateway's outputs stream (the
gateway's reader). Once it was dead-lettered, 10 MB of garbage no longer sits in Redis, and the
stack goes on serving. The real gateway, ledger and worker in process."""

from __future__ import annotations

import asyncio
import time

from services.transport import redis_streams
from tests.harness.gateway_stack import gateway_on
from tests.harness.stack import Stack

GARBAGE = b"\xc1" * (10 * 1024 * 1024)  # 10 MiB that are not msgpack


async def test_a_10mb_malformed_entry_is_dead_lettered_and_leaves_its_source_stream(
    redis_url, tiny_model
):
    stack = await Stack(redis_url, tiny_model, num_blocks=64).start()
    r, streams = stack.r, stack.streams
    try:
        async with gateway_on(stack) as client:
            sources = [streams.requests, streams.results, streams.steps("default"),
                       streams.outputs("gw-stack")]  # fmt: skip
            written = {s: await r.xadd(s, {redis_streams.FIELD: GARBAGE}) for s in sources}
            deadline = time.monotonic() + 30
            while True:
                dead = await r.xrange(streams.dead_letters)
                seen = {(f[b"source_stream"].decode(), f[b"source_id"]) for _, f in dead}
                if set(written.items()) <= seen:
                    break
                assert time.monotonic() < deadline, f"not dead-lettered: {written}, {seen}"
                await asyncio.sleep(0.1)
            for _, fields in dead:
                assert fields[b"size:m"] == str(len(GARBAGE)).encode()
                assert len(fields[b"orig:m"]) == redis_streams.DEAD_LETTER_PREFIX_BYTES
            deadline = time.monotonic() + 10
            for stream, entry_id in written.items():
                while await r.xrange(stream, entry_id, entry_id):
                    assert time.monotonic() < deadline, f"{stream} still holds {entry_id!r}"
                    await asyncio.sleep(0.05)
                usage = await r.memory_usage(stream) or 0
                assert usage < 1024 * 1024, f"{stream} still takes {usage} bytes"
            assert await r.memory_usage(streams.dead_letters) < 1024 * 1024
            resp = await client.post("/v1/completions", json={"prompt": "go on", "max_tokens": 4})
            assert resp.status == 200, await resp.text()
    finally:
        await stack.stop()
