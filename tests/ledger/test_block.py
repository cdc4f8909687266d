"""The free queue (ported from vLLM's test_kv_cache_utils.py free-queue tests)."""

from __future__ import annotations

import pytest

from ledger.block import FreeKVCacheBlockQueue, KVCacheBlock


def ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


def make(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def test_initialization_links_blocks_in_order():
    blocks, queue = make(4)
    assert queue.num_free_blocks == 4
    assert queue.head.next_free_block is blocks[0]
    assert queue.tail.prev_free_block is blocks[3]
    assert blocks[0].prev_free_block is queue.head and blocks[0].next_free_block is blocks[1]
    assert blocks[3].next_free_block is queue.tail and blocks[3].prev_free_block is blocks[2]


def test_remove_from_middle_popleft_and_append():
    blocks, queue = make(6)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4, 5]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    assert ids(queue) == [1, 3, 4, 5, 2]
    assert queue.num_free_blocks == 5
    queue.remove(blocks[5])
    queue.remove(blocks[1])
    assert ids(queue) == [3, 4, 2]
    assert queue.num_free_blocks == 3


def test_removing_a_block_that_is_not_free_raises():
    blocks, queue = make(3)
    queue.remove(blocks[1])
    with pytest.raises(RuntimeError, match="not free"):
        queue.remove(blocks[1])


def test_popleft_on_empty_queue_raises():
    _, queue = make(1)
    queue.popleft()
    with pytest.raises(ValueError, match="No free blocks"):
        queue.popleft()
    assert queue.head.next_free_block is queue.tail


def test_popleft_n_takes_from_the_front_and_relinks():
    blocks, queue = make(6)
    taken = queue.popleft_n(4)
    assert [b.block_id for b in taken] == [0, 1, 2, 3]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in taken)
    assert queue.head.next_free_block is blocks[4]
    assert blocks[4].prev_free_block is queue.head
    assert queue.num_free_blocks == 2
    assert [b.block_id for b in queue.popleft_n(2)] == [4, 5]
    assert queue.head.next_free_block is queue.tail and queue.tail.prev_free_block is queue.head
    assert queue.popleft_n(0) == []
    with pytest.raises(ValueError):
        queue.popleft_n(1)


def test_append_n_and_prepend_n_keep_given_order():
    blocks = [KVCacheBlock(i) for i in range(8)]
    queue = FreeKVCacheBlockQueue(blocks[:2])
    queue.append_n(blocks[2:4])
    assert ids(queue) == [0, 1, 2, 3]
    queue.prepend_n(blocks[4:7])
    assert ids(queue) == [4, 5, 6, 0, 1, 2, 3]
    assert queue.num_free_blocks == 7
    queue.append_n([])
    queue.prepend_n([])
    assert queue.num_free_blocks == 7
    assert blocks[6].next_free_block is blocks[0]
    assert blocks[0].prev_free_block is blocks[6]


def test_prepend_n_and_append_n_into_an_empty_queue():
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeKVCacheBlockQueue([])
    queue.prepend_n(blocks[:2])
    assert ids(queue) == [0, 1]
    assert queue.tail.prev_free_block is blocks[1]
    queue.popleft_n(2)
    queue.append_n(blocks[2:])
    assert ids(queue) == [2, 3]
    assert queue.head.next_free_block is blocks[2]
