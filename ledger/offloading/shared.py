"""The shared tier behind the CPU tier: a store every replica of the same model reads, booked by
this ledger as vLLM 0.33's TieringOffloadingManager books its secondary tiers.

The shared tier never touches the GPU. As in vLLM's tiering, every block goes through the CPU
tier (the primary):

    store:  GPU -> CPU (the connector's store) -> shared   a *cascade*, once the CPU copy is done
    load:   shared -> CPU (a *promotion*) -> GPU            the connector's load, once promoted

`TieringManager` is the connector's manager (the CPU manager's calls, one for one) over the CPU
manager and a `SharedTierIndex`. A lookup that misses the CPU tier and finds the key in the
index allocates a CPU chunk for it and queues a promotion: the lookup answers HIT_PENDING, so
the request waits (the connector asks again next step) and then loads from the CPU tier like
any CPU hit. A CPU store that completes queues a cascade of its keys the index lacks, its chunks
pinned until the workers report the copy. The step carries both (`take_jobs`); the workers run
them and report, per job, the keys that failed (`complete_jobs`): a promotion that failed (the
block missing, truncated or corrupt) releases its chunks unannounced and drops the keys from
the index, so the request's next lookup misses there and recomputes. A job the workers could
not run for want of the store (unreachable, timed out, unreadable: not the block's fault) only
releases its chunks: the catalog keeps the keys, which other replicas may still read, and this
ledger leaves the tier alone for `UNREACHABLE_PAUSE_STEPS` steps (its lookups miss there, it
cascades nothing) rather than pay a failing copy every step, or until the shell reads the
catalog whole again after an outage (`resume`).

A step's promotions are bounded (`max_blocks_per_step`): a lookup past the bound answers
HIT_PENDING and queues its promotion next step. Cascades have a bound of their own, applied when
the step takes them (the rest wait, their chunks pinned), so that a burst of stores never holds
promotions back.

The index is what the tier's catalog says it holds, every replica's writes included; the shell
keeps it current (`apply_catalog`) and writes this ledger's changes to the catalog
(`take_catalog_changes`): keys cascaded (commits), keys found bad (removals), keys promoted
(touches, for the catalog's LRU). Events (medium STORAGE, the configured locality) say what
this ledger did to the tier: BlockStored for its cascades, BlockRemoved for what it evicted or
found bad; other replicas publish theirs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ledger.events import MEDIUM_STORAGE
from ledger.offloading.base import (
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    RequestContext,
    SharedJob,
    SharedJobs,
)
from ledger.offloading.manager import CPUOffloadingManager

LOCALITIES = ("LOCAL", "REMOTE")
# Blocks a step's shared-tier copies may move (promotions and cascades together): the workers
# run them inside the step, so this bounds what they add to it.
MAX_BLOCKS_PER_STEP = 128
# Steps this ledger leaves the shared tier alone after a copy found it unreachable.
UNREACHABLE_PAUSE_STEPS = 64


class SharedTierIndex:
    """The keys the shared tier holds, as its catalog says (every replica's writes and every
    eviction). Only a hint: a key the index holds may be gone by the time it is read (a load
    then fails and the block is recomputed), never the other way round for long."""

    __slots__ = ("keys", "origin")

    def __init__(self, keys: Iterable[OffloadKey] = ()) -> None:
        self.keys: set[OffloadKey] = set(keys)
        self.origin: dict[OffloadKey, str] = {}  # key -> the replica that wrote it, when known

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def add(
        self, keys: Iterable[OffloadKey], origins: Mapping[OffloadKey, str] | None = None
    ) -> None:
        self.keys.update(keys)
        if origins:
            for key, replica in origins.items():
                self.origin.setdefault(key, replica)

    def discard(self, keys: Iterable[OffloadKey]) -> None:
        keys = list(keys)
        self.keys.difference_update(keys)
        for key in keys:
            self.origin.pop(key, None)

    def replace(
        self, keys: Iterable[OffloadKey], origins: Mapping[OffloadKey, str] | None = None
    ) -> None:
        self.keys = set(keys)
        self.origin = dict(origins or {})


@dataclass(slots=True)
class CatalogChanges:
    """This ledger's writes to the catalog since the last call."""

    commits: list[OffloadKey] = field(default_factory=list)  # cascaded: now in the tier
    removals: list[OffloadKey] = field(default_factory=list)  # found missing or bad on a load
    touches: list[OffloadKey] = field(default_factory=list)  # promoted: used again

    def __bool__(self) -> bool:
        return bool(self.commits or self.removals or self.touches)


@dataclass(slots=True)
class SharedTierStats:
    """Counts since start, for metrics and traces."""

    lookups_hit: int = 0  # CPU misses found in the shared tier
    promotions: int = 0  # blocks promoted (shared -> CPU)
    promotion_failures: int = 0  # blocks whose promotion failed (recomputed)
    cascades: int = 0  # blocks written to the shared tier
    cascade_failures: int = 0
    unreachable: int = 0  # blocks whose copy failed for want of the store (kept in the catalog)
    evictions: int = 0  # blocks this ledger's commits evicted from the tier


class TieringManager:
    """The CPU manager's interface over the CPU tier and the shared tier (see the module)."""

    def __init__(
        self,
        primary: CPUOffloadingManager,
        index: SharedTierIndex | None = None,
        *,
        locality: str | None = "REMOTE",
        delete_evicted: bool = False,
        max_blocks_per_step: int = MAX_BLOCKS_PER_STEP,
        replica: str = "",
    ) -> None:
        assert locality is None or locality in LOCALITIES, locality
        self.primary = primary
        self.index = index if index is not None else SharedTierIndex()
        self.locality = locality
        # A directory's files are removed by the workers that can reach them; a Redis backend's
        # evictions drop their data in the catalog's own script.
        self.delete_evicted = delete_evicted
        self.max_blocks_per_step = max_blocks_per_step
        self.replica = replica  # this ledger's: the writer of what it cascades
        self.stats = SharedTierStats()
        self.events: list[OffloadingEvent] = []
        self.next_job_id = 0
        self.jobs: dict[int, SharedJob] = {}  # sent to the workers, not yet reported
        self.queued = SharedJobs()  # for the next step
        self._promotions_by_request: dict[str, SharedJob] = {}
        self._queued_promotion_blocks = 0
        self.paused_steps = 0  # > 0: the store was unreachable lately; leave it alone
        self._open_requests: set[str] = set()
        self.promoting: set[OffloadKey] = set()  # queued or in flight
        self.cascading: set[OffloadKey] = set()
        self.changes = CatalogChanges()
        # Blocks promoted for each request and who wrote them, until its admission reads them
        # (its trace says so).
        self.promoted_for: dict[str, int] = {}
        self.promoted_from: dict[str, set[str]] = {}

    # --- what the connector reads of the CPU manager ---

    @property
    def medium(self) -> str:
        return self.primary.medium

    @property
    def num_chunks(self) -> int:
        return self.primary.num_chunks

    def usage(self) -> float:
        return self.primary.usage()

    def on_new_request(self, context: RequestContext) -> None:
        self.primary.on_new_request(context)
        self._open_requests.add(context.req_id)

    def lookup(self, key: OffloadKey, context: RequestContext) -> LookupResult:
        found = self.primary.lookup(key, context)
        if found is not LookupResult.MISS or key not in self.index:
            return found
        if key in self.promoting:
            return LookupResult.HIT_PENDING
        if self.paused_steps:
            return found  # the store was unreachable: recompute rather than wait for it
        if self._queued_promotion_blocks >= self.max_blocks_per_step:
            return LookupResult.HIT_PENDING  # this step's promotions are full: ask again next
        allocated = self.primary.prepare_store([key], context)
        if allocated is None or not allocated.keys_to_store:
            return LookupResult.MISS  # the CPU tier has no chunk to give: recompute
        self.stats.lookups_hit += 1
        job = self._promotions_by_request.get(context.req_id)
        if job is None:
            job = self._promotions_by_request[context.req_id] = SharedJob(
                self._new_job_id(), [], [], True, context
            )
            self.queued.promotions.append(job)
        job.keys.append(key)
        job.chunk_ids.append(allocated.chunk_ids[0])
        self.promoting.add(key)
        self._queued_promotion_blocks += 1
        return LookupResult.HIT_PENDING

    def prepare_load(self, keys: Sequence[OffloadKey], context: RequestContext) -> list[int]:
        return self.primary.prepare_load(keys, context)

    def complete_load(self, keys: Iterable[OffloadKey], context: RequestContext) -> None:
        self.primary.complete_load(keys, context)

    def touch(self, keys: Sequence[OffloadKey], context: RequestContext) -> None:
        self.primary.touch(keys, context)

    def prepare_store(
        self, keys: Iterable[OffloadKey], context: RequestContext
    ) -> PrepareStoreOutput | None:
        return self.primary.prepare_store(keys, context)

    def complete_store(
        self, keys: Iterable[OffloadKey], context: RequestContext, success: bool = True
    ) -> None:
        """A GPU -> CPU store ended: readable on the CPU tier, then cascaded to the shared tier
        (the keys it lacks), its chunks pinned until the workers report the copy."""
        keys = list(keys)
        self.primary.complete_store(keys, context, success)
        if not success or self.paused_steps:
            return
        new = [
            key
            for key in keys
            if key not in self.index
            and key not in self.cascading
            and self.primary.lookup(key) is LookupResult.HIT
        ]
        if new:
            job = SharedJob(self._new_job_id(), new, self.primary.pin(new), False, context)
            self.queued.cascades.append(job)
            self.cascading.update(new)

    def on_request_finished(self, context: RequestContext) -> None:
        self.primary.on_request_finished(context)
        self._open_requests.discard(context.req_id)
        self.promoted_for.pop(context.req_id, None)
        self.promoted_from.pop(context.req_id, None)

    def ready_keys(self) -> list[OffloadKey]:
        return self.primary.ready_keys()

    # --- the step's shared-tier work and the workers' reports ---

    def _new_job_id(self) -> int:
        self.next_job_id += 1
        return self.next_job_id - 1

    def take_jobs(self) -> SharedJobs:
        """This step's promotions, cascades (up to `max_blocks_per_step` blocks of them, at
        least one job; the rest wait for the next step) and deletes; reported with the step's
        result."""
        jobs, self.queued = self.queued, SharedJobs()
        self._promotions_by_request.clear()
        self._queued_promotion_blocks = 0
        if self.paused_steps:
            self.paused_steps -= 1
        cascades, budget = jobs.cascades, self.max_blocks_per_step
        for taken, job in enumerate(cascades):
            budget -= len(job.keys)
            if budget < 0 and taken:
                jobs.cascades, self.queued.cascades = cascades[:taken], cascades[taken:]
                break
        for job in (*jobs.promotions, *jobs.cascades):
            self.jobs[job.job_id] = job
        return jobs

    def has_queued_work(self) -> bool:
        """Copies waiting for a step (a step is due even with no request left)."""
        return bool(self.queued)

    def has_pending_work(self) -> bool:
        return bool(self.jobs or self.queued)

    def complete_jobs(
        self, failed: Mapping[int, Sequence[int]], unreachable: Iterable[int] = ()
    ) -> None:
        """The workers ran the step's jobs: `failed` maps each job id to the indices of its keys
        that failed (empty when all were copied); `unreachable`, the jobs that failed for want
        of the store rather than of their blocks. Every job sent must be reported."""
        for job_id in unreachable:
            job = self.jobs.pop(job_id, None)
            if job is None:
                continue
            self.paused_steps = UNREACHABLE_PAUSE_STEPS
            self.stats.unreachable += len(job.keys)
            if job.is_promotion:  # released unannounced; the catalog still lists the blocks
                self._promotion_done(job, [], set())
                assert job.context is not None
                self.primary.complete_store(job.keys, job.context, False)
            else:
                self._cascade_done(job, [], set(job.keys))
        for job_id, failed_indices in failed.items():
            job = self.jobs.pop(job_id, None)
            if job is None:
                continue  # sent before a reset (or reported unreachable above)
            bad = {job.keys[i] for i in failed_indices if 0 <= i < len(job.keys)}
            good = [key for key in job.keys if key not in bad]
            if job.is_promotion:
                self._promotion_done(job, good, bad)
            else:
                self._cascade_done(job, good, bad)

    def _promotion_done(self, job: SharedJob, good: list[OffloadKey], bad: set[OffloadKey]) -> None:
        self.promoting.difference_update(job.keys)
        context = job.context
        assert context is not None
        if good:
            self.primary.complete_store(good, context, True)
            self.changes.touches.extend(good)
            self.stats.promotions += len(good)
            if context.req_id in self._open_requests:  # its admission reads them (not aborted)
                promoted = self.promoted_for.get(context.req_id, 0) + len(good)
                self.promoted_for[context.req_id] = promoted
                origin = self.index.origin
                self.promoted_from.setdefault(context.req_id, set()).update(
                    origin.get(key, "") for key in good
                )
        if bad:
            # Released unannounced (the CPU tier never held them); the tier does not hold them
            # either: forgotten here, removed from the catalog, published as gone.
            self.primary.complete_store(bad, context, False)
            self.index.discard(bad)
            self.changes.removals.extend(bad)
            if self.delete_evicted:
                self.queued.deletes.extend(bad)
            self.stats.promotion_failures += len(bad)
            self._event(list(bad), removed=True)

    def _cascade_done(self, job: SharedJob, good: list[OffloadKey], bad: set[OffloadKey]) -> None:
        self.cascading.difference_update(job.keys)
        self.primary.unpin(job.keys)
        if good:
            self.index.add(good, dict.fromkeys(good, self.replica))
            self.changes.commits.extend(good)
            self.stats.cascades += len(good)
            self._event(good, removed=False)
        self.stats.cascade_failures += len(bad)

    # --- the catalog ---

    def take_catalog_changes(self) -> CatalogChanges:
        changes, self.changes = self.changes, CatalogChanges()
        return changes

    def retry_catalog_changes(self, changes: CatalogChanges) -> None:
        """Changes taken but not written: written first at the next take."""
        self.changes.commits[:0] = changes.commits
        self.changes.removals[:0] = changes.removals
        self.changes.touches[:0] = changes.touches

    def evicted(self, keys: Sequence[OffloadKey]) -> None:
        """Keys this ledger's commits evicted from the tier (the catalog's size bound)."""
        if not keys:
            return
        self.index.discard(keys)
        self.stats.evictions += len(keys)
        self._event(list(keys), removed=True)
        if self.delete_evicted:
            self.queued.deletes.extend(keys)

    def commit_failed(self, keys: Sequence[OffloadKey]) -> None:
        """The catalog could not be written (Redis unreachable): other replicas will not find
        these blocks, and this ledger stops counting on them too."""
        keys = [key for key in keys if key in self.index]
        if keys:
            self.index.discard(keys)
            self._event(keys, removed=True)

    def resume(self) -> None:
        """The store answers again (its catalog was read whole after an outage): end a pause."""
        self.paused_steps = 0

    def apply_catalog(
        self,
        stored: Iterable[OffloadKey],
        removed: Iterable[OffloadKey],
        origins: Mapping[OffloadKey, str] | None = None,
    ) -> None:
        """What the catalog says changed (this ledger's writes and every other replica's)."""
        self.index.add(stored, origins)
        self.index.discard(removed)

    def _event(self, keys: list[OffloadKey], removed: bool) -> None:
        self.events.append(
            OffloadingEvent(keys, removed=removed, medium=MEDIUM_STORAGE, locality=self.locality)
        )

    def take_events(self) -> list[OffloadingEvent]:
        events = self.primary.take_events()
        if self.events:
            events += self.events
            self.events = []
        return events

    def reset_cache(self) -> None:
        """The CPU tier is emptied (the shared tier is every replica's, and stays): jobs queued
        are dropped, reports of jobs in flight are ignored."""
        self.primary.reset_cache()
        self.queued = SharedJobs()
        self._promotions_by_request.clear()
        self._queued_promotion_blocks = 0
        self.jobs.clear()
        self.promoting.clear()
        self.cascading.clear()
        self.promoted_for.clear()
        self.promoted_from.clear()
