"""The waiting queue: first come first served, or by priority (lower first, then arrival)."""

from __future__ import annotations

import heapq
from collections import deque
from typing import Generic

from ledger.request import P, Request


class WaitingQueue(Generic[P]):
    """FCFS (a deque) or priority (a heap ordered by Request.__lt__) waiting queue."""

    def __init__(self, policy: str) -> None:
        self.priority = policy == "priority"
        self._fcfs: deque[Request[P]] = deque()
        self._heap: list[Request[P]] = []

    def add(self, request: Request[P]) -> None:
        if self.priority:
            heapq.heappush(self._heap, request)
        else:
            self._fcfs.append(request)

    def prepend(self, request: Request[P]) -> None:
        """A preempted request goes back to the front (its own priority decides in a heap)."""
        if self.priority:
            heapq.heappush(self._heap, request)
        else:
            self._fcfs.appendleft(request)

    def peek(self) -> Request[P]:
        return self._heap[0] if self.priority else self._fcfs[0]

    def pop(self) -> Request[P]:
        return heapq.heappop(self._heap) if self.priority else self._fcfs.popleft()

    def remove(self, request: Request[P]) -> None:
        if self.priority:
            self._heap.remove(request)
            heapq.heapify(self._heap)
        else:
            self._fcfs.remove(request)

    def num_ahead(self, request: Request[P]) -> int:
        """How many waiting requests come before `request` (which must be waiting)."""
        if self.priority:
            return sum(1 for other in self._heap if other < request)
        return self._fcfs.index(request)

    def __iter__(self):
        return iter(sorted(self._heap) if self.priority else self._fcfs)

    def __len__(self) -> int:
        return len(self._heap) if self.priority else len(self._fcfs)
