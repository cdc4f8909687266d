"""Which attention backend a worker runs, decided once at start-up: the CUDA kernels of
`kernels/csrc` when the device is CUDA, the model's shape and dtype are ones they are
instantiated for and the library builds (or a prebuilt one loads); the torch reference on the
CPU, or anywhere when asked for by name. Anything else is a `BackendError` that says what to
change; nothing falls back silently.
"""

from __future__ import annotations

import torch

from kernels.backend import (
    BACKEND_CHOICES,
    AttentionBackend,
    AttentionSpec,
    BackendError,
    TorchReference,
)
from kernels.cuda_backend import CudaKernels
from kernels.library import BLOCK_SIZES, DTYPE_CODES, HEAD_DIMS, MAX_GROUP


def cuda_unsupported(spec: AttentionSpec) -> list[str]:
    """Why the CUDA kernels do not cover `spec` (empty when they do)."""
    reasons = []
    if spec.dtype not in DTYPE_CODES:
        reasons.append(f"dtype {_dtype_name(spec.dtype)} (they run float16 and bfloat16)")
    if spec.head_dim not in HEAD_DIMS:
        reasons.append(f"head_dim {spec.head_dim} (they are built for {_names(HEAD_DIMS)})")
    if spec.block_size not in BLOCK_SIZES:
        reasons.append(f"block_size {spec.block_size} (they are built for {_names(BLOCK_SIZES)})")
    if spec.num_heads % spec.num_kv_heads or spec.num_heads // spec.num_kv_heads > MAX_GROUP:
        reasons.append(
            f"{spec.num_heads} query heads over {spec.num_kv_heads} KV heads (a GQA group of at "
            f"most {MAX_GROUP} query heads per KV head)"
        )
    return reasons


def select_backend(spec: AttentionSpec, requested: str = "auto") -> AttentionBackend:
    """The backend for a worker with this model on this device; raises BackendError when the
    one it needs cannot run (`requested`: auto, cuda or reference)."""
    if requested not in BACKEND_CHOICES:
        raise BackendError(
            f"attention backend {requested!r} is not one of {', '.join(BACKEND_CHOICES)}"
        )
    if requested == "reference" or (requested == "auto" and spec.device.type != "cuda"):
        return TorchReference()
    if spec.device.type != "cuda":
        raise BackendError(
            f"the CUDA kernels need a CUDA device, and this worker runs on {spec.device}: use "
            "--device cuda on a GPU, or --kernels reference (KVLEDGER_KERNELS=reference)"
        )
    reasons = cuda_unsupported(spec)
    if reasons:
        raise BackendError(
            f"the CUDA kernels do not cover this model: {'; '.join(reasons)}. Serve it in "
            "float16/bfloat16 (--dtype), or run the torch reference, much slower, with "
            "--kernels reference (KVLEDGER_KERNELS=reference)"
        )
    try:
        return CudaKernels(spec.device)
    except (OSError, RuntimeError) as exc:
        raise BackendError(
            f"the CUDA kernels could not be built or loaded: {exc}. Put nvcc (CUDA 12 or newer) "
            "on PATH or in KVLEDGER_NVCC, or give a prebuilt library in KVLEDGER_KERNEL_LIB; "
            "--kernels reference (KVLEDGER_KERNELS=reference) runs the torch reference instead"
        ) from exc


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _names(values: tuple[int, ...]) -> str:
    return " and ".join(str(v) for v in values)
