"""The block pool: every KVCacheBlock, the free queue in LRU order and the prefix-cache map.

Block 0 is the null block and is never handed out, so a pool of N blocks lends N - 1. Cached
blocks stay findable while they sit in the free queue: a free block keeps its hash until the
pool hands it out again, and that hand-out is the eviction (one BlockRemoved per hash).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ledger.block import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock
from ledger.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    AnyKVCacheEvent,
    BlockRemoved,
    BlockStored,
)
from ledger.hashing import to_event_hash

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Eviction:
    """One cached block taken for new data: who cached it, so traces can link to that request."""

    block_id: int
    block_hash: BlockHash
    stored_by: str | None


class BlockHashToBlockMap:
    """hash -> block, or hash -> {block_id: block} when several physical blocks share a hash.

    Duplicates happen when two requests fill identical blocks before either is cached: vLLM
    keeps both rather than deduplicating, so block tables stay append-only. The single-block
    case stores the block itself to keep the common path free of inner dicts.
    """

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHash) -> KVCacheBlock | None:
        blocks = self._cache.get(key)
        if blocks is None or isinstance(blocks, KVCacheBlock):
            return blocks
        return next(iter(blocks.values()))

    def insert(self, key: BlockHash, block: KVCacheBlock) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif isinstance(blocks, KVCacheBlock):
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        else:
            blocks[block.block_id] = block

    def pop(self, key: BlockHash, block_id: int) -> KVCacheBlock | None:
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        if isinstance(blocks, KVCacheBlock):
            if blocks.block_id != block_id:
                return None
            del self._cache[key]
            return blocks
        block = blocks.pop(block_id, None)
        if len(blocks) == 1:
            self._cache[key] = next(iter(blocks.values()))
        elif not blocks:
            del self._cache[key]
        return block

    def blocks_for(self, key: BlockHash) -> list[KVCacheBlock]:
        blocks = self._cache.get(key)
        if blocks is None:
            return []
        return [blocks] if isinstance(blocks, KVCacheBlock) else list(blocks.values())

    def keys(self) -> Iterable[BlockHash]:
        return self._cache.keys()

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._cache

    def __len__(self) -> int:
        return len(self._cache)


class BlockPool:
    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        record_evictions: bool = False,
    ) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(
                f"a block pool needs at least 2 blocks (block 0 is the null block), got {num_gpu_blocks}"
            )
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # Block 0 stands in block tables where no data is; its ref_cnt is never maintained.
        self.null_block = self.free_block_queue.popleft()
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.kv_event_queue: list[AnyKVCacheEvent] = []
        self.record_evictions = record_evictions
        self.evictions: list[Eviction] = []

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get_one_block(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the front of the free queue; a cached one loses its hash (evicted)."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block, block.block_hash)
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        if self.cached_block_hash_to_block.pop(block_hash, block.block_id) is not None:
            if self.enable_kv_cache_events:
                self.kv_event_queue.append(
                    BlockRemoved(
                        block_hashes=[to_event_hash(block_hash)], medium=MEDIUM_GPU, group_idx=0
                    )
                )
            if self.record_evictions:
                self.evictions.append(Eviction(block.block_id, block_hash, block.stored_by))
        block.reset_hash()

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A prefix-cache hit: take the blocks out of the free queue (if free) and hold them."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Release one hold on each block, ordered by eviction priority (first evicted first).

        Blocks that reach ref_cnt 0 go back to the queue: uncached ones to the front (they can
        never be hit, so reuse them first, LIFO for locality), cached ones to the end (LRU).
        """
        to_front: list[KVCacheBlock] = []
        to_back: list[KVCacheBlock] = []
        caching = self.enable_caching
        for block in ordered_blocks:
            if block.block_id == 0:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not caching:
                    to_front.append(block)
                else:
                    to_back.append(block)
        self.free_block_queue.prepend_n(to_front)
        self.free_block_queue.append_n(to_back)

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        token_ids: Sequence[int],
        request_id: str | None = None,
        event_extra_keys: list[tuple | None] | None = None,
        lora_name: str | None = None,
        lora_id: int | None = None,
    ) -> None:
        """Give blocks[num_cached_blocks:num_full_blocks] their hashes and make them findable.

        Emits one BlockStored for the whole run, with the parent hash of the first new block
        (None when the run starts at block 0), as vLLM does.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        cache = self.cached_block_hash_to_block
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.block_id == 0 or block.block_hash is not None:
                continue
            block_hash = block_hashes[index]
            block.block_hash = block_hash
            block.stored_by = request_id
            cache.insert(block_hash, block)
        if self.enable_kv_cache_events:
            parent = (
                to_event_hash(block_hashes[num_cached_blocks - 1]) if num_cached_blocks else None
            )
            self.kv_event_queue.append(
                BlockStored(
                    block_hashes=[
                        to_event_hash(h) for h in block_hashes[num_cached_blocks:num_full_blocks]
                    ],
                    parent_block_hash=parent,
                    token_ids=list(
                        token_ids[num_cached_blocks * block_size : num_full_blocks * block_size]
                    ),
                    block_size=block_size,
                    lora_id=lora_id,
                    medium=MEDIUM_GPU,
                    lora_name=lora_name,
                    extra_keys=event_extra_keys,
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False, with a warning) while any block is held."""
        num_used = self.num_gpu_blocks - 1 - self.get_num_free_blocks()
        if num_used != 0:
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet", num_used
            )
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        for block in self.blocks:
            block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def eviction_head(self, max_positions: int) -> tuple[list[int], list[int], int]:
        """What the next `max_positions` allocations would evict: the cached blocks among the
        first `max_positions` of the free queue, as (their positions from the front, their
        KV-event hashes, the positions walked). A block at position p survives fewer than p + 1
        allocations; one beyond the positions walked survives at least that many."""
        positions: list[int] = []
        hashes: list[int] = []
        from_bytes = int.from_bytes  # to_event_hash, inlined: this walks thousands of blocks
        tail = self.free_block_queue.tail
        block = self.free_block_queue.head.next_free_block
        walked = 0
        while walked < max_positions and block is not tail and block is not None:
            block_hash = block.block_hash
            if block_hash is not None:
                positions.append(walked)
                hashes.append(from_bytes(block_hash[-8:], "big"))
            walked += 1
            block = block.next_free_block
        return positions, hashes, walked

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Share of lendable blocks not in the free queue (cached free blocks count as free)."""
        total = self.num_gpu_blocks - 1
        return 1.0 - self.get_num_free_blocks() / total if total else 0.0

    def take_events(self) -> list[AnyKVCacheEvent]:
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def take_evictions(self) -> list[Eviction]:
        evictions, self.evictions = self.evictions, []
        return evictions

    def cached_hashes(self) -> set[BlockHash]:
        return set(self.cached_block_hash_to_block.keys())
