"""What every checkpoint loader shares (Hugging Face folders in `gpu_worker.checkpoint`, GGUF
files in `gpu_worker.gguf_checkpoint`): the serving dtypes and the error a loader raises."""

from __future__ import annotations

import torch

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


class CheckpointError(ValueError):
    """A checkpoint folder kvledger cannot load; the text says what to fix."""


def resolve_dtype(
    requested: str | torch.dtype | None, checkpoint_dtype: str, device: str | torch.device
) -> torch.dtype:
    if isinstance(requested, torch.dtype):
        return requested
    if requested in (None, "auto"):
        chosen = DTYPES.get(checkpoint_dtype, torch.float32)
        if torch.device(device).type == "cpu":
            # CPU float16 matmuls are slow or missing; float32 keeps the values exactly.
            return torch.float32 if chosen == torch.float16 else chosen
        # vLLM's rule on a GPU: float32 checkpoints are served in bfloat16 (the CUDA kernels'
        # dtypes); --dtype float32 still asks for float32 (with --kernels reference).
        return torch.bfloat16 if chosen == torch.float32 else chosen
    if requested not in DTYPES:
        raise CheckpointError(f"dtype {requested!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[requested]
