"""When the CPU tier stores and loads: vLLM 0.33's OffloadingConnectorScheduler, as a pure class.

The configuration kvledger runs: one full-attention KV-cache group, offloaded block size equal to
the GPU block size (a chunk is one block), no sliding window, every chunk (not whole requests),
and vLLM's optional sync-load budget. The scheduler calls it as vLLM's calls its connector:

    on_new_request(request)                      a request arrives
    get_num_new_matched_tokens(request, n)       tokens past the n locally cached ones that the
                                                 tier can load (None: ask again later, a block
                                                 of it is still being written or loaded)
    update_state_after_alloc(request, blocks, k) blocks allocated; k > 0 loads those k tokens
    build_connector_meta(scheduler_output)       end of a step: the step's load and store jobs,
                                                 and the jobs the workers must finish first
    update_connector_output(completed)           the workers' reports, {job_id: workers done}
    request_finished(request)                    before its blocks are freed (never delayed)
    take_events() / reset_cache()

Stores: a request's full prompt blocks (offload_prompt_only, vLLM's default) are offered as its
chunks are scheduled, in prefix order, and each is offered until the tier takes or already holds
it; blocks loaded from the tier are not offered back. A store reads GPU blocks after the step
that computed them, so when a finished request's block is handed to another request while its
store is still in flight, that job is flushed (the worker completes it before the block is
overwritten); a preempted request's stores are flushed likewise.

Loads are asynchronous, as vLLM's are by default: the request waits (WAITING_FOR_REMOTE_KVS)
while its load is issued in one step and reported with that step's result, and computes in a
later step. With a sync-load budget (`sync_load_budget_bytes`, vLLM's extra config key: KV bytes
per step, per worker) a hit that fits what is left of the step's budget and leaves at least one
token to compute loads *within* the step instead: the workers copy it before the forward pass
that computes the rest of the prompt, so the request is admitted in the step that loads it. Its
blocks are cached at allocation (their hashes set), so the load matches them by position.

Order matters and follows vLLM: finished requests are visited in the iteration order of the
scheduler output's `finished_req_ids` set, and a store's keys complete in the order of a set, so
two processes agree byte for byte when they share PYTHONHASHSEED.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain

from ledger.block import KVCacheBlock
from ledger.events import AnyKVCacheEvent
from ledger.offloading.base import (
    ConnectorMeta,
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    RequestContext,
    TransferJob,
    make_offload_key,
)
from ledger.offloading.events import to_kv_events
from ledger.offloading.manager import CPUOffloadingManager
from ledger.offloading.shared import TieringManager
from ledger.request import Request, RequestStatus
from ledger.scheduler_output import SchedulerOutput


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class JobStatus:
    req_id: str
    pending_workers: int
    keys: set[OffloadKey]
    is_store: bool
    # A store's source blocks, watched for reuse once the request has finished.
    source_block_ids: list[int] = field(default_factory=list)
    # A sync load (done within the step it is issued in): stores may be issued beside it.
    is_sync_load: bool = False


@dataclass(slots=True)
class RequestState:
    """The connector's notes on one request.

    `offload_keys` follows the request's block hashes lazily: brought up to date where keys are
    read (a lookup, a store), not as each decode step fills a block. `block_ids` follows the
    blocks the scheduler output hands the request, every step. `max_stored_idx` is the chunk
    count past which nothing is offered (the prompt's full blocks under offload_prompt_only).
    """

    request: Request
    context: RequestContext
    max_stored_idx: int
    offload_keys: list[OffloadKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    next_stored_idx: int = 0  # the first chunk not yet stored (or not to be stored)
    num_local_tokens: int = 0  # the GPU prefix-cache hit at the last lookup
    transfer_jobs: set[int] = field(default_factory=set)  # one load, or stores
    finished_signaled: bool = False

    def update_offload_keys(self, block_size: int) -> None:
        hashes = self.request.block_hashes
        for index in range(len(self.offload_keys), len(hashes)):
            key = make_offload_key(hashes[index])
            self.offload_keys.append(key)
            self.context.set_position(key, (index + 1) * block_size)

    def storable_chunks(self, num_offloadable_tokens: int, block_size: int) -> int:
        return min(
            num_offloadable_tokens // block_size, len(self.block_ids), len(self.offload_keys)
        )


class OffloadingConnectorScheduler:
    def __init__(
        self,
        manager: CPUOffloadingManager | TieringManager,
        block_size: int,
        num_workers: int = 1,
        offload_prompt_only: bool = True,
        enable_prefix_caching: bool = True,
        sync_load_budget_bytes: int = 0,
        kv_bytes_per_token: int = 0,
    ) -> None:
        self.manager = manager
        self.block_size = block_size
        self.num_workers = num_workers
        self.offload_prompt_only = offload_prompt_only
        # KV bytes a step may load within itself, on each worker (0: every load is async), and
        # what a token's KV is on one worker (all layers, K and V).
        self.sync_load_budget_bytes = sync_load_budget_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.requests: dict[str, RequestState] = {}
        self.jobs: dict[int, JobStatus] = {}
        self.next_job_id = 0
        # Job ids below this were issued before the last reset: their reports are ignored.
        self.stale_job_threshold = 0
        self.reset_fence: dict[int, int] = {}  # pre-reset job -> workers yet to report
        # GPU block -> store jobs still reading it (a finished request's blocks may be reused).
        self.block_to_pending_jobs: dict[int, set[int]] = {}
        # Keys being loaded: a request hitting one waits rather than loading it twice.
        self.keys_being_loaded: set[OffloadKey] | None = set() if enable_prefix_caching else None
        self._batch_load_jobs: dict[int, TransferJob] = {}
        self._batch_jobs_to_flush: set[int] = set()
        self._batch_allocated: set[int] = set()
        # Requests loading within this step, and the KV bytes they load (on each worker).
        self._batch_sync_loads: set[str] = set()
        self._batch_sync_load_bytes = 0
        # The requests with chunks still to offer (next_stored_idx < max_stored_idx): the only
        # scheduled ones a step's stores visit. Under offload_prompt_only a request leaves it
        # once its prompt's blocks are offered, so decoding requests cost the stores nothing.
        self.offering: set[str] = set()

    def _new_job_id(self) -> int:
        self.next_job_id += 1
        return self.next_job_id - 1

    def _set_next_stored(self, state: RequestState, index: int) -> None:
        state.next_stored_idx = index
        if index < state.max_stored_idx:
            self.offering.add(state.request.request_id)
        else:
            self.offering.discard(state.request.request_id)

    def _forget_request(self, req_id: str) -> None:
        del self.requests[req_id]
        self.offering.discard(req_id)

    def on_new_request(self, request: Request) -> None:
        context = RequestContext(request.request_id)
        self.manager.on_new_request(context)
        # Past the prompt's full blocks nothing is offered (offload_prompt_only); else no limit.
        limit = (
            request.num_prompt_tokens // self.block_size if self.offload_prompt_only else 1 << 62
        )
        state = self.requests[request.request_id] = RequestState(request, context, limit)
        self._set_next_stored(state, 0)

    # --- admission ---

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int, max_num_new_tokens: int | None = None
    ) -> tuple[int | None, bool]:
        """(tokens the tier can load past num_computed_tokens or None to retry, load is async)."""
        state = self.requests[request.request_id]
        state.block_ids.clear()
        self._set_next_stored(state, 0)  # starting over: every chunk is offered again
        if state.transfer_jobs:
            return None, False
        state.update_offload_keys(self.block_size)
        state.num_local_tokens = num_computed_tokens
        hit = 0 if request.skip_reading_prefix_cache else self._lookup(state, max_num_new_tokens)
        sync_load = self._reserve_sync_load(request, num_computed_tokens, hit)
        return hit, bool(hit) and not sync_load

    def _reserve_sync_load(
        self, request: Request, num_computed_tokens: int, num_hit_tokens: int | None
    ) -> bool:
        """Whether this hit loads within the step: it fits what is left of the step's budget and
        leaves a token to compute (else the request could not be scheduled with it)."""
        if not self.sync_load_budget_bytes:
            return False  # (the step's set stays empty)
        req_id = request.request_id
        self._batch_sync_loads.discard(req_id)
        if not num_hit_tokens or num_computed_tokens + num_hit_tokens >= request.num_tokens:
            return False
        num_bytes = num_hit_tokens * self.kv_bytes_per_token
        if self._batch_sync_load_bytes + num_bytes > self.sync_load_budget_bytes:
            return False
        self._batch_sync_load_bytes += num_bytes
        self._batch_sync_loads.add(req_id)
        return True

    def _lookup(self, state: RequestState, max_num_new_tokens: int | None) -> int | None:
        block_size, keys = self.block_size, state.offload_keys
        computed = state.num_local_tokens
        max_hit = state.request.num_tokens
        if max_num_new_tokens is not None:
            max_hit = min(max_hit, computed + max_num_new_tokens)
        max_hit = min(max_hit, len(keys) * block_size)
        if max_hit - computed < block_size:
            return 0  # less than a block to load
        start = computed // block_size
        hits, pending = 0, False
        for key in keys[start : min(cdiv(max_hit, block_size), len(keys))]:
            found = self.manager.lookup(key, state.context)
            if found is LookupResult.MISS:
                break
            hits += 1
            pending |= found is LookupResult.HIT_PENDING
        if pending:
            return None  # a hit still being written: wait for it
        if hits == 0:
            return 0
        num_hit_tokens = min(max_hit, block_size * (start + hits)) - computed
        if num_hit_tokens < block_size:
            return 0
        being_loaded = self.keys_being_loaded
        if being_loaded and any(
            key in being_loaded for key in keys[start : cdiv(computed + num_hit_tokens, block_size)]
        ):
            return None  # another request is loading part of it: wait, then hit the GPU cache
        return num_hit_tokens

    def update_state_after_alloc(
        self, request: Request, blocks: Sequence[KVCacheBlock], num_external_tokens: int
    ) -> None:
        """The request's blocks (all of them) are allocated; load the external tokens into them."""
        self._batch_allocated.update(b.block_id for b in blocks if b.block_id != 0)
        if num_external_tokens == 0:
            return
        state = self.requests[request.request_id]
        sync_load = request.request_id in self._batch_sync_loads
        block_size = self.block_size
        num_local = state.num_local_tokens
        num_gpu_blocks = cdiv(num_local + num_external_tokens, block_size)
        assert len(blocks) >= num_gpu_blocks and num_local % block_size == 0
        # The first block past the local hit that is not cached already (a sync load's blocks
        # were cached as they were allocated: the first past the local hit).
        load_start = num_gpu_blocks
        for index in range(cdiv(num_local, block_size), num_gpu_blocks):
            block = blocks[index]
            if not block.is_null and (sync_load or block.block_hash is None):
                load_start = index
                break
        keys = state.offload_keys[load_start:num_gpu_blocks] if num_gpu_blocks > load_start else []
        # Loaded chunks are in the tier already: never offered back.
        self._set_next_stored(state, num_gpu_blocks)
        chunk_ids = self.manager.prepare_load(keys, state.context)
        dst = [block.block_id for block in blocks[load_start:num_gpu_blocks]]
        job_id = self._new_job_id()
        self._batch_load_jobs[job_id] = TransferJob(
            request.request_id, chunk_ids, dst, load_start, sync=sync_load
        )
        assert not state.transfer_jobs, "a load is issued only when no transfer is in flight"
        state.transfer_jobs.add(job_id)
        self.jobs[job_id] = JobStatus(
            request.request_id, self.num_workers, set(keys), False, is_sync_load=sync_load
        )
        # A sync load is done before this step's forward pass: nobody waits for its keys.
        if self.keys_being_loaded is not None and not sync_load:
            self.keys_being_loaded.update(keys)

    # --- the end of a step ---

    def build_connector_meta(self, output: SchedulerOutput) -> ConnectorMeta:
        self._update_request_states(output)
        for req_id in output.preempted_req_ids:
            state = self.requests.get(req_id)
            if state is not None:
                # Its blocks are freed: stores still reading them finish first.
                self._batch_jobs_to_flush.update(state.transfer_jobs - self._batch_load_jobs.keys())
        pending = self.block_to_pending_jobs
        if pending and not pending.keys().isdisjoint(self._batch_allocated):
            self._batch_jobs_to_flush.update(
                job_id
                for block_id in self._batch_allocated
                if block_id in pending
                for job_id in pending[block_id]
            )
        meta = ConnectorMeta(
            self._batch_load_jobs, self._build_store_jobs(output), self._batch_jobs_to_flush
        )
        if isinstance(self.manager, TieringManager):
            meta.shared = self.manager.take_jobs()
        for req_id in output.finished_req_ids:
            state = self.requests.get(req_id)
            if state is None:
                continue
            state.finished_signaled = True
            self.manager.on_request_finished(state.context)
            if not state.transfer_jobs:
                self._forget_request(req_id)
        self._batch_load_jobs = {}
        self._batch_sync_loads = set()
        self._batch_sync_load_bytes = 0
        self._batch_jobs_to_flush = set()
        self._batch_allocated = set()
        return meta

    def _update_request_states(self, output: SchedulerOutput) -> None:
        """Each scheduled request's blocks (its keys are brought up to date where they are
        read). At 1,000 running requests, most of them decoding, this is the connector's only
        visit to every one: a test of whether it was handed a block."""
        requests, allocated = self.requests, self._batch_allocated
        for new in output.scheduled_new_reqs:
            requests[new.request.request_id].block_ids[:] = new.block_ids
            allocated.update(new.block_ids)
        for cached in output.scheduled_cached_reqs:
            if cached.new_block_ids:
                requests[cached.request.request_id].block_ids.extend(cached.new_block_ids)
                allocated.update(cached.new_block_ids)
        allocated.discard(0)  # the null block (sliding windows) is never written

    def _num_offloadable_tokens(self, request: Request, num_tokens: int) -> int:
        num = min(num_tokens, request.num_tokens)
        return min(num, request.num_prompt_tokens) if self.offload_prompt_only else num

    def _build_store_jobs(self, output: SchedulerOutput) -> dict[int, TransferJob]:
        block_size = self.block_size
        store_jobs: dict[int, TransferJob] = {}
        # The scheduled requests with chunks still to offer, in the output's order (the others,
        # decoding requests whose prompt is offered, have nothing to store), then the finished.
        offering = self.offering
        scheduled = filter(offering.__contains__, output.num_scheduled_tokens) if offering else ()
        for req_id in chain(scheduled, output.finished_req_ids):
            state = self.requests.get(req_id)
            if state is None or state.next_stored_idx >= state.max_stored_idx:
                continue
            request = state.request
            if request.status == RequestStatus.FINISHED_ABORTED:
                num_tokens = request.num_computed_tokens
            elif request.is_finished:
                # The last sampled token's slot is never written: a block ending there is not.
                num_tokens = max(request.num_prompt_tokens, request.num_tokens - 1)
            else:
                num_tokens = request.num_computed_tokens + output.num_scheduled_tokens[req_id]
            num_offloadable = self._num_offloadable_tokens(request, num_tokens)
            if len(request.block_hashes) > len(state.offload_keys):
                state.update_offload_keys(block_size)
            num_chunks = state.storable_chunks(num_offloadable, block_size)
            start = state.next_stored_idx
            offered = [
                key
                for key, block_id in zip(
                    state.offload_keys[start:num_chunks],
                    state.block_ids[start:num_chunks],
                    strict=True,
                )
                if block_id != 0
            ]
            if not offered:
                self._set_next_stored(state, max(start, num_chunks))
                continue
            stored = self.manager.prepare_store(offered, state.context)
            if stored is None:
                continue  # nothing evictable: offered again next step
            if not stored.keys_to_store:
                self._set_next_stored(state, max(start, num_chunks))
                continue
            keys_to_store = set(stored.keys_to_store)
            source_index: int | None = None
            source: list[int] = []
            for index in range(start, num_chunks):
                block_id = state.block_ids[index]
                if state.offload_keys[index] in keys_to_store and block_id != 0:
                    source_index = index if source_index is None else source_index
                    source.append(block_id)
            self._set_next_stored(state, max(start, num_chunks))
            job_id = self._new_job_id()
            assert all(
                self.jobs[j].is_store or self.jobs[j].is_sync_load for j in state.transfer_jobs
            ), "store while loading"
            state.transfer_jobs.add(job_id)
            # A set of that set, as vLLM builds it: the order the keys complete in (and their
            # BlockStored events come out in) is this set's iteration order.
            job_keys = set(keys_to_store)
            self.jobs[job_id] = JobStatus(req_id, self.num_workers, job_keys, True, source)
            store_jobs[job_id] = TransferJob(req_id, source, stored.chunk_ids, source_index or 0)
            if request.is_finished:
                for block_id in source:
                    self.block_to_pending_jobs.setdefault(block_id, set()).add(job_id)
                    if block_id in self._batch_allocated:
                        self._batch_jobs_to_flush.add(job_id)
        return store_jobs

    # --- the workers' reports and the end of a request ---

    def update_connector_output(self, completed: Mapping[int, int]) -> None:
        """`completed`: job id -> how many workers finished it since the last report."""
        for job_id, count in completed.items():
            assert count > 0
            if job_id < self.stale_job_threshold:
                if job_id in self.reset_fence:
                    self.reset_fence[job_id] -= count
                    if self.reset_fence[job_id] <= 0:
                        del self.reset_fence[job_id]
                continue
            job = self.jobs[job_id]
            job.pending_workers -= count
            if job.pending_workers > 0:
                continue
            state = self.requests[job.req_id]
            if job.is_store:
                self.manager.complete_store(job.keys, state.context)
            else:
                self.manager.complete_load(job.keys, state.context)
                if self.keys_being_loaded:
                    self.keys_being_loaded.difference_update(job.keys)
            if self.block_to_pending_jobs and state.request.is_finished:
                self._forget_pending(job_id, job.source_block_ids)
            del self.jobs[job_id]
            state.transfer_jobs.remove(job_id)
            if state.finished_signaled and not state.transfer_jobs:
                self._forget_request(job.req_id)

    def _forget_pending(self, job_id: int, block_ids: list[int]) -> None:
        for block_id in block_ids:
            jobs = self.block_to_pending_jobs[block_id]
            jobs.remove(job_id)
            if not jobs:
                del self.block_to_pending_jobs[block_id]

    def request_finished(self, request: Request) -> tuple[bool, None]:
        """Called before the request's blocks are freed; they are never held for the tier."""
        state = self.requests.get(request.request_id)
        if state is None:
            return False, None
        for job_id in state.transfer_jobs:
            for block_id in self.jobs[job_id].source_block_ids:
                self.block_to_pending_jobs.setdefault(block_id, set()).add(job_id)
        return False, None

    def has_pending_work(self) -> bool:
        """The engine must keep stepping while jobs (or a reset's old jobs) are unreported."""
        if isinstance(self.manager, TieringManager) and self.manager.has_pending_work():
            return True
        return bool(self.jobs or self.reset_fence)

    def has_queued_work(self) -> bool:
        """Shared-tier copies waiting for a step: one is due even with no request left."""
        return isinstance(self.manager, TieringManager) and self.manager.has_queued_work()

    def take_promoted(self, req_id: str) -> tuple[int, tuple[str, ...]]:
        """Blocks promoted from the shared tier for this request since the last call, and the
        replicas that wrote them ("" where the writer is not known)."""
        if isinstance(self.manager, TieringManager):
            origins = self.manager.promoted_from.pop(req_id, set())
            return self.manager.promoted_for.pop(req_id, 0), tuple(sorted(origins))
        return 0, ()

    def update_shared_output(
        self, failed: Mapping[int, Sequence[int]], unreachable: Iterable[int] = ()
    ) -> None:
        """The workers' reports of the step's shared-tier copies (job id -> failed key indices;
        the jobs that failed for want of the store)."""
        if isinstance(self.manager, TieringManager):
            self.manager.complete_jobs(failed, unreachable)

    def take_events(self) -> list[AnyKVCacheEvent]:
        return to_kv_events(self.manager.take_events())

    def forget(self) -> list[AnyKVCacheEvent]:
        """The workers lost the tier (a restart; beyond vLLM, whose tier lives in its own
        process): the events still due, then one BlockRemoved (medium CPU) of every block it had
        announced, and the books emptied as `reset_cache` empties them. The jobs in flight died
        with the workers' steps, so none is flushed and no report of them is awaited."""
        events = self.take_events()
        held = self.manager.ready_keys()
        self.reset_cache()
        self._batch_jobs_to_flush.clear()
        self.reset_fence.clear()
        self.manager.take_events()  # a reset announces nothing of its own
        if held:
            events += to_kv_events(
                [OffloadingEvent(held, removed=True, medium=self.manager.medium)]
            )
        return events

    def reset_cache(self) -> None:
        """Forget the tier; jobs in flight are flushed and their reports ignored."""
        self._batch_jobs_to_flush.update(self.jobs)
        for req_id, state in list(self.requests.items()):
            if state.request.is_finished:
                if not state.finished_signaled:
                    self.manager.on_request_finished(state.context)
                self._forget_request(req_id)
        self.manager.reset_cache()
        for state in self.requests.values():
            self._set_next_stored(state, 0)
            state.transfer_jobs.clear()
        self.stale_job_threshold = self.next_job_id
        self.reset_fence.update((job_id, job.pending_workers) for job_id, job in self.jobs.items())
        self.jobs.clear()
        self.block_to_pending_jobs.clear()
        if self.keys_being_loaded is not None:
            self.keys_being_loaded.clear()
