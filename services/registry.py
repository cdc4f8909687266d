"""Worker registration and liveness through expiring keys.

A worker keeps `StreamNames.worker(group, worker_id)` set to its WorkerHello with a short TTL and
refreshes it as a heartbeat; the key vanishing means the worker is gone. A restarted worker
writes a new `started_at`, so the ledger tells a restart from a heartbeat.
"""

from __future__ import annotations

from typing import cast

import redis.asyncio as aioredis

from services import wire
from services.keys import StreamNames
from services.messages import WorkerHello


async def register(
    r: aioredis.Redis, streams: StreamNames, hello: WorkerHello, ttl_s: float
) -> None:
    await r.set(
        streams.worker(hello.group, hello.worker_id), wire.encode(hello), px=int(ttl_s * 1000)
    )


async def unregister(r: aioredis.Redis, streams: StreamNames, hello: WorkerHello) -> None:
    await r.delete(streams.worker(hello.group, hello.worker_id))


async def live_workers(
    r: aioredis.Redis, streams: StreamNames, group: str
) -> dict[str, WorkerHello]:
    """Every worker of the group whose heartbeat key is alive (malformed keys are skipped)."""
    workers: dict[str, WorkerHello] = {}
    async for key in r.scan_iter(match=streams.worker(group, "*"), count=100):
        data = cast("bytes | None", await r.get(key))
        if data is None:
            continue
        try:
            hello = wire.decode(data, WorkerHello)
        except wire.WireError:
            continue
        workers[hello.worker_id] = hello
    return workers
