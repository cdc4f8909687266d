"""KV-cache block metadata and the free queue threaded through the blocks themselves.

A block is a few slots of plain data; the tensors it names live in the workers. The free queue
is a doubly linked list through `prev_free_block`/`next_free_block`, so a prefix-cache hit can
take a block out of the middle in O(1) without allocating anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

BlockHash = bytes


class KVCacheBlock:
    __slots__ = (
        "block_hash",
        "block_id",
        "next_free_block",
        "prev_free_block",
        "ref_cnt",
        "stored_by",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        # Number of requests holding this block; 0 means it sits in the free queue.
        self.ref_cnt = 0
        # Set only while the block is full and cached (findable by prefix-cache lookups).
        self.block_hash: BlockHash | None = None
        # The request that cached it: evictions link back to that request's trace.
        self.stored_by: str | None = None
        # Only FreeKVCacheBlockQueue touches these two.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    def reset_hash(self) -> None:
        self.block_hash = None
        self.stored_by = None

    def __repr__(self) -> str:
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        digest = self.block_hash.hex()[:12] if self.block_hash else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={digest}, prev={prev_id}, next={next_id})"
        )


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: the front is taken (and evicted) first.

    Invariants: a block is in the queue iff its ref_cnt is 0 (the null block excepted, which is
    never in it); the sentinels `head`/`tail` are never popped, so every real block in the
    queue has both links set and removal needs no branches.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.num_free_blocks = 0
        self.head.next_free_block = self.tail
        self.tail.prev_free_block = self.head
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free_block
        if block is self.tail or block is None:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} are free")
        taken = []
        # Links inside the queue are never None (the sentinels close it): typed as set.
        block: KVCacheBlock = self.head.next_free_block  # type: ignore[assignment]
        for _ in range(n):
            taken.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt  # type: ignore[assignment]
        self.head.next_free_block = block
        block.prev_free_block = self.head
        self.num_free_blocks -= n
        return taken

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on a block that is not free: {block}")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self.append_n((block,))

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        last: KVCacheBlock = self.tail.prev_free_block  # type: ignore[assignment]
        count = 0
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            count += 1
        last.next_free_block = self.tail
        self.tail.prev_free_block = last
        self.num_free_blocks += count

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        first: KVCacheBlock = self.head.next_free_block  # type: ignore[assignment]
        prev = self.head
        count = 0
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
            count += 1
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += count

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block: KVCacheBlock = self.head.next_free_block  # type: ignore[assignment]
        while block is not self.tail:
            yield block
            block = block.next_free_block  # type: ignore[assignment]

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return list(self)

    def __len__(self) -> int:
        return self.num_free_blocks
