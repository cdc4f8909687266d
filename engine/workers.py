"""The worker group as the ledger sees it: sizing the pool from the workers' reports, and telling
a lost or restarted worker from a heartbeat. Pure: the service reads the registry keys."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ledger.capacity import BlockCost, capacity_line, check_enough_blocks
from ledger.offloading.base import num_cpu_chunks
from services.config import OffloadingConfig
from services.startup import StartupError
from services.wire.messages import WorkerHello


@dataclass(frozen=True, slots=True)
class PoolPlan:
    num_gpu_blocks: int
    vocab_size: int
    model_name: str
    capacity_line: str
    profile: str  # the smallest worker's memory profile, for the start-up log
    bytes_per_block: int = 0  # one worker's share of a block (a rank's, under TP)
    world_size: int = 1  # workers that each hold a share of every block (the TP size)


def plan_pool(
    hellos: list[WorkerHello],
    block_size: int,
    max_model_len: int,
    num_gpu_blocks_override: int | None,
) -> PoolPlan:
    """The smallest report in the group sizes the pool (as vLLM takes the minimum over TP ranks);
    refuse, with vLLM's message, when one max_model_len request cannot fit."""
    for hello in hellos:
        if hello.block_size != block_size:
            raise StartupError(
                f"worker {hello.worker_id} uses block_size {hello.block_size} but the ledger uses "
                f"{block_size}: set KVLEDGER_BLOCK_SIZE the same for every service"
            )
    smallest = min(hellos, key=lambda h: h.num_gpu_blocks)
    num_blocks = num_gpu_blocks_override or smallest.num_gpu_blocks
    if num_blocks > smallest.num_gpu_blocks:
        raise StartupError(
            f"num_gpu_blocks_override={num_blocks} exceeds what worker {smallest.worker_id} holds "
            f"({smallest.num_gpu_blocks} blocks): the override cannot create memory"
        )
    try:
        check_enough_blocks(
            num_blocks, BlockCost(smallest.bytes_per_block, block_size), max_model_len
        )
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    device = "GPU" if smallest.device.startswith("cuda") else smallest.device.upper()
    line = capacity_line(num_blocks, block_size, max_model_len, device)
    if smallest.tp_size > 1:  # each rank holds its heads' share of every block
        line += (
            f" (tensor parallel {smallest.tp_size}: {smallest.bytes_per_block:,} bytes per "
            f"block per rank)"
        )
    return PoolPlan(
        num_gpu_blocks=num_blocks,
        vocab_size=min(h.vocab_size for h in hellos),
        model_name=smallest.model_name,
        capacity_line=line,
        profile=smallest.detail,
        bytes_per_block=smallest.bytes_per_block,
        world_size=smallest.tp_size,
    )


def plan_cpu_tier(offloading: OffloadingConfig, plan: PoolPlan, block_size: int) -> tuple[int, str]:
    """How many blocks the CPU tier holds (vLLM's count: --kv-offloading-size over one block of
    every worker, padded to whole pages) and the line that says so; refused when not one."""
    chunks = num_cpu_chunks(offloading.cpu_bytes_to_use, plan.bytes_per_block, plan.world_size)
    gib = offloading.cpu_bytes_to_use / 2**30
    if chunks < 1:
        raise StartupError(
            f"the CPU tier of {gib:g} GiB (--kv-offloading-size or cpu_bytes_to_use) holds no "
            f"block of {plan.bytes_per_block * plan.world_size:,} bytes: give it more"
        )
    line = (
        f"CPU tier ({offloading.eviction_policy}): {chunks:,} blocks, {chunks * block_size:,} "
        f"tokens, {gib:g} GiB"
    )
    return chunks, line


def tier_load_costs(workers: Iterable[WorkerHello]) -> dict[str, float]:
    """Seconds to load one block from each tier the workers measured: the slowest worker's (a
    step waits for every worker's copies)."""
    costs: dict[str, float] = {}
    for hello in workers:
        for tier, seconds in (hello.load_s_per_block or {}).items():
            costs[tier] = max(costs.get(tier, 0.0), seconds)
    return costs


def group_view(live: dict[str, WorkerHello]) -> dict[str, WorkerHello]:
    """The workers the ledger may send steps to. Replicated workers (tp_size 1) each count
    alone; a tensor-parallel group counts only whole: its newest worker of every rank 0..N-1
    (a restarted rank's old key lingers until its TTL), or nobody while a rank is missing."""
    size = max((h.tp_size for h in live.values()), default=1)
    if size == 1:
        return live
    newest: dict[int, WorkerHello] = {}
    for hello in live.values():
        if hello.tp_size == size and (
            hello.tp_rank not in newest or hello.started_at > newest[hello.tp_rank].started_at
        ):
            newest[hello.tp_rank] = hello
    if set(newest) != set(range(size)):
        return {}
    return {h.worker_id: h for h in newest.values()}


def primary_worker(workers: dict[str, WorkerHello]) -> str:
    """Whose sampled tokens the ledger takes: rank 0 of a tensor-parallel group (the others'
    results only acknowledge the step), else the first worker id."""
    return min(workers, key=lambda w: (workers[w].tp_rank, w))


def membership_changes(
    known: dict[str, WorkerHello], live: dict[str, WorkerHello], num_gpu_blocks: int
) -> tuple[list[str], list[str]]:
    """(lost, joined): workers whose key vanished or who restarted (a new `started_at`), and new
    workers big enough to hold the pool. Either means the workers' KV data no longer agrees."""
    lost = sorted(
        w for w, hello in known.items() if w not in live or live[w].started_at != hello.started_at
    )
    joined = sorted(
        w for w, hello in live.items() if w not in known and hello.num_gpu_blocks >= num_gpu_blocks
    )
    return lost, joined
