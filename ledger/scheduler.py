"""The scheduler: vLLM V1's single token budget, no prefill/decode phases.

Each step first serves `running` (oldest first), growing each request by what it still needs
(a prefill chunk or one decode token); when a request cannot grow, it preempts from the tail of
`running` (the lowest priority under the priority policy) by recompute. Only if nothing was
preempted does it admit from `waiting`, while blocks, budget and `max_num_seqs` allow, stopping
at the first request that does not fit. The whole policy is `schedule()`, read top to bottom.

With the CPU tier (an `OffloadingConnectorScheduler`), the scheduler calls it as vLLM's calls
its connector: a waiting request's lookup past its GPU hit (`get_num_new_matched_tokens`); a
hit to load gets its blocks and waits (WAITING_FOR_REMOTE_KVS, passed over) until the workers
report the load, then is admitted with those tokens computed; every allocation is told to the
connector (`update_state_after_alloc`), every finished request too (`request_finished`, before
its blocks are freed); the step carries the connector's loads and stores (`kv_transfers`), and
the workers' reports come back through `update_from_output`. Without it, nothing of this runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Generic

from ledger.capacity import cdiv
from ledger.events import AnyKVCacheEvent
from ledger.kv_cache_manager import KVCacheManager, PrefixCacheStats
from ledger.offloading.connector import OffloadingConnectorScheduler
from ledger.request import P, Request, RequestStatus
from ledger.request_queue import WaitingQueue
from ledger.scheduler_output import (
    Admission,
    CachedRequestData,
    NewRequestData,
    Preemption,
    RequestUpdate,
    SchedulerOutput,
    WaitingHeld,
)


@dataclass(slots=True)
class SchedulerConfig:
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # or "priority"
    long_prefill_token_threshold: int = 0  # 0: no cap on one request's prefill chunk
    # Schedule step N+1 before step N's tokens are back (vLLM's async scheduling): each request
    # that samples in a step in flight counts one placeholder token, which the workers supply.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than or equal "
                f"to max_num_seqs ({self.max_num_seqs})."
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}). This effectively limits the maximum sequence length to "
                "max_num_batched_tokens and makes the scheduler reject longer sequences. Please "
                "increase max_num_batched_tokens or decrease max_model_len."
            )


class Scheduler(Generic[P]):
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        connector: OffloadingConnectorScheduler | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        lendable = kv_cache_manager.block_pool.num_gpu_blocks - 1
        needed = cdiv(config.max_model_len, kv_cache_manager.block_size)
        if needed > lendable:
            # A request could then grow past the whole pool and wedge the queue forever.
            raise ValueError(
                f"To serve at least one request with max_model_len ({config.max_model_len}), "
                f"{needed} KV cache blocks are needed, but the pool lends {lendable}. The estimated "
                f"maximum model length is {lendable * kv_cache_manager.block_size}. Decrease "
                "max_model_len or give the pool more blocks."
            )
        self.block_size = kv_cache_manager.block_size
        self.requests: dict[str, Request[P]] = {}
        self.waiting: WaitingQueue[P] = WaitingQueue(config.policy)
        self.running: list[Request[P]] = []
        self.step_id = 0
        self.num_preemptions = 0
        # Prompt positions sent to the workers to compute (those a prefix-cache hit or the CPU
        # tier provides are not; a preempted request's are sent again).
        self.num_prompt_tokens_computed = 0
        # Requests freed since the last step: the workers drop their state.
        self.finished_req_ids: set[str] = set()
        # The CPU tier (None: off). A load job's request, until the workers report the job;
        # then the request is in `loaded` until it is admitted.
        self.connector = connector
        self.load_jobs: dict[int, str] = {}
        self.loaded: set[str] = set()
        # Per request waiting for (or done with) a load: (its GPU hit, the tokens loaded).
        self.loading: dict[str, tuple[int, int]] = {}
        # Waiting requests that hold blocks (loading, or loaded and not admitted yet), in order:
        # they are admitted before any other waiting request (vLLM's kv_holding_waiting).
        self.holding: dict[str, Request[P]] = {}
        self.num_loads = 0
        self.num_sync_loads = 0  # of them, loaded within the step that computes the rest
        self.num_loaded_tokens = 0
        self.num_loaded_blocks = 0
        self.num_stored_blocks = 0
        # The tier's lookups past the GPU hit, in tokens (vllm:external_prefix_cache_*).
        self.connector_prefix_cache_stats = PrefixCacheStats()

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, request: Request[P]) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id}: {request.num_tokens} prompt tokens leave no room "
                f"for output within max_model_len {self.config.max_model_len}"
            )
        if request.block_size != self.block_size:
            # Its hashes were cut at another block size: the pool's blocks are what they cover.
            request.block_size = self.block_size
            request.block_hashes = []
            request.update_block_hashes()
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if self.connector is not None:
            self.connector.on_new_request(request)

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus
    ) -> list[Request[P]]:
        """Abort (or fail) requests wherever they are; returns those that were still known."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    # ---------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput[P]:
        """One step, as vLLM's: running requests first, oldest first, each growing by what it
        needs (preempting from the tail of `running` when its blocks do not fit); then, only
        when nobody was preempted, waiting requests while blocks, the token budget and
        max_num_seqs allow; then what the workers need to run the step."""
        self.step_id += 1
        out: SchedulerOutput[P] = SchedulerOutput(
            step_id=self.step_id, finished_req_ids=self.finished_req_ids
        )
        self.finished_req_ids = set()
        budget = self.config.max_num_batched_tokens
        # Capping one request's prefill only matters when another request could use the budget.
        threshold = (
            self.config.long_prefill_token_threshold
            if len(self.running) + len(self.waiting) > 1
            else 0
        )
        scheduled_running, new_blocks_of, budget = self._schedule_running(out, budget, threshold)
        if self.connector is None:
            scheduled_new = self._schedule_waiting(out, budget, threshold)
        else:
            scheduled_new = self._schedule_waiting_with_tier(out, budget, threshold)
        self._describe_for_workers(out, scheduled_running, new_blocks_of, scheduled_new)
        return out

    def _schedule_running(
        self, out: SchedulerOutput[P], token_budget: int, threshold: int
    ) -> tuple[list[Request[P]], dict[str, tuple[int, ...]], int]:
        """The running requests this step grows, their new block ids, and the budget left."""
        new_blocks_of: dict[str, tuple[int, ...]] = {}
        scheduled_running: list[Request[P]] = []
        # vLLM's per-request checks (are all its outputs already in flight? how many new
        # tokens?) are written out in this loop rather than called: at 1,000 running requests
        # the loop is most of a step, and those two calls were a third of it.
        running = self.running
        allocate_slots = self.kv_cache_manager.allocate_slots
        pool = self.kv_cache_manager.block_pool
        max_model_len = self.config.max_model_len
        num_scheduled_tokens = out.num_scheduled_tokens
        index = 0
        while index < len(running) and token_budget > 0:
            request = running[index]
            num_computed = request.num_computed_tokens
            num_tokens = len(request.all_token_ids)
            pending = request.num_output_placeholders
            if pending > 0 and (
                num_tokens - request.num_prompt_tokens + pending >= request.max_tokens
                or num_tokens + pending >= max_model_len
            ):
                index += 1  # the tokens still being sampled already finish it
                continue
            num_new_tokens = num_tokens + pending - num_computed
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            # Leave room for the token this step samples.
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget
            if num_new_tokens > max_model_len - num_computed - 1:
                num_new_tokens = max_model_len - num_computed - 1
            if num_new_tokens <= 0:
                index += 1
                continue
            while True:
                new_blocks = allocate_slots(request, num_new_tokens)
                if new_blocks is not None:
                    if pool.evictions:
                        self._attribute_evictions(out, request)
                    break
                victim = self._pick_victim()
                victim_index = running.index(victim)
                del running[victim_index]
                if victim_index < index:
                    index -= 1
                if victim in scheduled_running:  # only under the priority policy
                    scheduled_running.remove(victim)
                    token_budget += num_scheduled_tokens.pop(victim.request_id)
                    new_blocks_of.pop(victim.request_id)
                self._preempt(victim, caused_by=request, out=out)
                if victim is request:
                    break
            if new_blocks is None:
                if self.config.policy == "priority" and request.status == RequestStatus.PREEMPTED:
                    continue  # the request preempted itself; the one now at `index` is next
                break
            scheduled_running.append(request)
            new_blocks_of[request.request_id] = (
                tuple([block.block_id for block in new_blocks]) if new_blocks else ()
            )
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            index += 1
        return scheduled_running, new_blocks_of, token_budget

    def _schedule_waiting(
        self, out: SchedulerOutput[P], token_budget: int, threshold: int
    ) -> list[Request[P]]:
        """Waiting requests admitted this step, only when nobody was preempted in it. Whoever is
        left at the head of `waiting` is named in `out.waiting_held` with the reason (for the
        traces; it changes no decision)."""
        scheduled_new: list[Request[P]] = []
        held = None
        while len(self.waiting):
            if out.preemptions:
                held = "preemption"
                break
            if token_budget <= 0:
                held = "budget"
                break
            if len(self.running) >= self.config.max_num_seqs:
                held = "seats"
                break
            request = self.waiting.peek()
            hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            # num_tokens, not the prompt: a resumed request recomputes its outputs too. The cap
            # comes before the budget check, so a capped prompt fits where the whole would not.
            num_new_tokens = request.num_tokens - num_hit_tokens
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            if num_new_tokens > token_budget:
                if not self.config.enable_chunked_prefill:
                    held = "budget"
                    break
                num_new_tokens = token_budget
            watermark_applied = bool(self.running) and self.kv_cache_manager.watermark_blocks > 0
            new_blocks = self.kv_cache_manager.allocate_slots(
                request,
                num_new_tokens,
                num_hit_tokens,
                hit_blocks,
                full_sequence_must_fit=True,
                has_scheduled_reqs=bool(self.running),
            )
            if new_blocks is None:
                held = self.kv_cache_manager.last_refusal
                break  # head-of-line: nothing behind it jumps the queue
            self._attribute_evictions(out, request)
            self.kv_cache_manager.record_prefix_cache_stats(request, num_hit_tokens)
            self.waiting.pop()
            resumed = request.status == RequestStatus.PREEMPTED
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            self.running.append(request)
            scheduled_new.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            out.admissions.append(
                Admission(
                    request_id=request.request_id,
                    resumed=resumed,
                    num_hit_tokens=num_hit_tokens,
                    num_hit_blocks=len(hit_blocks),
                    num_new_blocks=len(new_blocks),
                    num_free_blocks_after=self.kv_cache_manager.num_free_blocks,
                    watermark_applied=watermark_applied,
                )
            )
        if held is not None:
            out.waiting_held = WaitingHeld(self.waiting.peek().request_id, held)
        return scheduled_new

    def _schedule_waiting_with_tier(
        self, out: SchedulerOutput[P], token_budget: int, threshold: int
    ) -> list[Request[P]]:
        """`_schedule_waiting` with the CPU tier, as vLLM's waiting loop with its connector.

        A request the tier can load part of past its GPU hit gets the blocks for both (the
        whole sequence must fit, less what the requests already holding blocks still need),
        its load goes out with this step, and it waits (WAITING_FOR_REMOTE_KVS) without
        computing. Requests holding blocks come first, as vLLM's kv_holding_waiting: one whose
        load the workers reported gets its blocks cached and is admitted like any other with
        those tokens computed (a whole prompt loaded recomputes its last token, for the logits);
        one still loading, and one whose lookup cannot answer yet (a block of its prefix is
        still being stored or loaded), is passed over and keeps its place for the next step.
        """
        scheduled_new: list[Request[P]] = []
        passed_over: list[Request[P]] = []
        held = None
        for request in list(self.holding.values()):
            held = self._cannot_admit(out, token_budget)
            if held is not None:
                break
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if request.request_id not in self.loaded:
                    continue  # still loading
                self._finish_load(request)
            held, num_new_tokens = self._admit_with_tier(out, request, token_budget, threshold)
            if held is not None:
                break
            del self.holding[request.request_id]
            self.waiting.remove(request)
            scheduled_new.append(request)
            token_budget -= num_new_tokens
        while held is None and len(self.waiting):
            held = self._cannot_admit(out, token_budget)
            if held is not None:
                break
            request = self.waiting.peek()
            if request.request_id in self.holding:
                passed_over.append(self.waiting.pop())
                continue
            held, num_new_tokens = self._admit_with_tier(out, request, token_budget, threshold)
            if held == "pass" or request.request_id in self.holding:
                held = None
                passed_over.append(self.waiting.pop())
                continue
            if held is not None:
                break
            self.waiting.pop()
            scheduled_new.append(request)
            token_budget -= num_new_tokens
        for request in reversed(passed_over):
            self.waiting.prepend(request)  # back at the front, in their order
        if held is not None:
            head = next(iter(self.holding.values()), None) if held != "preemption" else None
            out.waiting_held = WaitingHeld((head or self.waiting.peek()).request_id, held)
        return scheduled_new

    def _cannot_admit(self, out: SchedulerOutput[P], token_budget: int) -> str | None:
        if out.preemptions:
            return "preemption"
        if token_budget <= 0:
            return "budget"
        if len(self.running) >= self.config.max_num_seqs:
            return "seats"
        return None

    def _admit_with_tier(
        self, out: SchedulerOutput[P], request: Request[P], token_budget: int, threshold: int
    ) -> tuple[str | None, int]:
        """Admit one request, or start its load: (None, tokens scheduled), or (why not, 0):
        "pass" when its lookup must be asked again next step, else the refusal's reason. A
        request whose load starts is in `holding` afterwards."""
        connector = self.connector
        assert connector is not None
        manager = self.kv_cache_manager
        request_id = request.request_id
        num_external, load_async, looked_up = 0, False, request.num_computed_tokens == 0
        if looked_up:
            hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
            found, load_async = connector.get_num_new_matched_tokens(request, num_hit_tokens)
            if found is None:
                return "pass", 0
            num_external = found
            num_computed = num_hit_tokens + num_external
        else:  # loaded: its blocks are held and cached
            hit_blocks, num_hit_tokens = [], 0
            num_computed = request.num_computed_tokens
        reserved = 0
        if load_async:
            num_new_tokens = 0  # nothing computes until the load is done
            reserved = self._blocks_holding_requests_need()
        else:
            num_new_tokens = request.num_tokens - num_computed
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            if num_new_tokens > token_budget:
                if not self.config.enable_chunked_prefill:
                    return "budget", 0
                num_new_tokens = token_budget
        watermark_applied = bool(self.running) and manager.watermark_blocks > 0
        new_blocks = manager.allocate_slots(
            request,
            num_new_tokens,
            num_hit_tokens,
            hit_blocks,
            full_sequence_must_fit=True,
            has_scheduled_reqs=bool(self.running),
            num_external_computed_tokens=num_external,
            delay_cache_blocks=load_async,
            reserved_blocks=reserved,
        )
        if new_blocks is None:
            return manager.last_refusal, 0  # head-of-line: nothing behind it jumps the queue
        self._attribute_evictions(out, request)
        connector.update_state_after_alloc(request, manager.get_blocks(request_id), num_external)
        if looked_up:
            manager.record_prefix_cache_stats(request, num_hit_tokens)
            self.connector_prefix_cache_stats.record(
                request.num_tokens - num_hit_tokens, num_external, request.num_preemptions > 0
            )
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed  # loaded blocks count as cached
        if num_external:
            self.num_loads += 1
            self.num_sync_loads += not load_async
            self.num_loaded_tokens += num_external
        if load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            request.num_computed_tokens = num_computed
            self.holding[request_id] = request
            self.loading[request_id] = (num_hit_tokens, num_external)
            return None, 0
        resumed = request.status == RequestStatus.PREEMPTED
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        self.running.append(request)
        out.num_scheduled_tokens[request_id] = num_new_tokens
        # Loaded in an earlier step (async), or within this one (a sync load), or nothing.
        num_local, num_loaded = self.loading.pop(request_id, (num_hit_tokens, num_external))
        num_shared, shared_from = connector.take_promoted(request_id) if num_loaded else (0, ())
        out.admissions.append(
            Admission(
                request_id=request_id,
                resumed=resumed,
                num_hit_tokens=num_local,
                num_hit_blocks=num_local // self.block_size,
                num_new_blocks=len(new_blocks),
                num_free_blocks_after=manager.num_free_blocks,
                watermark_applied=watermark_applied,
                num_loaded_tokens=num_loaded,
                num_shared_blocks=num_shared,
                shared_from=shared_from,
            )
        )
        return None, num_new_tokens

    def _blocks_holding_requests_need(self) -> int:
        """Blocks the requests holding some (loading or loaded) still need for their whole
        sequence: kept free when another load is admitted, so that they can all run."""
        bs, max_model_len = self.block_size, self.config.max_model_len
        get_blocks = self.kv_cache_manager.get_blocks
        return sum(
            max(cdiv(min(r.num_tokens, max_model_len), bs) - len(get_blocks(r.request_id)), 0)
            for r in self.holding.values()
        )

    def _finish_load(self, request: Request[P]) -> None:
        """The workers loaded the request's blocks: cache them (they hold its prefix now) and
        make it an ordinary waiting request with those tokens computed (vLLM's
        _update_waiting_for_remote_kv)."""
        self.loaded.discard(request.request_id)
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        if request.num_computed_tokens == request.num_tokens:
            request.num_computed_tokens -= 1  # the last token is computed again, for its logits
        request.status = (
            RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
        )

    def _describe_for_workers(
        self,
        out: SchedulerOutput[P],
        scheduled_running: list[Request[P]],
        new_blocks_of: dict[str, tuple[int, ...]],
        scheduled_new: list[Request[P]],
    ) -> None:
        """What the workers need, then num_computed_tokens advanced past this step: one pass
        per request, in the order of num_scheduled_tokens (running, then new)."""
        num_scheduled_tokens = out.num_scheduled_tokens
        async_scheduling = self.config.async_scheduling
        sampling_req_ids = out.sampling_req_ids
        get_block_ids = self.kv_cache_manager.get_block_ids
        cached_reqs = out.scheduled_cached_reqs

        prompt_computed = 0

        def advance(request: Request[P], num_scheduled: int) -> None:
            # Every token is now on the workers; the request samples once its computed tokens
            # reach its known ones (placeholders included: async tokens still being sampled).
            nonlocal prompt_computed
            num_tokens = len(request.all_token_ids)
            request.num_tokens_sent = num_tokens
            start = request.num_computed_tokens
            num_computed = start + num_scheduled
            request.num_computed_tokens = num_computed
            if start < request.num_prompt_tokens:
                prompt_computed += min(num_computed, request.num_prompt_tokens) - start
            if num_computed >= num_tokens + request.num_output_placeholders:
                sampling_req_ids.add(request.request_id)
                if async_scheduling:
                    request.num_output_placeholders += 1

        # The connector reads the step before it advances (as vLLM's build_connector_meta):
        # with one, the requests advance once it has.
        connector = self.connector
        advance_now = connector is None
        for request in scheduled_running:
            request_id = request.request_id
            num_tokens = len(request.all_token_ids)
            sent = request.num_tokens_sent
            num_computed = request.num_computed_tokens
            cached_reqs.append(
                CachedRequestData(
                    request,
                    tuple(request.all_token_ids[sent:]) if sent < num_tokens else (),
                    new_blocks_of[request_id],
                    num_computed,
                )
            )
            if advance_now:
                advance(request, num_scheduled_tokens[request_id])
        for request in scheduled_new:
            request_id = request.request_id
            num_computed = request.num_computed_tokens
            out.scheduled_new_reqs.append(
                NewRequestData(
                    request=request,
                    token_ids=list(request.all_token_ids),
                    block_ids=get_block_ids(request_id),
                    num_computed_tokens=num_computed,
                )
            )
            if advance_now:
                advance(request, num_scheduled_tokens[request_id])
        if connector is not None:
            meta = out.kv_transfers = connector.build_connector_meta(out)
            for job_id, job in meta.load_jobs.items():
                self.load_jobs[job_id] = job.req_id
                self.num_loaded_blocks += len(job.dst)
            for job in meta.store_jobs.values():
                self.num_stored_blocks += len(job.src)
            for request in chain(scheduled_running, scheduled_new):
                advance(request, num_scheduled_tokens[request.request_id])
        self.num_prompt_tokens_computed += prompt_computed

    def _pick_victim(self) -> Request[P]:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request[P], caused_by: Request[P], out: SchedulerOutput[P]) -> None:
        """Preempt by recompute: free every block (tail first), start over from the front."""
        num_freed = self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        out.preempted_req_ids.append(request.request_id)
        out.preemptions.append(Preemption(request.request_id, caused_by.request_id, num_freed))

    def _attribute_evictions(self, out: SchedulerOutput[P], request: Request[P]) -> None:
        evictions = self.kv_cache_manager.take_evictions()
        if evictions:
            out.evictions.setdefault(request.request_id, []).extend(evictions)

    # ---------------------------------------------------------------- results of a step

    def update_from_output(
        self,
        out: SchedulerOutput[P],
        sampled: dict[str, int],
        transfers_done: Iterable[int] = (),
        shared_failed: Mapping[int, Sequence[int]] | None = None,
        shared_unreachable: Sequence[int] | None = None,
    ) -> list[RequestUpdate[P]]:
        """Append each sampled token, stop finished requests and free their blocks.

        With async scheduling a later step may already be in flight: a request preempted since
        this step was sent still gets its token (the workers computed it before dropping the
        request), and a request that stops here was scheduled once more for nothing.

        Async scheduling also caches here, as vLLM does when a step's tokens come back: the
        blocks whose last slot this step computed. The request's next `allocate_slots` would
        cache them too, but a request whose last token was already being sampled sits out the
        next step and finishes here. (At most one step runs ahead of the results, so a
        preempted request is never resumed while tokens of its old steps are still out.)
        """
        updates = []
        sampling_req_ids = out.sampling_req_ids
        requests = self.requests
        manager = self.kv_cache_manager
        num_cached_block = manager.num_cached_block
        block_size = self.block_size
        max_model_len = self.config.max_model_len
        running = RequestStatus.RUNNING
        for request_id in out.num_scheduled_tokens:
            if request_id not in sampling_req_ids:
                continue  # a prefill chunk that stops short samples nothing
            request = requests.get(request_id)
            token = sampled.get(request_id)
            if request is None or token is None:
                continue  # aborted meanwhile
            was_running = request.status == running
            had_placeholder = request.num_output_placeholders > 0
            if had_placeholder:
                request.num_output_placeholders -= 1
            all_token_ids = request.all_token_ids
            all_token_ids.append(token)
            num_tokens = len(all_token_ids)
            # Request.append_output_token_ids, called only when a block became full.
            if (len(request.block_hashes) + 1) * request.block_size <= num_tokens:
                request.update_block_hashes()
            request.num_tokens_sent += 1  # the workers sampled it: they know it already
            if had_placeholder and was_running:
                # The steps still in flight (one placeholder each) are not computed yet.
                num_done = request.num_computed_tokens - request.num_output_placeholders
                # cache_blocks would return at once when no block became full.
                if num_done // block_size > num_cached_block.get(request_id, 0):
                    manager.cache_blocks(request, num_done)
            # Does the token just appended stop it? vLLM's order: EOS and stop tokens first.
            # min_tokens is the sampler's job (the worker masks EOS and stop tokens until then),
            # so the ledger never second-guesses a token. Written out, not called: once per
            # request per step.
            if token == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
            elif token in request.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
            elif (
                num_tokens >= max_model_len
                or num_tokens - request.num_prompt_tokens >= request.max_tokens
            ):
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            else:
                updates.append(RequestUpdate(request, (token,), False))
                continue
            if was_running:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._free_request(request)
            updates.append(
                RequestUpdate(request, (token,), True, RequestStatus.finish_reason(request.status))
            )
        if self.connector is not None:
            if shared_failed or shared_unreachable:
                # Before the CPU tier's reports: a promotion reported now is loadable next step.
                self.connector.update_shared_output(shared_failed or {}, shared_unreachable or ())
            self._transfers_done(transfers_done)
        return updates

    def _transfers_done(self, job_ids: Iterable[int]) -> None:
        """The CPU tier's copies every worker finished (after the step's tokens, as vLLM's
        update_from_output): the connector's books, and loaded requests ready to be admitted."""
        assert self.connector is not None
        done = list(job_ids)
        if not done:
            return
        self.connector.update_connector_output(dict.fromkeys(done, 1))
        for job_id in done:
            req_id = self.load_jobs.pop(job_id, None)
            request = self.requests.get(req_id) if req_id is not None else None
            if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.loaded.add(request.request_id)

    def _free_request(self, request: Request[P]) -> None:
        if self.connector is not None:
            # Before the blocks are freed (the tier never holds them back: stores that still
            # read them are flushed when they are handed out again).
            self.connector.request_finished(request)
            self.loading.pop(request.request_id, None)
            self.loaded.discard(request.request_id)
            self.holding.pop(request.request_id, None)
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    # ---------------------------------------------------------------- state

    def preempt_all(self, reason: str) -> list[Preemption]:
        """Preempt every running request (a worker was lost: its KV data is gone)."""
        out: SchedulerOutput[P] = SchedulerOutput(step_id=self.step_id)
        for request in reversed(list(self.running)):
            self.running.remove(request)
            self._preempt(request, caused_by=request, out=out)
        for preemption in out.preemptions:
            preemption.reason = reason
        return out.preemptions

    def forget_tier(self) -> list[AnyKVCacheEvent]:
        """The workers' CPU tier is gone (a worker restarted, or its data can no longer be
        trusted): requests waiting for a load give their blocks back and start over, and the
        tier's books are emptied. Returns the events that say so (BlockRemoved, medium CPU, of
        every block it held). Call after `preempt_all`, before the GPU cache is reset."""
        if self.connector is None:
            return []
        for request in self.holding.values():
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.status = (
                RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
            )
        self.load_jobs.clear()
        self.loaded.clear()
        self.loading.clear()
        self.holding.clear()
        return self.connector.forget()

    def take_events(self) -> list[AnyKVCacheEvent]:
        """The KV events since the last call: the GPU pool's, then the CPU tier's (vLLM's
        order)."""
        events = self.kv_cache_manager.take_events()
        if self.connector is not None:
            events.extend(self.connector.take_events())
        return events

    def has_requests(self) -> bool:
        """Whether a step is due: unfinished requests, or (with the CPU tier) finished ones whose
        last blocks the next step offers to it."""
        return self.has_unfinished_requests() or (
            self.connector is not None
            and (bool(self.finished_req_ids) or self.connector.has_queued_work())
        )

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def queued_prefill_tokens(
        self, expected_hits: Callable[[Request[P]], int] | None = None
    ) -> int:
        """Tokens still to prefill before a request arriving now is admitted, at most: every
        waiting request's uncomputed tokens (less the prefix `expected_hits` says it will find
        cached, when the caller knows) and what running requests have left of their prompt.
        O(requests): for a status write, not for every step."""
        total = 0
        for request in self.waiting:
            done = request.num_computed_tokens
            if expected_hits is not None:
                done = max(done, expected_hits(request))
            total += max(request.num_tokens - done, 0)
        for request in self.running:
            total += max(request.num_tokens - request.num_computed_tokens - 1, 0)
        return total

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(len(self.waiting))


__all__ = [
    "Admission",
    "CachedRequestData",
    "NewRequestData",
    "Preemption",
    "RequestUpdate",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "WaitingHeld",
    "WaitingQueue",
]
