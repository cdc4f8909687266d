"""The requests stream as the engine loop sees it: a reader task fills a queue (riding out Redis
outages), and the engine loop drains it between steps and sleeps on it when it has nothing to do.

One ledger leads a replica (the lease in `leadership`): a fixed consumer name lets a restarted or
standby ledger that takes over re-read the requests its predecessor had not finished.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.transport import redis_streams
from services.transport.keys import StreamNames

CONSUMER = "ledger"


class RequestIntake:
    def __init__(
        self, r: aioredis.Redis, streams: StreamNames, on_outage: Callable[[str], None]
    ) -> None:
        self.reader = redis_streams.GroupReader(r, [streams.requests], "ledger", CONSUMER)
        self.queue: asyncio.Queue[redis_streams.Entry] = asyncio.Queue()
        self.event = asyncio.Event()
        self.on_outage = on_outage

    async def read_forever(self) -> None:
        reconnect = redis_streams.Reconnect("intake", self.on_outage)
        while True:
            try:
                entries = await self.reader.read(count=256, block_ms=1000)
            except (RedisError, OSError) as exc:
                await reconnect.failed(exc)
                continue
            reconnect.succeeded()
            for entry in entries:
                self.queue.put_nowait(entry)
            if entries:
                self.event.set()

    def drain(self) -> list[redis_streams.Entry]:
        entries = []
        while not self.queue.empty():
            entries.append(self.queue.get_nowait())
        return entries

    def wake(self) -> None:
        """End the engine loop's idle wait (a status tick, a stop, a crashed task)."""
        self.event.set()

    async def wait(self, timeout: float) -> None:
        self.event.clear()
        if self.queue.empty():
            with contextlib.suppress(TimeoutError):
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
                # that lands as it times out, and the ledger would then never stop.
                async with asyncio.timeout(timeout):
                    await self.event.wait()
