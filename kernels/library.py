"""ctypes bindings to one built library of `kernels/csrc` (the CUDA build, or the host-emulated
one the CPU tests use). Every call takes an explicit stream handle; shapes and strides are
checked here, before anything reaches the kernels.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

ABI_VERSION = 2
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (16, 32)
TENSOR_CORES, CUDA_CORES = 0, 1  # `Kernel` in csrc/paged_attention.cu
TC_ROWS = 64  # rows of a tensor-core tile (its query tokens times the GQA group)
TC_SPLIT_ROWS = 16  # tiles of at most this many rows split their keys across the CTA's warps
SIMT_ROWS = 8  # rows of a CUDA-core tile
CHUNK_ALIGN = 64  # key chunks of a work item start on multiples of this
MAX_GROUP = TC_SPLIT_ROWS  # query heads per KV head: one decode token fills at most one mma tile
WORK_ITEM_INTS = 12  # sizeof(WorkItem) / 4


def rows_of_16_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t` ([tokens, heads, dim]) with contiguous rows, 16-byte aligned: a view when it is."""
    aligned = (
        t.stride(2) == 1
        and t.stride(1) == t.shape[2]
        and t.data_ptr() % 16 == 0
        and t.stride(0) * t.element_size() % 16 == 0
    )
    return t if aligned else t.contiguous()


def int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


class KernelLibrary:
    """One loaded build of the kernels."""

    def __init__(self, path: Path) -> None:
        self._lib = ctypes.CDLL(str(path))
        self._occupancy: dict[tuple[int, ...], int] = {}
        self.emulated = hasattr(self._lib, "kvl_emu_configure")
        self._declare()
        if self._lib.kvl_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path} is ABI {self._lib.kvl_abi_version()}, not {ABI_VERSION}")
        limits = [ctypes.c_int(0) for _ in range(4)]
        self._lib.kvl_attention_limits(*[ctypes.byref(x) for x in limits])
        if [x.value for x in limits] != [TC_ROWS, TC_SPLIT_ROWS, SIMT_ROWS, CHUNK_ALIGN]:
            raise RuntimeError(f"{path} was built with other limits: {[x.value for x in limits]}")

    def _declare(self) -> None:
        i32, i64, ptr, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        lib = self._lib
        lib.kvl_abi_version.restype = i32
        lib.kvl_error_string.restype = ctypes.c_char_p
        lib.kvl_error_string.argtypes = [i32]
        lib.kvl_attention_limits.argtypes = [ctypes.POINTER(i32)] * 4
        lib.kvl_attention_ctas_per_sm.argtypes = [i32] * 4 + [ctypes.POINTER(i32)]
        lib.kvl_attention_plan.argtypes = [ptr, ptr] + [i32] * 10 + [ptr, ptr, ptr, ptr]
        attention: list[Any] = [i32] * 4 + [ptr, i64, ptr, ptr, i64, ptr, i32, ptr, ptr, ptr, ptr]
        attention += [i32, ptr, ptr, ptr, ptr] + [i32] * 7 + [f32, ptr]
        lib.kvl_paged_attention.argtypes = attention
        lib.kvl_reshape_and_cache.argtypes = [ptr] * 5 + [i64] * 4 + [i32, i32, i64, ptr]
        lib.kvl_selftest_mma.argtypes = [i32] + [ptr] * 6
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

    def ctas_per_sm(self, kernel: int, dtype: torch.dtype, head_dim: int, block_size: int) -> int:
        config = (kernel, DTYPE_CODES[dtype], head_dim, block_size)
        if config not in self._occupancy:
            ctas = ctypes.c_int(0)
            rc = self._lib.kvl_attention_ctas_per_sm(*config, ctypes.byref(ctas))
            self._check(rc, "occupancy query")
            self._occupancy[config] = max(1, ctas.value)
        return self._occupancy[config]

    def plan(
        self,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        num_tokens: int,
        q_tile: int,
        group: int,
        slot_rows: int,
        num_kv_heads: int,
        cta_slots: int,
        max_slots: int,
        tiles: torch.Tensor,
        items: torch.Tensor,
        num_items: torch.Tensor,
        stream: int,
    ) -> None:
        """Launches the planner (csrc/attention_plan.cuh) into the given buffers."""
        rc = self._lib.kvl_attention_plan(
            seq_lens.data_ptr(), query_start_loc.data_ptr(), seq_lens.numel(), num_tokens,
            q_tile, group, slot_rows, num_kv_heads, cta_slots, items.shape[0], max_slots,
            tiles.shape[0], tiles.data_ptr(), items.data_ptr(), num_items.data_ptr(), stream,
        )  # fmt: skip
        self._check(rc, "attention plan")

    def attention(
        self,
        kernel: int,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        work: Any,  # kernels.cuda.WorkList
        out: torch.Tensor,
        stream: int,
    ) -> None:
        """One launch over the step's work list; `out` gets every row (padding rows zero)."""
        num_tokens, num_heads, head_dim = query.shape
        num_blocks, num_kv_heads, block_size, _ = key_cache.shape
        rc = self._lib.kvl_paged_attention(
            kernel, DTYPE_CODES[query.dtype], head_dim, block_size, query.data_ptr(),
            query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), num_blocks,
            block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
            query_start_loc.data_ptr(), work.items.data_ptr(), work.num_items.data_ptr(),
            work.items.shape[0], out.data_ptr(), work.partial_out.data_ptr(),
            work.partial_ml.data_ptr(), work.counters.data_ptr(), work.max_slots,
            work.slot_rows, work.tiles.shape[0], seq_lens.numel(), num_tokens, num_heads,
            num_kv_heads, scale, stream,
        )  # fmt: skip
        self._check(rc, "paged_attention")

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        stream: int,
    ) -> None:
        """Writes [tokens, kv_heads, dim] K/V rows into their slots of the HND caches."""
        key, value = rows_of_16_bytes(key), rows_of_16_bytes(value)
        slots = slot_mapping.to(torch.int64).contiguous()
        num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
        head_bytes = head_dim * key.element_size()
        if (
            key.dtype != key_cache.dtype
            or head_bytes % 16
            or key.shape[1:]
            != (
                num_kv_heads,
                head_dim,
            )
        ):
            raise ValueError(
                f"K/V rows {tuple(key.shape[1:])} {key.dtype} do not fit a cache of "
                f"{num_kv_heads} heads x {head_dim} {key_cache.dtype} (rows of 16-byte multiples)"
            )
        rc = self._lib.kvl_reshape_and_cache(
            key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            slots.data_ptr(), key.shape[0], key.stride(0) * key.element_size(),
            value.stride(0) * value.element_size(), head_bytes, num_kv_heads, block_size,
            num_blocks, stream,
        )  # fmt: skip
        self._check(rc, "reshape_and_cache")

    def selftest_mma(
        self, a: torch.Tensor, b: torch.Tensor, v: torch.Tensor, stream: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(a @ b.T, a @ v) of 16x16 matrices through ldmatrix + mma.sync (csrc/selftest.cu)."""
        if not all(m.shape == (16, 16) and m.is_contiguous() for m in (a, b, v)):
            raise ValueError("selftest_mma takes three contiguous 16x16 matrices")
        c_kt = torch.empty(16, 16, dtype=torch.float32, device=a.device)
        c_v = torch.empty_like(c_kt)
        rc = self._lib.kvl_selftest_mma(
            DTYPE_CODES[a.dtype], a.data_ptr(), b.data_ptr(), v.data_ptr(), c_kt.data_ptr(),
            c_v.data_ptr(), stream,
        )  # fmt: skip
        self._check(rc, "selftest_mma")
        return c_kt, c_v
