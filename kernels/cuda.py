"""ctypes bindings to the kernels in `kernels/csrc`, and how a batch is cut into CTAs.

`KernelLibrary` wraps one built library (the CUDA one, or the host-emulated one the CPU tests
use); `load` builds and loads the CUDA one once per process, and `routed_attention` is what the
`CudaKernels` backend runs for a step.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels import build, reference

ABI_VERSION = 1
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (16, 32)
MAX_ROWS = 8  # (query token, head) rows per CTA, kMaxRows in csrc/paged_attention.cuh
TILE_KEYS = 32  # keys per pipeline stage, kTileKeys
MAX_SPLITS = 128
# Cost model for choosing splits, in "keys one CTA streams": a CTA's fixed start-up (dependent
# loads of query_start_loc, seq_lens, the block table, filling the pipeline) and the extra
# launch of the split reduce.
CTA_OVERHEAD_KEYS = 64
REDUCE_OVERHEAD_KEYS = 128
# Sequences with at least this many new tokens are prefill: their attention is compute-bound,
# and SDPA's tensor-core kernels on K/V gathered from the pages beat this CUDA-core kernel.
PREFILL_SDPA_MIN_QUERY_LEN = 32


@dataclass(frozen=True)
class LaunchPlan:
    q_tile: int  # query tokens per CTA
    q_tiles_per_seq: int
    num_splits: int
    split_keys: int  # keys per split, a multiple of TILE_KEYS


@functools.lru_cache(maxsize=256)  # every layer of a step asks the same question
def plan_launch(
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    max_query_len: int,
    max_seq_len: int,
    num_sms: int,
    ctas_per_sm: int,
    num_splits: int | None = None,
) -> LaunchPlan:
    """Query tiles fill a CTA's rows; splits cut long contexts so every SM has work.

    The split count minimises modelled time: waves of CTAs (a partly filled last wave costs a
    whole one) times the keys each CTA streams plus its start-up, plus the reduce when split.
    """
    q_tile = 1 if max_query_len <= 1 else max(1, MAX_ROWS // group)
    q_tiles_per_seq = max(1, math.ceil(max_query_len / q_tile))
    ctas = num_seqs * q_tiles_per_seq * num_kv_heads
    max_seq_len = max(1, max_seq_len)
    if num_splits is None:
        slots = max(1, num_sms * ctas_per_sm)
        most = max(1, min(MAX_SPLITS, math.ceil(max_seq_len / TILE_KEYS)))

        def cost(splits: int) -> float:
            keys = _round_up(math.ceil(max_seq_len / splits), TILE_KEYS)
            waves = math.ceil(ctas * splits / slots)
            return waves * (keys + CTA_OVERHEAD_KEYS) + (splits > 1) * REDUCE_OVERHEAD_KEYS

        num_splits = min(range(1, most + 1), key=cost)
    num_splits = min(num_splits, MAX_SPLITS)
    split_keys = _round_up(math.ceil(max_seq_len / max(1, num_splits)), TILE_KEYS)
    num_splits = math.ceil(max_seq_len / split_keys)  # no split left without keys
    return LaunchPlan(q_tile, q_tiles_per_seq, num_splits, split_keys)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _rows_of_16_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t` ([tokens, heads, dim]) with contiguous rows, 16-byte aligned: a view when it is."""
    aligned = (
        t.stride(2) == 1
        and t.stride(1) == t.shape[2]
        and t.data_ptr() % 16 == 0
        and t.stride(0) * t.element_size() % 16 == 0
    )
    return t if aligned else t.contiguous()


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes of one token's [heads, dim] row."""
    return math.prod(t.shape[1:]) * t.element_size()


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


class KernelLibrary:
    """One loaded build of the kernels; every launch takes an explicit stream handle."""

    def __init__(self, path: Path) -> None:
        self._lib = ctypes.CDLL(str(path))
        self._occupancy: dict[tuple[int, int, int], int] = {}
        self.emulated = hasattr(self._lib, "kvl_emu_configure")
        self._declare()
        if self._lib.kvl_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path} is ABI {self._lib.kvl_abi_version()}, not {ABI_VERSION}")
        limits = [ctypes.c_int(0) for _ in range(3)]
        self._lib.kvl_attention_limits(*[ctypes.byref(x) for x in limits])
        if [x.value for x in limits] != [MAX_ROWS, TILE_KEYS, MAX_SPLITS]:
            raise RuntimeError(f"{path} was built with other limits: {[x.value for x in limits]}")

    def _declare(self) -> None:
        i32, i64, ptr, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        attention_args: list[Any] = (
            [i32, i32, i32, ptr, i64, ptr, ptr, i64, ptr, i32, ptr, ptr, ptr, ptr, ptr]
            + [i32] * 8
            + [f32, ptr]
        )
        lib = self._lib
        lib.kvl_abi_version.restype = i32
        lib.kvl_error_string.restype = ctypes.c_char_p
        lib.kvl_error_string.argtypes = [i32]
        lib.kvl_attention_ctas_per_sm.argtypes = [i32, i32, i32, ctypes.POINTER(i32)]
        lib.kvl_reshape_and_cache.argtypes = [ptr] * 5 + [i64] * 5 + [ptr]
        lib.kvl_paged_attention.argtypes = attention_args
        if self.emulated:
            lib.kvl_emu_configure.argtypes = [i32, i32, i32]

    def _check(self, rc: int, what: str) -> None:
        if rc == -1:
            raise ValueError(f"{what}: no kernel instantiated for this dtype/head_dim/block_size")
        if rc != 0:
            raise RuntimeError(f"{what} failed: {self._lib.kvl_error_string(rc).decode()}")

    def configure_emulation(
        self, reverse_order: bool = False, eager_copies: bool = False, greedy: bool = False
    ) -> None:
        """Emulated builds only: thread order and schedule, and when cp.async copies land."""
        self._lib.kvl_emu_configure(int(reverse_order), int(eager_copies), int(greedy))

    def ctas_per_sm(self, dtype: torch.dtype, head_dim: int, block_size: int) -> int:
        config = (DTYPE_CODES[dtype], head_dim, block_size)
        if config not in self._occupancy:
            ctas = ctypes.c_int(0)
            rc = self._lib.kvl_attention_ctas_per_sm(*config, ctypes.byref(ctas))
            self._check(rc, "occupancy query")
            self._occupancy[config] = max(1, ctas.value)
        return self._occupancy[config]

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        stream: int,
    ) -> None:
        key, value = _rows_of_16_bytes(key), _rows_of_16_bytes(value)
        slots = slot_mapping.to(torch.int64).contiguous()
        row_bytes = _row_bytes(key)
        rc = self._lib.kvl_reshape_and_cache(
            key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            slots.data_ptr(), key.shape[0], key.stride(0) * key.element_size(),
            value.stride(0) * value.element_size(), row_bytes,
            key_cache.shape[0] * key_cache.shape[1], stream,
        )  # fmt: skip
        self._check(rc, "reshape_and_cache")

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        max_query_len: int,
        max_seq_len: int,
        stream: int,
        num_sms: int,
        num_splits: int | None = None,
    ) -> torch.Tensor:
        """The CUDA kernel on the whole batch; hints must be upper bounds of the true maxima."""
        query = _rows_of_16_bytes(query)
        block_tables, seq_lens = _int32(block_tables), _int32(seq_lens)
        query_start_loc = _int32(query_start_loc)
        num_tokens, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, _ = key_cache.shape
        num_seqs = block_tables.shape[0]
        plan = plan_launch(
            num_seqs, num_kv_heads, num_heads // num_kv_heads, max_query_len, max_seq_len,
            num_sms, self.ctas_per_sm(query.dtype, head_dim, block_size), num_splits,
        )  # fmt: skip
        out = torch.zeros_like(query, memory_format=torch.contiguous_format)
        partial_out = partial_ml = None
        if plan.num_splits > 1:
            shape = (plan.num_splits, num_tokens, num_heads)
            partial_out = torch.empty(*shape, head_dim, dtype=torch.float32, device=query.device)
            partial_ml = torch.empty(*shape, 2, dtype=torch.float32, device=query.device)
        rc = self._lib.kvl_paged_attention(
            DTYPE_CODES[query.dtype], head_dim, block_size, query.data_ptr(), query.stride(0),
            key_cache.data_ptr(), value_cache.data_ptr(), num_blocks * block_size,
            block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
            query_start_loc.data_ptr(), out.data_ptr(),
            0 if partial_out is None else partial_out.data_ptr(),
            0 if partial_ml is None else partial_ml.data_ptr(),
            num_seqs, num_tokens, num_heads, num_kv_heads, plan.q_tile, plan.q_tiles_per_seq,
            plan.num_splits, plan.split_keys, scale, stream,
        )  # fmt: skip
        self._check(rc, "paged_attention")
        return out


# ---- the CUDA device path that `kernels` dispatches to ------------------------------------------

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


def routed_attention(
    library: KernelLibrary,
    stream: int,
    num_sms: int,
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
    """Decodes and short extends in the kernel; prefills (>= PREFILL_SDPA_MIN_QUERY_LEN new
    tokens) one SDPA call each on their gathered K/V, the rest of the batch as a sub-batch."""
    if max_query_len is None:
        max_query_len = int(query_start_loc.diff().max()) if seq_lens.numel() else 0
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if seq_lens.numel() else 0
    tables = (key_cache, value_cache)
    if max_query_len < PREFILL_SDPA_MIN_QUERY_LEN:  # the common step: no sync, one launch
        return library.paged_attention(
            query, *tables, block_tables, seq_lens, query_start_loc, scale, max_query_len,
            max_seq_len, stream, num_sms,
        )  # fmt: skip
    starts = query_start_loc.tolist()
    out = torch.zeros_like(query)
    short = []
    for seq, seq_len in enumerate(seq_lens.tolist()):
        begin, end = starts[seq], starts[seq + 1]
        if end - begin >= PREFILL_SDPA_MIN_QUERY_LEN:
            key, value = reference.gather_kv(*tables, block_tables[seq], seq_len)
            out[begin:end] = _sdpa_one_sequence(query[begin:end], key, value, scale)
        elif end > begin:
            short.append(seq)
    if short:
        q_lens = [starts[s + 1] - starts[s] for s in short]
        rows = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in short])
        rows = rows.to(query.device)
        sub_starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
        index = torch.tensor(short, device=query.device)
        sub_out = library.paged_attention(
            query.index_select(0, rows), *tables, block_tables.index_select(0, index),
            seq_lens.index_select(0, index), sub_starts.to(query.device), scale, max(q_lens),
            max_seq_len, stream, num_sms,
        )  # fmt: skip
        out.index_copy_(0, rows, sub_out)
    return out


def _sdpa_one_sequence(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Bottom-right-aligned causal SDPA: the i-th of q_len queries sees seq_len - q_len + i."""
    from torch.nn.attention.bias import causal_lower_right

    q_len, num_heads, _ = query.shape
    group = num_heads // key.shape[1]
    q = query.transpose(0, 1)[None]
    k = key.transpose(0, 1).repeat_interleave(group, dim=0)[None]
    v = value.transpose(0, 1).repeat_interleave(group, dim=0)[None]
    mask = causal_lower_right(q_len, key.shape[0])
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)
