"""Putting one request's sequences on the ledger's queue fairly. A fan-out (n samples, best_of's
candidates, a batch of prompts) keeps at most `FANOUT_WINDOW` of its sequences waiting for their
first output, and at most `in_flight_bound` of them in flight (enqueued and not yet ended); it
enqueues the next as one starts or ends. A fan-out within both is enqueued at once.

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
- at least one.

The first bound held only above a floor of the window (16) before, so on the CPU (a step of
0.1 s, 10.5 ms a sequence: 9) a fan-out kept 16 in flight, and a request sent beside its first
sequences (admitted together, they end together) ran its whole life in steps of 32 sequences
instead of 16: 1.6x the cost by the ledger's own measure, up to 2x measured.

The price: a fan-out alone runs at most that many sequences at a time (about half its
throughput at the most, where the first bound binds).

That bound is the fan-out's alone. Beside other requests it is shared (`Shares`): each of the
gateway's requests in flight gets an equal part, at least one sequence, so a fan-out beside 16
normal requests keeps one sequence in flight, not 16, and its sequences that end are not
replaced while the others run (steps on the CPU cost more the more sequences they hold: beside
a fan-out that kept its whole bound, the normal requests' steps held twice their sequences).
A request that leaves gives its part back: the fan-outs take up the room again at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import math

from gateway.inflight import Generation
from gateway.shares import Shares
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
        bound = min(bound, math.floor(costs.step_base_s / costs.step_s_per_seq))
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
        shares: Shares | None = None,
    ) -> None:
        self.gens = gens
        self.stack = stack
        self.window = window if bound is None else min(window, bound)
        self.free = asyncio.Semaphore(self.window)  # waiting for their first output
        self.bound = bound
        self.shares = shares
        self.in_flight = 0  # enqueued, not yet ended
        self._room = asyncio.Event()  # set when one ends or a request leaves the gateway
        self.task: asyncio.Task | None = None

    def limit(self) -> int | None:
        """How many of its sequences may be in flight now (None: no bound)."""
        if self.bound is None:
            return None
        return self.bound if self.shares is None else self.shares.part(self.bound)

    async def start(self) -> None:
        first = min(self.window, self.limit() or self.window)
        for gen in self.gens[:first]:
            await self._enter(gen)
        if len(self.gens) > first:
            self.task = asyncio.create_task(self._enter_rest(self.gens[first:]))

    async def _enter(self, gen: Generation) -> None:
        await self._wait_for_room()
        self.in_flight += 1
        gen.on_ended = self._ended
        await self.free.acquire()
        gen.on_started = self.free.release
        await self.stack.enter_async_context(gen)

    async def _wait_for_room(self) -> None:
        while (limit := self.limit()) is not None and self.in_flight >= limit:
            self._room.clear()
            if self.shares is None:
                await self._room.wait()
                continue
            self.shares.wake_on_leave(self._room)
            try:
                await self._room.wait()
            finally:
                self.shares.forget(self._room)

    def _ended(self) -> None:
        self.in_flight -= 1
        self._room.set()

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
