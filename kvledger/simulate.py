"""Drive the real ledger on replayable workloads, without workers or Redis.

Three allocators on the blog's workload (`../shared/seeds/004_*.txt`):
- `contiguous`: every request reserves max_model_len slots up front (first-fit intervals);
- `blog`: the blog's admission and preemption rules, taking blocks from our BlockPool
  (at most one admission per step, prefill in one go, one decode token per step, preempt the
  request that cannot grow); it must reproduce the blog's tables exactly;
- `vllm`: our Scheduler and KVCacheManager (one token budget, chunked prefill, preemption from
  the tail of `running`, the admission gate, prefix caching).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from kvledger.workloads import SimRequest, synthetic_token
from ledger.block_pool import BlockPool
from ledger.capacity import cdiv
from ledger.hashing import BlockHasher
from ledger.kv_cache_manager import KVCacheManager
from ledger.request import Request
from ledger.scheduler import Scheduler, SchedulerConfig

BLOG_POOL_TOKENS = 100_000
BLOG_MAX_MODEL_LEN = 4096

Progress = Callable[[str, int, int], None]  # (label, finished, total)


@dataclass(slots=True)
class SimResult:
    allocator: str
    block_size: int
    watermark: float
    steps: int
    done: int
    peak_concurrency: int
    preemptions: int = 0
    peak_blocks_used: int = 0
    total_blocks: int = 0
    avg_wait_steps: float = 0.0
    internal_waste_tokens: int = 0
    internal_waste_pct: float = 0.0
    # The vllm policy only:
    prefix_caching: bool = False
    prefill_tokens_computed: int = 0
    prefix_hit_tokens: int = 0
    blocks_allocated: int = 0
    blocks_evicted: int = 0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def _waste_pct(waste: int, lengths: Sequence[tuple[int, int]], done: int) -> float:
    # The blog divides by the tokens of the first `done` requests (all of them when all finish).
    stored = sum(p + o for p, o in lengths[:done])
    return round(100 * waste / max(stored, 1), 2)


def run_contiguous(
    lengths: Sequence[tuple[int, int]],
    pool_tokens: int = BLOG_POOL_TOKENS,
    max_len: int = BLOG_MAX_MODEL_LEN,
) -> SimResult:
    """Reserve max_len slots per request on arrival; release them in one piece at the end."""
    free: list[tuple[int, int]] = [(0, pool_tokens)]  # sorted (start, length) intervals

    def alloc() -> int | None:
        for i, (start, length) in enumerate(free):
            if length >= max_len:
                if length == max_len:
                    free.pop(i)
                else:
                    free[i] = (start + max_len, length - max_len)
                return start
        return None

    def release(start: int) -> None:
        free.append((start, max_len))
        free.sort()
        merged: list[tuple[int, int]] = []
        for s, n in free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        free[:] = merged

    waiting = deque(lengths)
    running: list[list[int]] = []  # [start, output_len, generated, steps_in_service]
    waits: list[int] = []
    peak = steps = 0
    while waiting or running:
        steps += 1
        if waiting:
            start = alloc()
            if start is not None:
                _, output = waiting.popleft()
                running.append([start, output, 0, 0])
        still = []
        for r in running:
            r[2] += 1
            if r[2] >= r[1]:
                release(r[0])
                waits.append(r[3])
            else:
                still.append(r)
        running = still
        for r in running:
            r[3] += 1
        peak = max(peak, len(running))
    return SimResult(
        allocator="contiguous",
        block_size=max_len,
        watermark=0.0,
        steps=steps,
        done=len(waits),
        peak_concurrency=peak,
        avg_wait_steps=round(sum(waits) / max(len(waits), 1), 1),
    )


def run_blog_paged(
    lengths: Sequence[tuple[int, int]],
    block_size: int = 16,
    watermark: float = 0.0,
    pool_tokens: int = BLOG_POOL_TOKENS,
) -> SimResult:
    """The blog's paged rules, with every block taken from and returned to a real BlockPool."""
    num_blocks = pool_tokens // block_size
    pool = BlockPool(num_blocks + 1, enable_caching=False)  # +1: our block 0 is the null block
    reserve = int(watermark * num_blocks)
    waiting: deque[list] = deque([p, o, 0] for p, o in lengths)  # [prompt, output, wait]
    running: list[list] = []  # [prompt, output, stored, blocks, wait]
    preemptions = peak = peak_used = waste = steps = 0
    waits: list[int] = []
    while waiting or running:
        steps += 1
        if waiting:
            prompt = waiting[0][0]
            need = cdiv(prompt, block_size)
            if pool.get_num_free_blocks() - need >= reserve:
                p, o, wait = waiting.popleft()
                running.append([p, o, p, pool.get_new_blocks(need), wait])
        still = []
        for r in running:
            r[2] += 1
            if r[2] % block_size == 1 and r[2] > r[0]:
                if pool.get_num_free_blocks() >= 1:
                    r[3].extend(pool.get_new_blocks(1))
                else:  # preempt by recompute: return every block, requeue at the front
                    pool.free_blocks(reversed(r[3]))
                    preemptions += 1
                    waiting.appendleft([r[0], r[1], r[4] + 1])
                    continue
            still.append(r)
        running = []
        for r in still:
            if r[2] - r[0] >= r[1]:
                waste += (block_size - r[2] % block_size) % block_size
                pool.free_blocks(reversed(r[3]))
                waits.append(r[4])
            else:
                running.append(r)
        for r in running:
            r[4] += 1
        peak = max(peak, len(running))
        peak_used = max(peak_used, num_blocks - pool.get_num_free_blocks())
    return SimResult(
        allocator=f"paged-b{block_size}",
        block_size=block_size,
        watermark=watermark,
        steps=steps,
        done=len(waits),
        peak_concurrency=peak,
        preemptions=preemptions,
        peak_blocks_used=peak_used,
        total_blocks=num_blocks,
        avg_wait_steps=round(sum(waits) / max(len(waits), 1), 1),
        internal_waste_tokens=waste,
        internal_waste_pct=_waste_pct(waste, lengths, len(waits)),
    )


def run_vllm(
    workload: Sequence[SimRequest],
    block_size: int = 16,
    watermark: float = 0.0,
    pool_tokens: int = BLOG_POOL_TOKENS,
    max_model_len: int = BLOG_MAX_MODEL_LEN,
    enable_caching: bool = True,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    hash_algo: str = "sha256",
    progress: Progress | None = None,
    label: str = "vllm",
) -> SimResult:
    """Our scheduler on the workload; every request arrives at step 0, 'sampling' is synthetic."""
    num_blocks = pool_tokens // block_size
    manager = KVCacheManager(
        num_blocks + 1,
        block_size,
        max_model_len,
        enable_caching=enable_caching,
        watermark=watermark,
        record_evictions=True,
    )
    scheduler: Scheduler[None] = Scheduler(
        SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        ),
        manager,
    )
    hasher = BlockHasher(hash_algo, seed="kvledger-sim") if enable_caching else None
    index_of: dict[str, int] = {}
    for i, sim in enumerate(workload):
        index_of[sim.request_id] = i
        scheduler.add_request(
            Request(
                sim.request_id,
                sim.prompt_token_ids,
                sim.max_tokens,
                arrival_time=float(i),
                block_hasher=hasher,
                block_size=block_size,
            )
        )
    total = len(workload)
    admitted_at: dict[str, int] = {}
    waits: list[int] = []
    steps = peak = peak_used = waste = done = 0
    prefill_tokens = allocated = evicted = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        steps += 1
        if out.is_empty:
            raise RuntimeError(f"{label}: the scheduler made no progress at step {steps}")
        for admission in out.admissions:
            admitted_at.setdefault(admission.request_id, steps)
            allocated += admission.num_new_blocks
        for cached in out.scheduled_cached_reqs:
            allocated += len(cached.new_block_ids)
        evicted += sum(len(e) for e in out.evictions.values())
        for new in out.scheduled_new_reqs:
            prefill_tokens += out.num_scheduled_tokens[new.request.request_id]
        for cached in out.scheduled_cached_reqs:
            request = cached.request
            if cached.num_computed_tokens < request.num_prompt_tokens:  # a later prefill chunk
                prefill_tokens += out.num_scheduled_tokens[request.request_id]
        peak = max(peak, scheduler.num_running)
        peak_used = max(peak_used, num_blocks - manager.num_free_blocks)
        sampled = {
            request_id: synthetic_token(
                index_of[request_id], scheduler.requests[request_id].num_tokens
            )
            for request_id in out.num_scheduled_tokens
        }
        for update in scheduler.update_from_output(out, sampled):
            if update.finished:
                done += 1
                request = update.request
                slots = request.num_tokens - 1  # the last sampled token is never computed
                waste += cdiv(slots, block_size) * block_size - slots
                waits.append(admitted_at[request.request_id])
        if progress is not None and steps % 200 == 0:
            progress(label, done, total)
    if progress is not None:
        progress(label, done, total)
    stats = manager.prefix_cache_stats
    stored = sum(sim.prompt_len + sim.max_tokens for sim in workload)
    return SimResult(
        allocator=label,
        block_size=block_size,
        watermark=watermark,
        steps=steps,
        done=done,
        peak_concurrency=peak,
        preemptions=scheduler.num_preemptions,
        peak_blocks_used=peak_used,
        total_blocks=num_blocks,
        avg_wait_steps=round(sum(waits) / max(len(waits), 1), 1),
        internal_waste_tokens=waste,
        internal_waste_pct=round(100 * waste / max(stored, 1), 2),
        prefix_caching=enable_caching,
        prefill_tokens_computed=prefill_tokens,
        prefix_hit_tokens=stats.hits + stats.preempted_hits,
        blocks_allocated=allocated,
        blocks_evicted=evicted,
    )


def prefix_granularity(prefix_len: int, block_size: int) -> tuple[int, int, float]:
    """Only full blocks are cached: (cached tokens, lost tokens, lost %)."""
    cached = prefix_len // block_size * block_size
    lost = prefix_len - cached
    return cached, lost, round(100 * lost / prefix_len, 2)
