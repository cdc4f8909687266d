"""What makes this worker's KV blocks interchangeable with another's (the shared tier's namespace,
`services.tiers.namespace`, adds the ledger's hash settings): the model's identity, the KV
cache's dtype and layout, and the tensor-parallel layout.

The model's identity is a digest of its files, cheap enough for start-up on any size: each
weights file's name and size, its first and last MiB, and 32 windows of 64 KiB spread evenly
between them (3 MiB read a file, whatever its size), and the config it was read with; the tiny
model's is its seed. A re-quantized file differs in its header or size; a fine-tuned one, or
one with a LoRA merged into its attention projections (a third of a Llama's weights), differs
in nearly every window: the chance that all 32 miss such a change is about (2/3)^32, 2e-6.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from services.environment import env
from services.tokenization.model_source import resolve_model

SAMPLE_BYTES = 1 << 20
WINDOWS, WINDOW_BYTES = 32, 64 << 10


def file_digest(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}\n".encode())
        with path.open("rb") as f:
            digest.update(f.read(SAMPLE_BYTES))
            if size > 2 * SAMPLE_BYTES:
                middle = size - 2 * SAMPLE_BYTES
                for window in range(WINDOWS):
                    f.seek(SAMPLE_BYTES + middle * window // WINDOWS)
                    digest.update(f.read(min(WINDOW_BYTES, middle)))
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
