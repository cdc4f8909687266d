"""The CPU tier's books: which blocks it holds, in which chunk, and who is reading or writing them.

vLLM 0.33's CPUOffloadingManager, call for call: `lookup`, `prepare_load`/`complete_load` (pins),
`touch`, `prepare_store`/`complete_store` (which keys to write, which to evict, failure when
nothing can be), request start and finish (the policy learns a request's accesses in prefix
order when it finishes), `reset_cache` and the tier's events. Chunks are handed out fresh
(0, 1, 2, ...) until the buffer is used once, then from the free list, last freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from ledger.events import MEDIUM_CPU
from ledger.offloading.base import (
    Chunk,
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    RequestContext,
    order_request_keys,
)
from ledger.offloading.policies import CachePolicy, make_policy


@dataclass(slots=True)
class RequestAccess:
    """The keys one request used, in the order it first used them, and how it used them."""

    owner: object
    generation: int
    keys: list[OffloadKey] = field(default_factory=list)
    seen: set[OffloadKey] = field(default_factory=set)
    inserted: set[OffloadKey] = field(default_factory=set)
    reused: set[OffloadKey] = field(default_factory=set)
    store_misses: set[OffloadKey] = field(default_factory=set)
    finished: bool = False


class CPUOffloadingManager:
    def __init__(
        self,
        num_chunks: int,
        eviction_policy: str = "lru",
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
    ) -> None:
        self.medium = MEDIUM_CPU
        self.num_chunks = num_chunks
        self.policy: CachePolicy = make_policy(eviction_policy, num_chunks)
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        # Chunks 0..num_allocated-1 have been handed out at least once; freed ones wait in
        # free_list and are reused last-freed-first.
        self.num_allocated = 0
        self.free_list: list[int] = []
        self.num_evictable = 0  # ready chunks with ref_cnt 0
        self.num_write_pending = 0  # chunks with a store in flight (ref_cnt -1)
        self.generation = 0
        # store_threshold >= 2: a key is stored only once it has been offered that many times;
        # offers are counted in an LRU-bounded table (which, unlike the cache, survives resets).
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.offer_counts: OrderedDict[OffloadKey, int] | None = (
            OrderedDict() if store_threshold >= 2 else None
        )
        self.stores_skipped = 0

    # --- the chunk pool ---

    def num_free_chunks(self) -> int:
        return len(self.free_list) + self.num_chunks - self.num_allocated

    def _allocate(self, n: int) -> list[Chunk]:
        num_fresh = min(n, self.num_chunks - self.num_allocated)
        chunks = [Chunk(self.num_allocated + i) for i in range(num_fresh)]
        self.num_allocated += num_fresh
        chunks.extend(Chunk(self.free_list.pop()) for _ in range(n - num_fresh))
        return chunks

    def usage(self) -> float:
        """Share of the buffer pinned by transfers (stores in flight and loads being read)."""
        used = self.num_allocated - len(self.free_list) - self.num_evictable
        return used / self.num_chunks if self.num_chunks > 0 else 0.0

    # --- what each request used ---

    def _access(self, context: RequestContext) -> RequestAccess:
        access = context.access
        if access is None or access.owner is not self or access.generation != self.generation:
            access = context.access = RequestAccess(self, self.generation)
        return access

    def _record_access(
        self,
        keys: Iterable[OffloadKey],
        context: RequestContext,
        reused: Iterable[OffloadKey] = (),
    ) -> None:
        access = self._access(context)
        new_keys: list[OffloadKey] = []
        for key in keys:
            if key in access.seen:
                continue
            assert not access.finished, f"request {context.req_id} used a key after it finished"
            access.keys.append(key)
            access.seen.add(key)
            new_keys.append(key)
        if new_keys:
            self.policy.on_request_access(new_keys, context)
        # Reading a chunk this request stored itself is not a reuse.
        access.reused.update(key for key in reused if key not in access.inserted)

    def _record_offers(self, keys: list[OffloadKey]) -> None:
        counts = self.offer_counts
        assert counts is not None
        # Keys offered again count up and are not dropped from the table by this offer's new ones.
        offered_again: set[OffloadKey] = set()
        for key in keys:
            if key in counts:
                counts.move_to_end(key)
                counts[key] += 1
                offered_again.add(key)
        droppable = len(counts) - len(offered_again)
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_tracker_size:
                if droppable == 0:
                    continue
                counts.popitem(last=False)
                droppable -= 1
            counts[key] = 1

    # --- the manager's calls ---

    def on_new_request(self, context: RequestContext) -> None:
        self._access(context)

    def lookup(self, key: OffloadKey, context: RequestContext | None = None) -> LookupResult:
        chunk = self.policy.get(key)
        if chunk is None:
            return LookupResult.MISS
        return LookupResult.HIT if chunk.is_ready else LookupResult.HIT_PENDING

    def prepare_load(self, keys: Sequence[OffloadKey], context: RequestContext) -> list[int]:
        """Pin the keys (all ready) against eviction until complete_load; their chunk ids."""
        chunk_ids = self.pin(keys)
        self._record_access(keys, context, reused=keys)
        return chunk_ids

    def pin(self, keys: Sequence[OffloadKey]) -> list[int]:
        """Pin ready keys against eviction without counting an access (vLLM's `prepare_read`:
        the shared tier copying them is not a request using them); their chunk ids."""
        chunk_ids: list[int] = []
        for key in keys:
            chunk = self.policy.get(key)
            assert chunk is not None and chunk.is_ready, f"{key.hex()} is not ready to read"
            if chunk.ref_cnt == 0:
                self.policy.mark_non_evictable(key)
                self.num_evictable -= 1
            chunk.ref_cnt += 1
            chunk_ids.append(chunk.chunk_id)
        return chunk_ids

    def complete_load(self, keys: Iterable[OffloadKey], context: RequestContext) -> None:
        self.unpin(keys)

    def unpin(self, keys: Iterable[OffloadKey]) -> None:
        """Undo `pin` (the copy out of the chunks is done)."""
        for key in keys:
            chunk = self.policy.get(key)
            assert chunk is not None and chunk.ref_cnt > 0, f"{key.hex()} is not being loaded"
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self.num_evictable += 1
                self.policy.mark_evictable(key)

    def touch(self, keys: Sequence[OffloadKey], context: RequestContext) -> None:
        self.policy.touch(keys, context)

    def prepare_store(
        self, keys: Iterable[OffloadKey], context: RequestContext
    ) -> PrepareStoreOutput | None:
        """Which of the offered keys to write now (those the tier lacks), into which chunks, and
        what was evicted for them; None when too few chunks can be evicted (nothing is stored)."""
        keys = list(keys)
        if self.offer_counts is not None:
            self._record_offers(keys)
        to_store: list[OffloadKey] = []
        ready: list[OffloadKey] = []
        for key in keys:
            chunk = self.policy.get(key)
            if chunk is None:
                to_store.append(key)
            elif chunk.is_ready:
                ready.append(key)
        if self.offer_counts is not None:
            counts = self.offer_counts
            num_candidates = len(to_store)
            to_store = [key for key in to_store if counts.get(key, 0) >= self.store_threshold]
            self.stores_skipped += num_candidates - len(to_store)

        access = self._access(context)
        new_misses = [key for key in to_store if key not in access.store_misses]
        if new_misses:
            # ARC learns from its ghost lists here, before insert() forgets the ghosts.
            self.policy.on_store_miss(new_misses, context)
            access.store_misses.update(new_misses)
        # Recorded before any failure below; a key counts as inserted only once it is.
        recorded = set(to_store)
        recorded.update(ready)
        self._record_access((key for key in keys if key in recorded), context, reused=ready)

        if not to_store:
            return PrepareStoreOutput([], [], [])
        evicted: list[OffloadKey] = []
        num_to_evict = len(to_store) - self.num_free_chunks()
        if num_to_evict > 0:
            if num_to_evict > self.num_evictable:
                return None
            # A key offered now stays: it was stored before and must remain after this call.
            victims = self.policy.evict(num_to_evict, protected=set(keys))
            if victims is None:
                return None
            self.num_evictable -= len(victims)
            for key, chunk in victims:
                self.free_list.append(chunk.chunk_id)
                evicted.append(key)
            if self.events is not None:
                self.events.append(OffloadingEvent(evicted, removed=True, medium=self.medium))

        chunks = self._allocate(len(to_store))
        for key, chunk in zip(to_store, chunks, strict=True):
            self.policy.insert(key, chunk, context)
        self.num_write_pending += len(to_store)
        access.inserted.update(to_store)
        return PrepareStoreOutput(to_store, [chunk.chunk_id for chunk in chunks], evicted)

    def complete_store(
        self, keys: Iterable[OffloadKey], context: RequestContext, success: bool = True
    ) -> None:
        """The writes of these keys ended: readable now, or (failed) released unannounced."""
        done: list[OffloadKey] = []
        for key in keys:
            chunk = self.policy.get(key)
            if chunk is None or chunk.is_ready:
                continue
            self.num_write_pending -= 1
            if success:
                chunk.ref_cnt = 0
                self.num_evictable += 1
                self.policy.mark_evictable(key)
            else:
                self.policy.remove(key)
                self.free_list.append(chunk.chunk_id)
            done.append(key)
        if done and self.events is not None:
            if success:
                self.events.append(OffloadingEvent(done, removed=False, medium=self.medium))
            else:
                self.events.append(
                    OffloadingEvent(done, removed=True, medium=self.medium, metadata_only=True)
                )

    def on_request_finished(self, context: RequestContext) -> None:
        """The request will submit nothing more: the policy learns its accesses, once."""
        access = context.access
        if (
            access is None
            or access.owner is not self
            or access.generation != self.generation
            or access.finished
        ):
            return
        access.finished = True
        self.policy.on_request_finished(
            order_request_keys(access.keys, context),
            access.inserted - access.reused,
            access.reused,
            context,
        )

    def reset_cache(self) -> None:
        """Forget every chunk, in flight or not: the caller drops the transfers of before."""
        self.policy.clear()
        self.generation += 1
        self.num_evictable = 0
        self.num_write_pending = 0
        self.free_list.clear()
        self.num_allocated = 0

    def ready_keys(self) -> list[OffloadKey]:
        """The keys whose chunk is written (announced with BlockStored), in the policy's order."""
        return [key for key, chunk in self.policy.items() if chunk.is_ready]

    def take_events(self) -> list[OffloadingEvent]:
        if self.events is None:
            return []
        events, self.events = self.events, []
        taken: list[OffloadingEvent] = []
        for event in events:
            if event.metadata_only:
                # A failed store's key that a retry has stored again since is not released.
                keys = [key for key in event.keys if self.policy.get(key) is None]
                if not keys:
                    continue
                event = replace(event, keys=keys)
            taken.append(event)
        return taken
