"""Putting one request's sequences on the ledger's queue fairly. A fan-out (n samples, best_of's
candidates, a batch of prompts) keeps at most `FANOUT_WINDOW` of its sequences waiting for their
first output, and at most `in_flight_bound` of them in flight (enqueued and not yet ended); it
enqueues the next as one starts or ends. A fan-out within the window is enqueued at once.

The ledger's scheduler serves its waiting queue first come, first served, exactly as vLLM does
(the differential tests hold it to that), and never takes a running sequence back for a
newcomer. Enqueued all at once, `best_of=500` would sit in that queue ahead of every request
sent after it: the window bounds that wait. Allowed the whole batch, a fan-out makes a request
sent meanwhile wait for one of its sequences to end (admitted together, they end together: a
whole sequence's lifetime), and then run in a full batch, whose steps cost more the more
sequences they hold. Hence the bound, from the serving ledger's own measured step costs
(`step = base + sequences x per_sequence`, `ledger.step_costs`):

- at most `base / per_sequence` sequences, so the fan-out at most doubles the cost of a step
  beside it: where a sequence costs little next to a step's fixed part (an accelerator) that is
  many, and where every sequence adds much (the CPU), batching more of them gains little;
- at most half the batch (`max_num_seqs // 2`), so a small request finds a free place at the
  next step;
- never fewer than the window (a small fan-out runs whole).

The price: a fan-out alone runs at most that many sequences at a time (about half its
throughput at the most, where the first bound binds).
"""

from __future__ import annotations

import asyncio
import contextlib
import math

from gateway.inflight import Generation
from services.wire.messages import LedgerStatus

FANOUT_WINDOW = 16


def in_flight_bound(status: LedgerStatus | None) -> int | None:
    """How many of one request's sequences may be in flight on the ledger of `status` (None:
    no bound, a ledger that does not say what its steps hold)."""
    if status is None or status.max_num_seqs <= 0:
        return None
    bound = status.max_num_seqs // 2
    costs = status.costs
    if costs is not None and costs.step_s_per_seq > 0:  # measured
        bound = min(bound, max(FANOUT_WINDOW, math.floor(costs.step_base_s / costs.step_s_per_seq)))
    return max(1, bound)


class FanOut:
    """`await fan.start()` enqueues the first window (its errors raise there, as for a single
    request); the rest follow from a task; `await fan.close()` before the generations exit."""

    def __init__(
        self,
        gens: list[Generation],
        stack: contextlib.AsyncExitStack,
        window: int = FANOUT_WINDOW,
        bound: int | None = None,
    ) -> None:
        self.gens = gens
        self.stack = stack
        self.window = window if bound is None else min(window, bound)
        self.free = asyncio.Semaphore(self.window)  # waiting for their first output
        self.room = asyncio.Semaphore(bound) if bound is not None else None  # not yet ended
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        for gen in self.gens[: self.window]:
            await self._enter(gen)
        if len(self.gens) > self.window:
            self.task = asyncio.create_task(self._enter_rest(self.gens[self.window :]))

    async def _enter(self, gen: Generation) -> None:
        if self.room is not None:
            await self.room.acquire()
            gen.on_ended = self.room.release
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
