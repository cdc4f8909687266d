"""Prefix-cache block hashes, exactly as vLLM 0.33 computes them.

Each full block hashes `(parent_hash or NONE_HASH, tuple(block_tokens), extra_keys)` with one of
vLLM's four functions. NONE_HASH is the hash of a seed: `PYTHONHASHSEED` when set, otherwise
"vllm-none-hash" for the sha256 kinds and random bytes per process for the xxhash kinds (their
seed must stay secret because they are not collision resistant). A router that knows the seed
can hash a prompt itself and find the blocks; `kvledger hash` prints them.
"""

from __future__ import annotations

import hashlib
import os
import pickle  # vLLM's "sha256" and "xxhash" hash the pickle of the tuple; nothing is unpickled
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cbor2
import xxhash as _xxhash

from ledger.block import BlockHash

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash(obj: Any) -> bytes:
    return _xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor(obj: Any) -> bytes:
    return _xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash,
    "xxhash_cbor": xxhash_cbor,
}


def get_hash_fn(algo: str) -> Callable[[Any], bytes]:
    try:
        return HASH_FUNCTIONS[algo]
    except KeyError:
        raise ValueError(
            f"Unsupported hash algorithm {algo!r}: choose one of {', '.join(HASH_ALGOS)}"
        ) from None


def resolve_none_hash_seed(algo: str, environ: Mapping[str, str] = os.environ) -> str:
    seed = environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if algo.startswith("xxhash"):
        return os.urandom(32).hex()
    return DEFAULT_NONE_HASH_SEED


def to_event_hash(block_hash: BlockHash) -> int:
    """The hash as KV events publish it: the last 8 bytes of the digest, big-endian, unsigned."""
    return int.from_bytes(block_hash[-8:], "big")


def block_extra_keys(
    block_index: int, cache_salt: str | None, lora: tuple[str, str] | None
) -> tuple[Any, ...] | None:
    """The tagged extra keys of one block: LoRA first, then the cache salt (block 0 only)."""
    keys: list[tuple[Any, ...]] = []
    if lora is not None:
        keys.append(("lora", lora[0], lora[1]))
    if cache_salt and block_index == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def to_event_extra_keys(extra_keys: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """Events publish extra keys untagged: the LoRA name and the salt themselves."""
    if extra_keys is None:
        return None
    return tuple(key[1] for key in extra_keys)


class BlockHasher:
    """One process's hashing configuration: the algorithm and its NONE_HASH."""

    def __init__(self, algo: str = "sha256", seed: str | None = None) -> None:
        self.algo = algo
        self.hash_fn = get_hash_fn(algo)
        self.seed = seed if seed is not None else resolve_none_hash_seed(algo)
        self.none_hash: BlockHash = self.hash_fn(self.seed)

    def hash_block(
        self,
        parent: BlockHash | None,
        token_ids: Sequence[int],
        extra_keys: tuple[Any, ...] | None = None,
    ) -> BlockHash:
        return self.hash_fn((parent or self.none_hash, tuple(token_ids), extra_keys))

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        start_block: int = 0,
        parent: BlockHash | None = None,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> list[BlockHash]:
        """Hashes of the full blocks from `start_block` on, chained from `parent`."""
        hashes: list[BlockHash] = []
        for index in range(start_block, len(token_ids) // block_size):
            tokens = token_ids[index * block_size : (index + 1) * block_size]
            parent = self.hash_block(parent, tokens, block_extra_keys(index, cache_salt, lora))
            hashes.append(parent)
        return hashes


MAX_CACHE_SALT_LENGTH = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def cache_salt_problem(value: object) -> str | None:
    """Why `value` cannot be a request's cache_salt (None: it can, or it is absent). The one
    rule for everything that takes a salt (the gateway's requests, the indexer's /score): a
    non-empty string of at most 128 characters, without '@', '/', '\\' or NUL (they delimit
    the keys and topics a salt may end up in)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        return "'cache_salt' must be a non-empty string"
    if len(value) > MAX_CACHE_SALT_LENGTH or any(c in _CACHE_SALT_FORBIDDEN for c in value):
        return (
            f"'cache_salt' must be at most {MAX_CACHE_SALT_LENGTH} characters and must not "
            "contain '@', '/', '\\\\' or NUL"
        )
    return None
