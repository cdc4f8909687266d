"""The scheduler with the CPU tier (ledger.offloading's connector), against a worker that keeps
every KV slot symbolically.

Each slot holds a digest of the tokens up to its position, written when the forward pass
computes it; loads and stores copy slots between GPU blocks and CPU chunks in the order the real
worker runs them (flushed stores, loads, the forward pass, the other stores). Before computing
position p a request reads slots 0..p-1 through its block table, and every one must hold the
digest of its own prefix: a block loaded from the wrong chunk, a chunk stored after its block
was overwritten, a load that lands after the forward pass or a hit on a block not yet loaded
all show up as a wrong slot. Tokens depend only on the sequence, so the tier must not change
any of them; it must only compute fewer.
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from ledger.events import BlockRemoved, BlockStored
from ledger.hashing import BlockHasher
from ledger.kv_cache_manager import KVCacheManager
from ledger.offloading.connector import OffloadingConnectorScheduler
from ledger.offloading.manager import CPUOffloadingManager
from ledger.request import Request, RequestStatus
from ledger.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

BS = 4
HASHER = BlockHasher("sha256", seed="tier")


def digest(tokens: list[int]) -> bytes:
    return hashlib.blake2b(repr(tokens).encode(), digest_size=8).digest()


@dataclass
class Seq:
    tokens: list[int]
    table: list[int]
    computed: int


@dataclass
class KVWorker:
    """A worker whose KV cache and CPU tier are digests; it checks every read."""

    gpu: dict[tuple[int, int], bytes] = field(default_factory=dict)
    cpu: dict[tuple[int, int], bytes] = field(default_factory=dict)
    seqs: dict[str, Seq] = field(default_factory=dict)
    wrong_reads: list[str] = field(default_factory=list)
    tokens_computed: int = 0
    prompt_tokens_computed: int = 0
    loads: int = 0
    blocks_loaded: int = 0
    blocks_stored: int = 0

    def _copy(self, src: dict, src_ids: list[int], dst: dict, dst_ids: list[int]) -> None:
        assert len(src_ids) == len(dst_ids)
        for s, d in zip(src_ids, dst_ids, strict=True):
            for offset in range(BS):
                if (s, offset) in src:
                    dst[(d, offset)] = src[(s, offset)]
                else:
                    dst.pop((d, offset), None)

    def execute(self, out: SchedulerOutput) -> tuple[dict[str, int], list[int]]:
        for rid in (*out.finished_req_ids, *out.preempted_req_ids):
            self.seqs.pop(rid, None)
        for new in out.scheduled_new_reqs:
            rid = new.request.request_id
            self.seqs[rid] = Seq(list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
        for cached in out.scheduled_cached_reqs:
            seq = self.seqs[cached.request.request_id]
            seq.tokens.extend(cached.new_token_ids)
            seq.table.extend(cached.new_block_ids)
            seq.computed = cached.num_computed_tokens
        meta = out.kv_transfers
        done: list[int] = []
        if meta is not None:
            for job_id, job in meta.store_jobs.items():
                if job_id in meta.jobs_to_flush:  # its blocks are written this step
                    self._copy(self.gpu, job.src, self.cpu, job.dst)
                    done.append(job_id)
            for job_id, job in meta.load_jobs.items():
                self._copy(self.cpu, job.src, self.gpu, job.dst)
                self.loads += 1
                self.blocks_loaded += len(job.dst)
                done.append(job_id)
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            seq = self.seqs[rid]
            for p in range(seq.computed):
                if self.gpu.get((seq.table[p // BS], p % BS)) != digest(seq.tokens[: p + 1]):
                    self.wrong_reads.append(f"step {out.step_id}: {rid} position {p}")
                    break
            for p in range(seq.computed, seq.computed + n):
                self.gpu[(seq.table[p // BS], p % BS)] = digest(seq.tokens[: p + 1])
            self.tokens_computed += n
            prompt = out_request(out, rid).num_prompt_tokens
            self.prompt_tokens_computed += max(0, min(prompt, seq.computed + n) - seq.computed)
            seq.computed += n
            if seq.computed == len(seq.tokens):
                token = int.from_bytes(digest(seq.tokens)[:2], "big") % 50
                seq.tokens.append(token)
                sampled[rid] = token
        if meta is not None:
            for job_id, job in meta.store_jobs.items():
                if job_id not in meta.jobs_to_flush:
                    self._copy(self.gpu, job.src, self.cpu, job.dst)
                    done.append(job_id)
                self.blocks_stored += len(job.src)
        return sampled, done


def out_request(out: SchedulerOutput, rid: str) -> Request:
    for new in out.scheduled_new_reqs:
        if new.request.request_id == rid:
            return new.request
    return next(c.request for c in out.scheduled_cached_reqs if c.request.request_id == rid)


def make(
    num_blocks: int,
    chunks: int | None,
    policy: str = "lru",
    async_scheduling: bool = False,
    sync_load_tokens: int = 0,
) -> Scheduler:
    """`sync_load_tokens`: vLLM's sync-load budget, in tokens a step (a token's KV is a byte
    here)."""
    max_model_len = min(64, (num_blocks - 1) * BS)
    manager = KVCacheManager(num_blocks, BS, max_model_len, enable_kv_cache_events=True)
    connector = None
    if chunks is not None:
        tier = CPUOffloadingManager(chunks, policy, enable_events=True)
        connector = OffloadingConnectorScheduler(
            tier, BS, sync_load_budget_bytes=sync_load_tokens, kv_bytes_per_token=1
        )
    config = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_seqs=6,
        max_num_batched_tokens=32,
        async_scheduling=async_scheduling,
    )
    return Scheduler(config, manager, connector)


def workload(seed: int, n: int = 30) -> list[tuple[int, Request]]:
    """(arrival step, request): a few long shared documents, each request a prefix of one plus
    a tail of its own, arriving over time."""
    rng = random.Random(seed)
    documents = [[rng.randrange(50) for _ in range(8 * BS)] for _ in range(4)]
    arrivals = []
    for i in range(n):
        document = rng.choice(documents)
        prompt = document[: rng.randrange(BS, len(document) + 1)]
        prompt += [rng.randrange(50) for _ in range(rng.randrange(0, 2 * BS))]
        max_tokens = rng.randrange(1, 12)
        request = Request(f"r{i}", prompt, max_tokens, arrival_time=float(i), block_hasher=HASHER,
                          block_size=BS)  # fmt: skip
        arrivals.append((rng.randrange(0, 4 * n), request))
    return sorted(arrivals, key=lambda a: a[0])


@dataclass
class Run:
    outputs: dict[str, list[int]]
    worker: KVWorker
    scheduler: Scheduler
    events: list = field(default_factory=list)


def run(scheduler: Scheduler, arrivals: list[tuple[int, Request]], depth: int = 1) -> Run:
    worker = KVWorker()
    pending = deque(arrivals)
    outputs: dict[str, list[int]] = {}
    events: list = []
    in_flight: deque[tuple[SchedulerOutput, dict[str, int], list[int]]] = deque()
    for step in range(20_000):
        while pending and pending[0][0] <= step:
            scheduler.add_request(pending.popleft()[1])
        if not pending and not in_flight and not scheduler.has_requests():
            break
        if len(in_flight) < depth and scheduler.has_requests():
            out = scheduler.schedule()
            events += scheduler.take_events()
            if not out.is_empty or out.has_transfers:
                in_flight.append((out, *worker.execute(out)))
                if len(in_flight) < depth:
                    continue
        if not in_flight:
            continue
        out, sampled, done = in_flight.popleft()
        for update in scheduler.update_from_output(out, sampled, done):
            if update.finished:
                outputs[update.request.request_id] = update.request.output_token_ids
        events += scheduler.take_events()
    else:
        raise AssertionError("the run did not end")
    return Run(outputs, worker, scheduler, events)


@pytest.mark.parametrize("sync_load_tokens", [0, 12, 1 << 20])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("seed", range(4))
def test_the_tier_loads_evicted_prefixes_back_and_changes_no_token(
    seed, policy, async_scheduling, sync_load_tokens
):
    depth = 2 if async_scheduling else 1
    # 17 lendable blocks of 4 tokens: the documents (8 blocks each) do not stay on the GPU.
    off = run(make(18, None, async_scheduling=async_scheduling), workload(seed), depth)
    on = run(make(18, 64, policy, async_scheduling, sync_load_tokens), workload(seed), depth)
    assert off.worker.wrong_reads == [] and on.worker.wrong_reads == []
    assert on.outputs == off.outputs and len(on.outputs) == 30
    assert on.worker.loads > 0 and on.scheduler.num_loads == on.worker.loads
    # Loads within their step only under a budget; an unbounded one takes every hit that leaves
    # a token to compute (every load here but whole prompts).
    assert (on.scheduler.num_sync_loads > 0) == (sync_load_tokens > 0)
    assert on.worker.prompt_tokens_computed < off.worker.prompt_tokens_computed
    for result in (off, on):  # the scheduler counts what the worker computed
        assert result.scheduler.num_prompt_tokens_computed == result.worker.prompt_tokens_computed
    for result in (off, on):
        manager = result.scheduler.kv_cache_manager
        assert manager.num_free_blocks == 17 and not manager.req_to_blocks
    connector = on.scheduler.connector
    assert connector is not None and not connector.jobs and not connector.requests
    assert not on.scheduler.load_jobs and not on.scheduler.loaded and not on.scheduler.loading
    cpu = [e for e in on.events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert len(cpu) == on.worker.blocks_stored > 0


def test_a_tier_too_small_to_hold_anything_long_still_gives_the_same_tokens():
    off = run(make(18, None), workload(7))
    on = run(make(18, 2, "arc"), workload(7))
    assert on.worker.wrong_reads == [] and on.outputs == off.outputs


def test_a_loading_request_waits_and_is_admitted_with_the_loaded_tokens():
    s = make(40, 16)
    first = Request("a", list(range(12)), 1, block_hasher=HASHER, block_size=BS)
    result = run(s, [(0, first)])
    assert result.worker.blocks_stored == 3  # its three full prompt blocks
    s.kv_cache_manager.reset_prefix_cache()  # the GPU forgets them: only the tier holds them
    again = Request("b", list(range(12)) + [40, 41], 1, block_hasher=HASHER, block_size=BS)
    s.add_request(again)
    out = s.schedule()
    assert out.is_empty and out.has_transfers
    assert again.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert again.num_computed_tokens == 12 and again.num_cached_tokens == 12
    (job,) = out.kv_transfers.load_jobs.values()
    assert len(job.src) == 3 and job.dst == s.kv_cache_manager.get_block_ids("b")[:3]
    assert s.schedule().is_empty  # nothing is admitted while the load is out
    s.update_from_output(out, {}, list(out.kv_transfers.load_jobs))
    admitted = s.schedule()
    assert admitted.num_scheduled_tokens == {"b": 2}
    (admission,) = admitted.admissions
    assert (admission.num_hit_tokens, admission.num_loaded_tokens) == (0, 12)
    # The loaded blocks are in the GPU prefix cache now.
    stored = [e for e in s.take_events() if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert sum(len(e.block_hashes) for e in stored) == 3


def test_a_sync_load_is_admitted_in_the_step_that_loads_it():
    s = make(40, 16, sync_load_tokens=12)
    first, second = list(range(12)), list(range(20, 32))
    run(s, [(0, Request("a", first, 1, block_hasher=HASHER, block_size=BS)),
            (0, Request("a2", second, 1, block_hasher=HASHER, block_size=BS))])  # fmt: skip
    s.kv_cache_manager.reset_prefix_cache()
    s.take_events()
    again = Request("b", first + [40, 41], 1, block_hasher=HASHER, block_size=BS)
    # 12 tokens fit the budget; the other request's 12 in the same step do not: it waits.
    other = Request("c", second + [42, 43], 1, block_hasher=HASHER, block_size=BS)
    s.add_request(again)
    s.add_request(other)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 2} and again.status == RequestStatus.RUNNING
    assert other.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (admission,) = out.admissions
    assert (admission.request_id, admission.num_loaded_tokens) == ("b", 12)
    jobs = out.kv_transfers.load_jobs
    assert [job.sync for job in jobs.values()] == [True, False]
    first = next(iter(jobs.values()))
    assert first.dst == s.kv_cache_manager.get_block_ids("b")[:3] and first.first_block_index == 0
    assert s.num_loads == 2 and s.num_sync_loads == 1
    # Its blocks went into the GPU prefix cache as they were allocated (before the copy).
    stored = [e for e in s.take_events() if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert sum(len(e.block_hashes) for e in stored) == 3


def test_a_whole_prompt_loaded_recomputes_its_last_token():
    s = make(40, 16)
    run(s, [(0, Request("a", list(range(8)), 1, block_hasher=HASHER, block_size=BS))])
    s.kv_cache_manager.reset_prefix_cache()
    again = Request("b", list(range(8)), 1, block_hasher=HASHER, block_size=BS)
    s.add_request(again)
    out = s.schedule()
    s.update_from_output(out, {}, list(out.kv_transfers.load_jobs))
    assert s.schedule().num_scheduled_tokens == {"b": 1}
    assert again.num_computed_tokens == 8  # 7 loaded and kept, the last one computed now


def test_forgetting_the_tier_publishes_its_blocks_removed_and_requeues_loading_requests():
    s = make(40, 16)
    run(s, [(0, Request("a", list(range(12)), 1, block_hasher=HASHER, block_size=BS))])
    s.take_events()
    s.kv_cache_manager.reset_prefix_cache()
    waiting = Request("b", list(range(12)) + [9], 1, block_hasher=HASHER, block_size=BS)
    s.add_request(waiting)
    out = s.schedule()
    assert waiting.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    events = s.forget_tier()
    (removed,) = events
    assert isinstance(removed, BlockRemoved) and removed.medium == "CPU"
    assert len(removed.block_hashes) == 3
    assert waiting.status == RequestStatus.WAITING and waiting.num_computed_tokens == 0
    assert s.kv_cache_manager.num_free_blocks == 39 and s.kv_cache_manager.reset_prefix_cache()
    # The request starts over and finds nothing to load: it computes its prompt and stores it
    # into the emptied tier, from chunk 0 again.
    s.update_from_output(out, {}, [])
    again = s.schedule()
    assert again.num_scheduled_tokens == {"b": 13}
    assert again.kv_transfers is not None and not again.kv_transfers.load_jobs
    (store,) = again.kv_transfers.store_jobs.values()
    assert store.dst == [0, 1, 2]


def test_without_the_tier_a_step_carries_no_transfers():
    s = make(40, None)
    s.add_request(Request("a", list(range(12)), 2, block_hasher=HASHER, block_size=BS))
    out = s.schedule()
    assert out.kv_transfers is None and not out.has_transfers
    assert s.forget_tier() == []
