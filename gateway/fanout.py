"""Putting one request's sequences on the ledger's queue fairly: a fan-out (n samples, best_of's
candidates, a batch of prompts) keeps at most `FANOUT_WINDOW` of its sequences waiting for
their first output at a time, and enqueues the next as one starts (its first output) or ends.

The ledger's scheduler serves its waiting queue first come, first served, exactly as vLLM does
(the differential tests hold it to that). Enqueued all at once, `best_of=500` would sit in that
queue ahead of every request sent after it, which would wait for all 500 to be admitted; paced,
a request sent meanwhile waits behind at most FANOUT_WINDOW of them (and for a running sequence
to finish where the batch is full), while a fan-out alone still fills the batch: the window
refills as fast as its sequences are admitted. A fan-out within the window is enqueued at once,
as before.
"""

from __future__ import annotations

import asyncio
import contextlib

from gateway.inflight import Generation

FANOUT_WINDOW = 16


class FanOut:
    """`await fan.start()` enqueues the first window (its errors raise there, as for a single
    request); the rest follow from a task; `await fan.close()` before the generations exit."""

    def __init__(
        self, gens: list[Generation], stack: contextlib.AsyncExitStack, window: int = FANOUT_WINDOW
    ) -> None:
        self.gens = gens
        self.stack = stack
        self.window = window
        self.free = asyncio.Semaphore(window)
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        for gen in self.gens[: self.window]:
            await self._enter(gen)
        if len(self.gens) > self.window:
            self.task = asyncio.create_task(self._enter_rest(self.gens[self.window :]))

    async def _enter(self, gen: Generation) -> None:
        await self.free.acquire()
        gen.on_started = self.free.release
        await self.stack.enter_async_context(gen)

    async def _enter_rest(self, rest: list[Generation]) -> None:
        for i, gen in enumerate(rest):
            try:
                await self._enter(gen)
            except Exception as exc:  # no replica, Redis gone: the response fails with it
                for never in rest[i:]:
                    never.refuse(exc)
                return

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
