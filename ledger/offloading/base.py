"""The vocabulary of the offloaded tiers, as vLLM 0.33's `vllm/v1/kv_offload/base.py` names it.

An offloaded block is found by its `OffloadKey`: the block hash with the KV-cache group index
appended as 4 big-endian bytes. A chunk is one slot of the tier's buffer; with the offloaded
block size equal to the GPU block size (the configuration kvledger runs) a chunk holds one block.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ledger.block import BlockHash
from ledger.events import MEDIUM_CPU

OffloadKey = bytes


# vLLM pads each chunk of its CPU buffer to whole pages (mmap.PAGESIZE, 4 KiB on x86 and most
# arm64 Linux).
PAGE_SIZE = 4096


def num_cpu_chunks(
    cpu_bytes_to_use: float, worker_kv_bytes_per_block: int, world_size: int = 1
) -> int:
    """How many blocks a CPU tier of `cpu_bytes_to_use` holds (vLLM's CPUOffloadingSpec).

    `--kv-offloading-size` GiB sets cpu_bytes_to_use = size * 2**30, summed over the workers: a
    chunk holds one block of every worker, rounded up to whole pages.
    """
    if worker_kv_bytes_per_block <= 0 or world_size <= 0:
        return 0
    bytes_per_chunk = worker_kv_bytes_per_block * world_size
    aligned = -(-bytes_per_chunk // PAGE_SIZE) * PAGE_SIZE
    return int(cpu_bytes_to_use) // aligned


def make_offload_key(block_hash: BlockHash, group_idx: int = 0) -> OffloadKey:
    return block_hash + group_idx.to_bytes(4, "big", signed=False)


def offload_key_block_hash(key: OffloadKey) -> BlockHash:
    return key[:-4]


def offload_key_group_idx(key: OffloadKey) -> int:
    return int.from_bytes(key[-4:], "big", signed=False)


class LookupResult(enum.Enum):
    MISS = enum.auto()
    HIT = enum.auto()
    # In the tier but still being written: a scheduler waits for it rather than recomputing.
    HIT_PENDING = enum.auto()


class Chunk:
    """One slot of the tier's buffer and how it is used.

    `ref_cnt` is -1 while a store into the slot is in flight (not readable yet), 0 when it is
    ready and evictable, and the number of loads reading from it when positive (pinned).
    """

    __slots__ = ("chunk_id", "ref_cnt")

    def __init__(self, chunk_id: int) -> None:
        self.chunk_id = chunk_id
        self.ref_cnt = -1

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0

    def __repr__(self) -> str:
        return f"Chunk(chunk_id={self.chunk_id}, ref_cnt={self.ref_cnt})"


@dataclass(slots=True)
class RequestContext:
    """What the tier knows of one request: its id and where each of its keys ends.

    `key_positions` maps a key to the token position its block ends at (the scheduler sets it
    as it learns the request's block hashes); the LRU policy orders a request's blocks by it so
    that tails are evicted before heads. The remaining fields are the manager's and the policy's
    own notes about the request, each valid only for the owner and cache generation it names.
    """

    req_id: str
    key_positions: dict[OffloadKey, int] = field(default_factory=dict)
    access: Any = field(default=None, repr=False)
    lru_rank: Any = field(default=None, repr=False)

    def set_position(self, key: OffloadKey, end_token: int) -> None:
        self.key_positions[key] = end_token


@dataclass(slots=True)
class PrepareStoreOutput:
    """The keys the caller must now write (in offer order), the chunk each goes to, and the keys
    evicted to make room."""

    keys_to_store: list[OffloadKey]
    chunk_ids: list[int]
    evicted_keys: list[OffloadKey]


@dataclass(slots=True)
class OffloadingEvent:
    """A change in the tier's contents, before it becomes KV events.

    `metadata_only` marks the release of a store that failed: the block was never announced,
    so no BlockRemoved is published for it.
    """

    keys: list[OffloadKey]
    removed: bool
    medium: str = MEDIUM_CPU
    metadata_only: bool = False
    locality: str | None = None  # "LOCAL" or "REMOTE" to the publisher (the shared tier's)


def order_request_keys(keys: list[OffloadKey], context: RequestContext) -> list[OffloadKey]:
    """The keys head to tail when every one has a position; otherwise as observed."""
    positions = context.key_positions
    if all(key in positions for key in keys):
        return sorted(keys, key=positions.__getitem__)
    return list(keys)


@dataclass(slots=True)
class TransferJob:
    """One copy between GPU blocks and CPU chunks, done by every worker for its shard.

    A load copies chunks `src` into GPU blocks `dst`; a store copies GPU blocks `src` into
    chunks `dst`. `first_block_index` is the position of the first GPU block in the request's
    block table (vLLM's GPULoadStoreSpec.block_indices, one group). A `sync` load is copied
    before the forward pass of the step it is issued in, whose request computes in that step.
    """

    req_id: str
    src: list[int]
    dst: list[int]
    first_block_index: int
    sync: bool = False


@dataclass(slots=True)
class SharedJob:
    """One copy between the shared tier and CPU chunks: a promotion writes `keys` into
    `chunk_ids`, a cascade writes `chunk_ids` to the tier under `keys`, pairwise."""

    job_id: int
    keys: list[OffloadKey]
    chunk_ids: list[int]
    is_promotion: bool
    context: RequestContext | None = None


@dataclass(slots=True)
class SharedJobs:
    """A step's shared-tier work, in the order the workers run it."""

    promotions: list[SharedJob] = field(default_factory=list)
    cascades: list[SharedJob] = field(default_factory=list)
    deletes: list[OffloadKey] = field(default_factory=list)  # data the catalog no longer lists

    def __bool__(self) -> bool:
        return bool(self.promotions or self.cascades or self.deletes)


@dataclass(slots=True)
class ConnectorMeta:
    load_jobs: dict[int, TransferJob]
    store_jobs: dict[int, TransferJob]
    jobs_to_flush: set[int]
    shared: SharedJobs | None = None  # the shared tier's copies, when it is on
