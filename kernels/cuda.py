"""The CUDA path of a step: its work list (planned once on the device, used by every layer) and
the one launch per layer over it. No host sync anywhere: the grid and the buffers are sized
from what the host already knows (token and sequence counts, the query-length hint).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import build
from kernels.library import (
    CUDA_CORES,
    SIMT_ROWS,
    TC_ROWS,
    TENSOR_CORES,
    WORK_ITEM_INTS,
    KernelLibrary,
    int32,
    rows_of_16_bytes,
)
from kernels.reference import cdiv

# Extra items the planner may spend on splitting long contexts, in GPU-fulls of CTAs.
SPLIT_BUDGET_WAVES = 2


@dataclass(frozen=True, slots=True)
class WorkList:
    """One step's work list and its scratch: every layer of the step launches over it."""

    kernel: int  # TENSOR_CORES or CUDA_CORES
    q_tile: int  # query tokens per tile
    slot_rows: int  # rows of one partial slot
    max_slots: int
    tiles: torch.Tensor  # [max_tiles, 4] int32: the planner's scratch
    items: torch.Tensor  # [max_items, WORK_ITEM_INTS] int32
    num_items: torch.Tensor  # [1] int32
    counters: torch.Tensor  # [max_tiles * num_kv_heads] int32, zero between launches
    partial_out: torch.Tensor  # [max_slots * num_kv_heads * slot_rows * head_dim] float32
    partial_ml: torch.Tensor  # [max_slots * num_kv_heads * slot_rows, 2] float32


def choose_kernel(group: int, max_query_len: int) -> tuple[int, int]:
    """(kernel, query tokens per tile): CUDA cores for MHA decodes and short extends, whose one
    row per token would fill 1/16 of an mma tile; tensor cores for everything else."""
    if group == 1 and max_query_len <= SIMT_ROWS:
        return CUDA_CORES, SIMT_ROWS
    return TENSOR_CORES, max(1, TC_ROWS // group)


def plan_work(
    library: KernelLibrary,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
    max_query_len: int,
    num_sms: int,
    stream: int,
) -> WorkList:
    """Allocates the step's work list and launches the planner into it (no sync).

    `max_query_len` must bound every sequence's query length from above; it only picks the
    kernel and sizes the partial slots (a tile with more rows than a slot is never split).
    """
    group = num_heads // num_kv_heads
    kernel, q_tile = choose_kernel(group, max_query_len)
    slot_rows = min(q_tile, max(1, max_query_len)) * group
    num_seqs = seq_lens.numel()
    # Each tile holds at least one token, and all but each sequence's last are full.
    max_tiles = max(1, min(num_tokens, num_tokens // q_tile + num_seqs))
    cta_slots = num_sms * library.ctas_per_sm(kernel, dtype, head_dim, block_size)
    split_items = cdiv(SPLIT_BUDGET_WAVES * cta_slots, num_kv_heads)
    max_items = max_tiles + split_items
    max_slots = 2 * split_items  # a split tile has >= 2 chunks: slots <= 2 x extra items
    device = seq_lens.device
    slot_elems = max_slots * num_kv_heads * slot_rows
    work = WorkList(
        kernel=kernel,
        q_tile=q_tile,
        slot_rows=slot_rows,
        max_slots=max_slots,
        tiles=torch.empty(max_tiles, 4, dtype=torch.int32, device=device),
        items=torch.empty(max_items, WORK_ITEM_INTS, dtype=torch.int32, device=device),
        num_items=torch.empty(1, dtype=torch.int32, device=device),
        counters=torch.zeros(max_tiles * num_kv_heads, dtype=torch.int32, device=device),
        partial_out=torch.empty(slot_elems * head_dim, dtype=torch.float32, device=device),
        partial_ml=torch.empty(slot_elems, 2, dtype=torch.float32, device=device),
    )
    library.plan(
        int32(seq_lens), int32(query_start_loc), num_tokens, q_tile, group, slot_rows,
        num_kv_heads, cta_slots, max_slots, work.tiles, work.items, work.num_items, stream,
    )  # fmt: skip
    return work


def paged_attention(
    library: KernelLibrary,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    work: WorkList | None,
    stream: int,
    num_sms: int,
    max_query_len: int | None = None,
) -> tuple[torch.Tensor, WorkList | None]:
    """Causal attention of the step's queries over the HND cache, and the work list it used
    (planned here when `work` is None: pass it back for the step's next layer)."""
    query = rows_of_16_bytes(query)
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out, work
    block_tables, seq_lens = int32(block_tables), int32(seq_lens)
    query_start_loc = int32(query_start_loc)
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    if work is None:
        if max_query_len is None:
            max_query_len = num_tokens  # an upper bound the host has without a sync
        work = plan_work(
            library, seq_lens, query_start_loc, num_tokens, num_heads, num_kv_heads, head_dim,
            query.dtype, block_size, max_query_len, num_sms, stream,
        )  # fmt: skip
    library.attention(
        work.kernel, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale, work, out, stream,
    )  # fmt: skip
    return out, work


_library: KernelLibrary | None = None


def load() -> KernelLibrary:
    """Build (or find in the cache) and load the CUDA library, once per process."""
    global _library
    if _library is None:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        # A library built ahead of time (the Docker image's nvcc stage) skips the JIT build.
        prebuilt = os.environ.get(build.PREBUILT_ENV)
        _library = KernelLibrary(Path(prebuilt) if prebuilt else build.build())
    return _library
