"""The shared tier's namespace: one id for everything that makes two replicas' KV interchangeable.

A block's key in the tier is its block hash, which already binds the tokens, the parent
blocks, the extra keys and (through block 0) the cache_salt, under the hash algorithm and its
seed. What the hash does not bind, the namespace does: the model's identity (its name and a
digest of its weights' files, or the tiny model's seed), the KV's dtype and layout (layers,
KV heads, head size), the tensor-parallel layout (each rank holds its own slice), the block size
and the hash settings themselves. Replicas whose namespaces differ never read each other's
blocks; a format change of kvledger's own bumps FORMAT_VERSION.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

FORMAT_VERSION = 1
NAMESPACE_HEX = 16


def namespace_fields(
    kv_identity: Mapping[str, Any], hash_algo: str, none_hash: bytes, block_size: int
) -> dict[str, Any]:
    """Every field the namespace binds: the workers' KV identity and the ledger's hash settings
    (NONE_HASH stands for the algorithm's seed: PYTHONHASHSEED or vLLM's default)."""
    return {
        "format": FORMAT_VERSION,
        **dict(kv_identity),
        "block_size": block_size,
        "hash_algo": hash_algo,
        "none_hash": none_hash.hex(),
    }


def namespace_id(fields: Mapping[str, Any]) -> str:
    canonical = json.dumps(dict(fields), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:NAMESPACE_HEX]
