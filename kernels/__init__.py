"""Paged attention and the paged cache write, for the worker.

A worker picks its backend once, at start-up, with `select_backend(AttentionSpec(...), requested)`:
the CUDA kernels of `kernels/csrc` (built once by nvcc, cached on disk) on a CUDA device for the
shapes and dtypes they are instantiated for, the pure-torch `kernels.reference` on the CPU or
when asked for; anything else fails with `BackendError` instead of falling back silently. Each
step then builds one `AttentionPlan` (`backend.plan(...)`) that every layer uses, and the worker
runs its model through `backend.execute` (CUDA graphs for decode steps on a GPU). Caches are
allocated with `kv_cache_shape` (HND).

This package stands alone: it imports torch and nothing of kvledger's services.
"""

from __future__ import annotations

from kernels.backend import (
    BACKEND_CHOICES,
    AttentionBackend,
    AttentionPlan,
    AttentionSpec,
    BackendError,
    KVCache,
    TorchReference,
    kv_cache_shape,
)
from kernels.cuda_backend import CudaKernels
from kernels.select import cuda_unsupported, select_backend

__all__ = [
    "BACKEND_CHOICES",
    "AttentionBackend",
    "AttentionPlan",
    "AttentionSpec",
    "BackendError",
    "CudaKernels",
    "KVCache",
    "TorchReference",
    "cuda_unsupported",
    "kv_cache_shape",
    "select_backend",
]
