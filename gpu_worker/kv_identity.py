"""What makes this worker's KV blocks interchangeable with another's (the shared tier's namespace,
`services.tiers.namespace`, adds the ledger's hash settings): the model's identity, the KV
cache's dtype and layout, and the tensor-parallel layout.

The model's identity is a digest of its files, cheap enough for start-up on any size: each
weights file's name and size with its first and last MiB, and the config it was read with; the
tiny model's is its seed. Two checkpoints that differ only in the middle of a file of the same
size would share a namespace; a re-quantized or fine-tuned file differs in its header or size.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from services.environment import env
from services.tokenization.model_source import resolve_model

SAMPLE_BYTES = 1 << 20


def file_digest(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}\n".encode())
        with path.open("rb") as f:
            digest.update(f.read(SAMPLE_BYTES))
            if size > 2 * SAMPLE_BYTES:
                f.seek(size - SAMPLE_BYTES)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:32]


def model_digest(model: str | Path, seed: int | None) -> str:
    source = resolve_model(model)
    if source.path is None:  # the tiny model: its weights are its seed's
        return f"tiny-seed-{seed if seed is not None else int(env('KVLEDGER_SEED', '0') or 0)}"
    if source.path.is_file():
        return file_digest([source.path])
    files = [p for p in source.path.iterdir() if p.suffix in (".safetensors", ".json")]
    return file_digest(files)


def kv_identity(
    model: str | Path,
    seed: int | None,
    kv_dtype: torch.dtype,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    tp_size: int,
) -> dict[str, Any]:
    return {
        "model": resolve_model(model).name,
        "weights": model_digest(model, seed),
        "dtype": str(kv_dtype).removeprefix("torch."),
        "layers": num_layers,
        "kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "tp_size": tp_size,
    }
