"""The shared tier's books (ledger.offloading.shared) in the scheduler, against symbolic workers.

Every slot holds a digest of the tokens up to its position (tests/ledger/test_scheduler_tier.py's
worker); here two replicas' workers also share one symbolic store, and run the steps' shared-tier
copies as the real worker does, after the forward pass: promotions copy a stored block's digests
into a CPU chunk (a block the store lacks is reported failed), cascades copy a CPU chunk out.
What one replica computed, the other loads: a wrong chunk, a promotion read before it landed or a
cascade of a chunk already reused all show up as a wrong slot.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest

from ledger.events import MEDIUM_STORAGE, BlockRemoved, BlockStored
from ledger.kv_cache_manager import KVCacheManager
from ledger.offloading.base import LookupResult, RequestContext, make_offload_key
from ledger.offloading.connector import OffloadingConnectorScheduler
from ledger.offloading.manager import CPUOffloadingManager
from ledger.offloading.shared import UNREACHABLE_PAUSE_STEPS, SharedTierIndex, TieringManager
from ledger.request import Request
from ledger.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tests.ledger.test_scheduler_tier import BS, HASHER, KVWorker, workload

Digests = dict[int, bytes]  # offset -> digest, one block


@dataclass
class SharedWorker(KVWorker):
    store: dict[bytes, Digests] = field(default_factory=dict)
    lost: set[bytes] = field(default_factory=set)  # keys whose block the store loses on read
    promoted: int = 0

    def execute(self, out: SchedulerOutput) -> tuple[dict[str, int], list[int]]:
        sampled, done = super().execute(out)
        self.failed: dict[int, list[int]] = {}
        shared = out.kv_transfers.shared if out.kv_transfers is not None else None
        if shared:
            for job in shared.promotions:
                bad = []
                for index, (key, chunk) in enumerate(zip(job.keys, job.chunk_ids, strict=True)):
                    block = None if key in self.lost else self.store.get(key)
                    if block is None:
                        bad.append(index)
                        continue
                    for offset in range(BS):
                        self.cpu.pop((chunk, offset), None)
                    self.cpu.update({(chunk, o): d for o, d in block.items()})
                    self.promoted += 1
                self.failed[job.job_id] = bad
            for job in shared.cascades:
                for key, chunk in zip(job.keys, job.chunk_ids, strict=True):
                    self.store[key] = {
                        o: self.cpu[(chunk, o)] for o in range(BS) if (chunk, o) in self.cpu
                    }
                self.failed[job.job_id] = []
        return sampled, done


def replica(
    store: dict[bytes, Digests], num_blocks: int = 18, chunks: int = 64
) -> tuple[Scheduler, SharedWorker]:
    max_model_len = min(64, (num_blocks - 1) * BS)
    manager = KVCacheManager(num_blocks, BS, max_model_len, enable_kv_cache_events=True)
    tiering = TieringManager(CPUOffloadingManager(chunks, "lru", enable_events=True))
    connector = OffloadingConnectorScheduler(tiering, BS)
    config = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=6, max_num_batched_tokens=32)
    return Scheduler(config, manager, connector), SharedWorker(store=store)


def tiering_of(scheduler: Scheduler) -> TieringManager:
    assert scheduler.connector is not None
    manager = scheduler.connector.manager
    assert isinstance(manager, TieringManager)
    return manager


@dataclass
class Run:
    outputs: dict[str, list[int]]
    events: list = field(default_factory=list)


def run(
    scheduler: Scheduler, worker: SharedWorker, arrivals, catalog: list[SharedTierIndex]
) -> Run:
    """Steps until every request ends; each step's catalog changes reach every index at once
    (as the catalog's log would, a moment later)."""
    tiering = tiering_of(scheduler)
    pending = deque(arrivals)
    result = Run({})
    for step in range(20_000):
        while pending and pending[0][0] <= step:
            scheduler.add_request(pending.popleft()[1])
        if not pending and not scheduler.has_requests():
            break
        if not scheduler.has_requests():
            continue
        out = scheduler.schedule()
        result.events += scheduler.take_events()
        if out.is_empty and not out.has_transfers:
            continue
        sampled, done = worker.execute(out)
        for update in scheduler.update_from_output(out, sampled, done, worker.failed):
            if update.finished:
                result.outputs[update.request.request_id] = update.request.output_token_ids
        result.events += scheduler.take_events()
        changes = tiering.take_catalog_changes()
        for index in catalog:
            index.add(changes.commits)
            index.discard(changes.removals)
    else:
        raise AssertionError("the run did not end")
    return result


def fresh(arrivals):
    """The same workload with new Request objects (a request is one replica's)."""
    return [
        (at, Request(r.request_id, list(r.prompt_token_ids), r.max_tokens, arrival_time=r.arrival_time,
                     block_hasher=HASHER, block_size=BS))
        for at, r in arrivals
    ]  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_what_one_replica_computed_another_loads_and_no_token_changes(seed):
    store: dict[bytes, Digests] = {}
    a, worker_a = replica(store)
    b, worker_b = replica(store)
    catalog = [tiering_of(a).index, tiering_of(b).index]
    first = run(a, worker_a, fresh(workload(seed)), catalog)
    second = run(b, worker_b, fresh(workload(seed)), catalog)
    alone, worker_alone = replica({})
    reference = run(alone, worker_alone, fresh(workload(seed)), [tiering_of(alone).index])
    assert worker_a.wrong_reads == worker_b.wrong_reads == worker_alone.wrong_reads == []
    assert first.outputs == second.outputs == reference.outputs and len(reference.outputs) == 30
    # B started cold but found A's blocks in the store: fewer prompt tokens than A computed.
    assert worker_b.promoted > 0
    assert worker_b.prompt_tokens_computed < worker_a.prompt_tokens_computed
    assert tiering_of(b).stats.promotions == worker_b.promoted
    assert tiering_of(a).stats.cascades == len(store)
    for scheduler in (a, b):
        manager = scheduler.kv_cache_manager
        assert manager.num_free_blocks == 17 and not manager.req_to_blocks
        tiering = tiering_of(scheduler)
        assert not tiering.jobs and not tiering.has_queued_work()
        assert not tiering.promoting and not tiering.cascading
    # A announced every block it cascaded, STORAGE medium; B cascaded only what A had not.
    stored_a = [
        e for e in first.events if isinstance(e, BlockStored) and e.medium == MEDIUM_STORAGE
    ]
    assert sum(len(e.block_hashes) for e in stored_a) == tiering_of(a).stats.cascades
    assert all(e.locality == "REMOTE" for e in stored_a)


def test_a_block_lost_from_the_store_is_recomputed_and_forgotten():
    store: dict[bytes, Digests] = {}
    a, worker_a = replica(store)
    b, worker_b = replica(store)
    catalog = [tiering_of(a).index, tiering_of(b).index]
    run(a, worker_a, fresh(workload(3)), catalog)
    worker_b.lost = set(list(store)[::3])  # the index lists them; reads find nothing
    second = run(b, worker_b, fresh(workload(3)), catalog)
    alone, worker_alone = replica({})
    reference = run(alone, worker_alone, fresh(workload(3)), [tiering_of(alone).index])
    assert worker_b.wrong_reads == [] and second.outputs == reference.outputs
    stats = tiering_of(b).stats
    assert stats.promotion_failures > 0
    removed = [
        e for e in second.events if isinstance(e, BlockRemoved) and e.medium == MEDIUM_STORAGE
    ]
    assert sum(len(e.block_hashes) for e in removed) == stats.promotion_failures
    # B recomputed the lost blocks and cascaded them again: the store holds them once more.
    assert all(key in tiering_of(b).index for key in worker_b.lost if key in store)


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"))


def test_a_promotion_allocates_a_chunk_waits_then_hits():
    tier = TieringManager(CPUOffloadingManager(4, enable_events=True), SharedTierIndex([key(1)]))
    context = RequestContext("r")
    tier.on_new_request(context)
    assert tier.lookup(key(2), context) is LookupResult.MISS  # nowhere
    assert tier.lookup(key(1), context) is LookupResult.HIT_PENDING
    assert tier.lookup(key(1), context) is LookupResult.HIT_PENDING  # queued once
    jobs = tier.take_jobs()
    (job,) = jobs.promotions
    assert job.keys == [key(1)] and len(job.chunk_ids) == 1 and not jobs.cascades
    assert tier.lookup(key(1), context) is LookupResult.HIT_PENDING  # in flight
    tier.complete_jobs({job.job_id: []})
    assert tier.lookup(key(1), context) is LookupResult.HIT
    assert tier.take_catalog_changes().touches == [key(1)]
    # The promoted block is the CPU tier's now (announced with its CPU medium).
    (stored,) = [e for e in tier.take_events() if not e.removed]
    assert stored.medium == "CPU" and stored.keys == [key(1)]


def test_a_failed_promotion_is_released_unannounced_and_forgotten():
    tier = TieringManager(CPUOffloadingManager(4, enable_events=True), SharedTierIndex([key(1)]))
    context = RequestContext("r")
    tier.on_new_request(context)
    tier.lookup(key(1), context)
    (job,) = tier.take_jobs().promotions
    tier.complete_jobs({job.job_id: [0]})
    assert key(1) not in tier.index
    assert tier.lookup(key(1), context) is LookupResult.MISS
    assert tier.primary.num_free_chunks() == 4  # its chunk went back
    assert tier.take_catalog_changes().removals == [key(1)]
    # The CPU tier's release is metadata only (never published); the shared tier's is news.
    events = [(e.medium, e.removed, e.metadata_only) for e in tier.take_events()]
    assert events == [("CPU", True, True), (MEDIUM_STORAGE, True, False)]


def test_a_completed_cpu_store_cascades_what_the_index_lacks_with_its_chunks_pinned():
    tier = TieringManager(CPUOffloadingManager(2, enable_events=True), SharedTierIndex([key(2)]))
    context = RequestContext("r")
    tier.on_new_request(context)
    stored = tier.prepare_store([key(1), key(2)], context)
    assert stored is not None and stored.keys_to_store == [key(1), key(2)]
    tier.complete_store([key(1), key(2)], context)
    (job,) = tier.take_jobs().cascades
    assert job.keys == [key(1)]  # key(2) is in the shared tier already
    # While the cascade reads it, key(1)'s chunk cannot be evicted for another store.
    assert tier.prepare_store([key(3), key(4)], context) is None
    tier.complete_jobs({job.job_id: []})
    assert key(1) in tier.index and tier.take_catalog_changes().commits == [key(1)]
    shared = [e for e in tier.take_events() if e.medium == MEDIUM_STORAGE]
    assert [(e.keys, e.removed, e.locality) for e in shared] == [([key(1)], False, "REMOTE")]
    assert tier.prepare_store([key(3), key(4)], context) is not None


def test_a_step_promotes_at_most_its_cap_the_rest_waits():
    index = SharedTierIndex(key(i) for i in range(5))
    tier = TieringManager(CPUOffloadingManager(8), index, max_blocks_per_step=2)
    context = RequestContext("r")
    tier.on_new_request(context)
    assert [tier.lookup(key(i), context) for i in range(5)] == [LookupResult.HIT_PENDING] * 5
    (job,) = tier.take_jobs().promotions
    assert job.keys == [key(0), key(1)]
    assert [tier.lookup(key(i), context) for i in range(2, 5)] == [LookupResult.HIT_PENDING] * 3
    (job,) = tier.take_jobs().promotions
    assert job.keys == [key(2), key(3)]


def test_a_burst_of_cascades_never_holds_a_promotion_back_and_waits_its_turn():
    """Stores completing more blocks than a step's cap (a prefill-heavy step) queue cascades past
    it: promotions keep their own budget, and the cascades go out a cap's worth a step."""
    tier = TieringManager(
        CPUOffloadingManager(16), SharedTierIndex([key(100)]), max_blocks_per_step=4
    )
    context = RequestContext("r")
    tier.on_new_request(context)
    for batch in ([1, 2, 3], [4, 5, 6], [7, 8]):  # three stores complete: 8 blocks
        keys = [key(i) for i in batch]
        assert tier.prepare_store(keys, context) is not None
        tier.complete_store(keys, context)
    assert tier.lookup(key(100), context) is LookupResult.HIT_PENDING
    first = tier.take_jobs()
    assert [job.keys for job in first.promotions] == [[key(100)]]
    assert [len(job.keys) for job in first.cascades] == [3]  # the next job would pass 4
    second = tier.take_jobs()
    assert [len(job.keys) for job in second.cascades] == [3]
    assert tier.has_queued_work()
    third = tier.take_jobs()
    assert [len(job.keys) for job in third.cascades] == [2] and not tier.has_queued_work()
    tier.complete_jobs({job.job_id: [] for step in (first, second, third)
                        for job in (*step.promotions, *step.cascades)})  # fmt: skip
    assert all(key(i) in tier.index for i in range(1, 9))
    # One job larger than the cap still goes (alone): nothing waits forever.
    big = [key(i) for i in range(20, 26)]
    assert tier.prepare_store(big, context) is not None
    tier.complete_store(big, context)
    assert [len(job.keys) for job in tier.take_jobs().cascades] == [6]


def test_a_store_that_cannot_be_reached_keeps_the_catalog_and_is_left_alone_for_a_while():
    """A promotion the workers could not run for want of the store (not the block's fault): its
    chunk goes back, the catalog keeps the block (other replicas may reach it), nothing is
    published, and for UNREACHABLE_PAUSE_STEPS steps lookups recompute instead of waiting on
    the store and nothing is cascaded; then the tier is tried again."""
    tier = TieringManager(CPUOffloadingManager(4, enable_events=True), SharedTierIndex([key(1)]))
    context = RequestContext("r")
    tier.on_new_request(context)
    tier.take_events()
    assert tier.lookup(key(1), context) is LookupResult.HIT_PENDING
    (job,) = tier.take_jobs().promotions
    tier.complete_jobs({job.job_id: [0]}, unreachable=[job.job_id])
    assert key(1) in tier.index and not tier.take_catalog_changes()
    assert tier.primary.num_free_chunks() == 4 and tier.stats.unreachable == 1
    assert tier.stats.promotion_failures == 0
    assert [e.medium for e in tier.take_events()] == ["CPU"]  # the chunk's release, unpublished
    assert tier.lookup(key(1), context) is LookupResult.MISS  # recompute: the store is away
    assert tier.prepare_store([key(2)], context) is not None
    tier.complete_store([key(2)], context)
    assert not tier.take_jobs()  # nothing cascaded while paused
    for _ in range(UNREACHABLE_PAUSE_STEPS):
        tier.take_jobs()
    assert tier.lookup(key(1), context) is LookupResult.HIT_PENDING  # tried again


def test_a_request_aborted_while_its_blocks_are_promoted_leaves_no_note_behind():
    tier = TieringManager(CPUOffloadingManager(4), SharedTierIndex([key(1)]))
    context = RequestContext("r")
    tier.on_new_request(context)
    tier.lookup(key(1), context)
    (job,) = tier.take_jobs().promotions
    tier.on_request_finished(context)
    tier.complete_jobs({job.job_id: []})
    assert tier.primary.lookup(key(1)) is LookupResult.HIT  # the block is the CPU tier's
    assert not tier.promoted_for and not tier.promoted_from


def test_a_reset_drops_queued_jobs_and_ignores_late_reports():
    tier = TieringManager(CPUOffloadingManager(4), SharedTierIndex([key(1), key(2)]))
    context = RequestContext("r")
    tier.on_new_request(context)
    tier.lookup(key(1), context)
    (sent,) = tier.take_jobs().promotions
    tier.lookup(key(2), context)
    tier.reset_cache()
    assert not tier.has_queued_work() and not tier.has_pending_work()
    tier.complete_jobs({sent.job_id: []})  # from before the reset: nothing to complete
    assert tier.primary.lookup(key(1)) is LookupResult.MISS
    assert key(1) in tier.index  # the shared tier is every replica's: not reset here


def test_evictions_leave_the_index_and_queue_the_files_deleted():
    tier = TieringManager(
        CPUOffloadingManager(4), SharedTierIndex([key(1), key(2)]), delete_evicted=True
    )
    tier.evicted([key(1)])
    assert key(1) not in tier.index and key(2) in tier.index
    assert tier.take_jobs().deletes == [key(1)]
    (event,) = tier.take_events()
    assert (event.medium, event.removed, event.keys) == (MEDIUM_STORAGE, True, [key(1)])
