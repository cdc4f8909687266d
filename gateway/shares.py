"""The gateway's requests in flight, among which each fan-out's in-flight bound is shared
(`gateway.fanout`): each request gets an equal part of a bound, at least one sequence.
"""

from __future__ import annotations

import asyncio


class Shares:
    """The gateway's requests in flight (admitted, not yet answered), among which each
    fan-out's bound is shared; a fan-out waiting for room is woken when one leaves."""

    def __init__(self) -> None:
        self.requests = 0
        self._waiting: set[asyncio.Event] = set()

    def enter(self) -> None:
        self.requests += 1

    def leave(self) -> None:
        self.requests -= 1
        for wake in self._waiting:
            wake.set()

    def wake_on_leave(self, event: asyncio.Event) -> None:
        self._waiting.add(event)

    def forget(self, event: asyncio.Event) -> None:
        self._waiting.discard(event)

    def part(self, bound: int) -> int:
        """A request's part of `bound`: an equal share among the requests in flight, at least 1."""
        return max(1, bound // max(1, self.requests))
