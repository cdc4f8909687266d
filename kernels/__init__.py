"""The one API the worker calls: write K/V into the paged cache, and paged causal attention.

On a CUDA device it runs the kernels in `kernels/csrc/` (built once, cached on disk); elsewhere,
and for dtypes or shapes those kernels do not cover, it runs `kernels.reference`.
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType

import torch

from kernels import reference

__all__ = ["backend", "paged_attention", "reshape_and_cache"]

logger = logging.getLogger(__name__)

# Set to "reference" to run the torch reference even on a CUDA device (debugging, baselines).
FORCE_ENV = "KVLEDGER_KERNELS"


@functools.cache
def _cuda_module() -> ModuleType | None:
    """The loaded CUDA ops, or None when they cannot be built here (logged once)."""
    try:
        from kernels import cuda

        cuda.load()
        return cuda
    except Exception as exc:  # a GPU box without nvcc must still serve, on the reference
        logger.warning("CUDA kernels unavailable, using the torch reference: %s", exc)
        return None


def _cuda_ops(device: torch.device) -> ModuleType | None:
    if device.type != "cuda" or os.environ.get(FORCE_ENV, "").lower() == "reference":
        return None
    return _cuda_module()


def backend(device: torch.device | str) -> str:
    """What the dispatch picks for tensors on `device`: "cuda" or "torch-reference"."""
    return "cuda" if _cuda_ops(torch.device(device)) is not None else "torch-reference"


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new tokens' K/V into the paged cache in place.

    key, value: [num_tokens, num_kv_heads, head_dim]
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] (NHD layout)
    slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset; a negative slot is
    padding and is skipped.
    """
    cuda = _cuda_ops(key_cache.device)
    if cuda is not None and cuda.cache_write_supported(key, value, key_cache, value_cache):
        cuda.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    else:
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of a ragged batch of queries over the paged cache.

    Prefill, extend and decode in one call. query: [num_tokens, num_heads, head_dim], num_heads
    a multiple of num_kv_heads (GQA). block_tables: [num_seqs, max_blocks_per_seq] int32;
    seq_lens: [num_seqs] int32, the context length INCLUDING this step's new tokens (already
    written by `reshape_and_cache`); query_start_loc: [num_seqs + 1] int32, cumulative query
    lengths. The i-th of sequence s's q_len queries sits at position seq_len - q_len + i and
    attends to positions 0..that position. Returns [num_tokens, num_heads, head_dim] in
    query.dtype; rows past query_start_loc[-1] (padding) are zero. max_query_len / max_seq_len
    are optional host-side hints that let the CUDA path skip a device sync; when given they must
    be at least the true maxima (a smaller max_query_len leaves later queries uncomputed).
    """
    args = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)
    cuda = _cuda_ops(query.device)
    if cuda is not None and cuda.attention_supported(query, key_cache, value_cache):
        return cuda.paged_attention(*args, max_query_len, max_seq_len)
    return reference.paged_attention(*args, max_query_len, max_seq_len)
