"""Where the tier's chunks live and which one goes first: vLLM 0.33's `lru` and `arc` policies.

A policy owns the key -> Chunk map and the eviction order; the manager owns ref counts, the chunk
pool and events. `evict` is all-or-nothing: it takes exactly n evictable chunks (ref_cnt 0, not
protected) or changes nothing and returns None.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain

from ledger.offloading.base import Chunk, OffloadKey, RequestContext, order_request_keys

Rank = tuple[int, int]


class CachePolicy:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    def get(self, key: OffloadKey) -> Chunk | None:
        raise NotImplementedError

    def insert(self, key: OffloadKey, chunk: Chunk, context: RequestContext) -> None:
        raise NotImplementedError

    def remove(self, key: OffloadKey) -> None:
        raise NotImplementedError

    def touch(self, keys: Sequence[OffloadKey], context: RequestContext) -> None:
        raise NotImplementedError

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, Chunk]] | None:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError

    def items(self) -> Iterable[tuple[OffloadKey, Chunk]]:
        """Every key the tier holds (being written or not) with its chunk."""
        raise NotImplementedError

    def on_store_miss(self, keys: Sequence[OffloadKey], context: RequestContext) -> None:
        """Keys offered for storing that the tier does not hold, once per request each."""
        self.touch(keys, context)

    def on_request_access(self, keys: Sequence[OffloadKey], context: RequestContext) -> None:
        """Keys a running request used for the first time (loaded, or offered for storing)."""

    def on_request_finished(
        self,
        keys: list[OffloadKey],
        inserted_only: set[OffloadKey],
        reused: set[OffloadKey],
        context: RequestContext,
    ) -> None:
        """Every key the request used, in the order observed; what it stored; what it read."""
        raise NotImplementedError

    def mark_evictable(self, key: OffloadKey) -> None:
        """The chunk's ref_cnt became 0."""

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """The chunk's ref_cnt left 0."""


class LRUPolicy(CachePolicy):
    """Least recently used first, where "used" is a rank: (counter, -end_token).

    A store or a touch gives a key a fresh counter value. A running request holds one counter
    value for all its keys, with the key's end position as the tie-break, so within a request the
    tail is evicted before the head; when the request finishes its keys take fresh values tail
    to head. The evictable keys wait in a heap whose stale entries (a key since re-ranked,
    pinned or evicted) are dropped when they surface: evicting takes the smallest
    (rank, key) among evictable, unprotected keys.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.chunks: dict[OffloadKey, Chunk] = {}
        self.ranks: dict[OffloadKey, Rank] = {}
        self.evictable: set[OffloadKey] = set()
        self.heap: list[tuple[Rank, OffloadKey]] = []
        self.next_rank = 0
        self.generation = 0

    def _request_rank(self, context: RequestContext) -> int:
        note = context.lru_rank
        if note is None or note[0] is not self or note[1] != self.generation:
            self.next_rank += 1
            note = context.lru_rank = (self, self.generation, self.next_rank)
        return note[2]

    def _push(self, key: OffloadKey) -> None:
        heapq.heappush(self.heap, (self.ranks[key], key))

    def _rebuild_heap(self) -> None:
        self.heap = [(self.ranks[key], key) for key in self.evictable]
        heapq.heapify(self.heap)

    def _bound_heap(self) -> None:
        # Stale entries pile up when keys are re-ranked or pinned; rebuild once they dominate.
        if len(self.heap) >= max(64, 2 * len(self.evictable)):
            self._rebuild_heap()

    def _reheap(self, reranked_evictable: list[OffloadKey]) -> None:
        if not reranked_evictable:
            return
        if len(reranked_evictable) >= max(64, len(self.evictable) // 4):
            self._rebuild_heap()
        else:
            for key in reranked_evictable:
                self._push(key)
            self._bound_heap()

    def _refresh(self, keys: Iterable[OffloadKey]) -> None:
        """Give each present key a fresh rank, in the order given (the last is the most recent)."""
        reranked: list[OffloadKey] = []
        for key in keys:
            if key in self.chunks:
                self.next_rank += 1
                self.ranks[key] = (self.next_rank, 0)
                if key in self.evictable:
                    reranked.append(key)
        self._reheap(reranked)

    def get(self, key: OffloadKey) -> Chunk | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: Chunk, context: RequestContext) -> None:
        self.chunks[key] = chunk
        position = context.key_positions.get(key)
        if position is None:
            self.next_rank += 1
            self.ranks[key] = (self.next_rank, 0)
        else:
            self.ranks[key] = (self._request_rank(context), -position)
        if chunk.ref_cnt == 0:
            self.evictable.add(key)
            self._push(key)

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self.ranks.pop(key, None)
        self.evictable.discard(key)

    def touch(self, keys: Sequence[OffloadKey], context: RequestContext) -> None:
        # The first key given is the most recently used.
        self._refresh(reversed(keys))

    def on_request_access(self, keys: Sequence[OffloadKey], context: RequestContext) -> None:
        request_rank = self._request_rank(context)
        positions = context.key_positions
        reranked: list[OffloadKey] = []
        for key in keys:
            position = positions.get(key)
            if position is None or key not in self.chunks:
                continue
            rank = (request_rank, -position)
            # Only ever moves a key towards the recent end.
            if self.ranks[key] >= rank:
                continue
            self.ranks[key] = rank
            if key in self.evictable:
                reranked.append(key)
        self._reheap(reranked)

    def on_request_finished(
        self,
        keys: list[OffloadKey],
        inserted_only: set[OffloadKey],
        reused: set[OffloadKey],
        context: RequestContext,
    ) -> None:
        # Tail first, so the head of the request's prefix ends the most recent.
        self._refresh(reversed(order_request_keys(keys, context)))

    def items(self) -> Iterable[tuple[OffloadKey, Chunk]]:
        return self.chunks.items()

    def clear(self) -> None:
        self.chunks.clear()
        self.ranks.clear()
        self.evictable.clear()
        self.heap.clear()
        self.next_rank = 0
        self.generation += 1

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, Chunk]] | None:
        if n == 0:
            return []
        heap, ranks, evictable = self.heap, self.ranks, self.evictable
        taken: list[tuple[Rank, OffloadKey]] = []
        taken_keys: set[OffloadKey] = set()
        skipped: list[tuple[Rank, OffloadKey]] = []
        while heap and len(taken) < n:
            entry = heapq.heappop(heap)
            rank, key = entry
            if key not in evictable or ranks.get(key) != rank or key in taken_keys:
                continue  # stale, or a second entry for a key already taken
            if key in protected:
                skipped.append(entry)
                continue
            taken.append(entry)
            taken_keys.add(key)
        for entry in skipped:
            heapq.heappush(heap, entry)
        if len(taken) < n:
            for entry in taken:
                heapq.heappush(heap, entry)
            return None
        evicted: list[tuple[OffloadKey, Chunk]] = []
        for _, key in taken:
            evictable.remove(key)
            del ranks[key]
            evicted.append((key, self.chunks.pop(key)))
        self._bound_heap()
        return evicted

    def mark_evictable(self, key: OffloadKey) -> None:
        self.evictable.add(key)
        self._push(key)
        self._bound_heap()

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self.evictable.remove(key)


class ARCPolicy(CachePolicy):
    """Adaptive Replacement Cache: T1 holds keys used once, T2 keys reused since; B1 and B2
    remember keys recently evicted from each. A store miss that finds its key in B1 grows T1's
    target (recency pays), one in B2 shrinks it (frequency pays); eviction takes from T1 while T1
    is at or over its target, otherwise from T2, falling back to the other list.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target_t1_size = 0.0
        self.t1: OrderedDict[OffloadKey, Chunk] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, Chunk] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> Chunk | None:
        return self.t1.get(key) or self.t2.get(key)

    def insert(self, key: OffloadKey, chunk: Chunk, context: RequestContext) -> None:
        self.t1[key] = chunk
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def _adapt(self, key: OffloadKey) -> None:
        """A miss on a key still remembered in a ghost list moves T1's target towards it."""
        if key in self.b1:
            delta = max(1, len(self.b2) / len(self.b1))
            self.target_t1_size = min(self.target_t1_size + delta, self.capacity)
            self.b1.move_to_end(key)
        elif key in self.b2:
            delta = max(1, len(self.b1) / len(self.b2))
            self.target_t1_size = max(self.target_t1_size - delta, 0)
            self.b2.move_to_end(key)

    def on_store_miss(self, keys: Sequence[OffloadKey], context: RequestContext) -> None:
        for key in reversed(keys):
            self._adapt(key)

    def touch(self, keys: Sequence[OffloadKey], context: RequestContext) -> None:
        for key in reversed(keys):
            if key in self.t1:
                chunk = self.t1.pop(key)
                if chunk.is_ready:
                    self.t2[key] = chunk
                else:
                    # Being stored, not used twice: stays in T1, as the most recent.
                    self.t1[key] = chunk
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                self._adapt(key)

    def on_request_finished(
        self,
        keys: list[OffloadKey],
        inserted_only: set[OffloadKey],
        reused: set[OffloadKey],
        context: RequestContext,
    ) -> None:
        for key in reversed(order_request_keys(keys, context)):
            if key in inserted_only:
                # Storing a block is not a second use: recency only, no promotion.
                if key in self.t1:
                    self.t1.move_to_end(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)
            elif key in reused:
                if key in self.t1:
                    self.t2[key] = self.t1.pop(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)

    def items(self) -> Iterable[tuple[OffloadKey, Chunk]]:
        return chain(self.t1.items(), self.t2.items())

    def clear(self) -> None:
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.target_t1_size = 0.0

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, Chunk]] | None:
        if n == 0:
            return []

        def next_evictable(entries: Iterator[tuple[OffloadKey, Chunk]]) -> OffloadKey | None:
            for key, chunk in entries:
                if chunk.ref_cnt == 0 and key not in protected:
                    return key
            return None

        # Choose all n before changing anything; each list is walked once, from its LRU end.
        t1_walk, t2_walk = iter(self.t1.items()), iter(self.t2.items())
        t1_size = len(self.t1)
        chosen: list[tuple[OffloadKey, bool]] = []  # (key, from T1)
        for _ in range(n):
            key = None
            if t1_size >= int(self.target_t1_size):
                key = next_evictable(t1_walk)
                if key is not None:
                    chosen.append((key, True))
                    t1_size -= 1
                    continue
            key = next_evictable(t2_walk)
            if key is not None:
                chosen.append((key, False))
                continue
            key = next_evictable(t1_walk)
            if key is None:
                return None
            chosen.append((key, True))
            t1_size -= 1

        evicted: list[tuple[OffloadKey, Chunk]] = []
        for key, from_t1 in chosen:
            if from_t1:
                evicted.append((key, self.t1.pop(key)))
                self.b1[key] = None
            else:
                evicted.append((key, self.t2.pop(key)))
                self.b2[key] = None
        for ghosts in (self.b1, self.b2):
            for _ in range(len(ghosts) - self.capacity):
                ghosts.popitem(last=False)
        return evicted


POLICIES: dict[str, type[CachePolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> CachePolicy:
    try:
        return POLICIES[name](capacity)
    except KeyError:
        raise ValueError(
            f"Unknown eviction_policy {name!r}: choose one of {', '.join(POLICIES)}"
        ) from None
