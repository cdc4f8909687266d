"""Which device a worker runs on: `auto` is CUDA where torch sees one, else the CPU (the one
place this rule lives: the worker, its runner and `kvledger up` all ask here)."""

from __future__ import annotations

import torch


def resolve_device(requested: str) -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:N` as the torch device a worker uses."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)
