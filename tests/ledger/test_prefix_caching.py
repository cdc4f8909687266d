"""The KV cache manager and block pool behave as vLLM 0.33's (ports of test_prefix_caching.py)."""

from __future__ import annotations

import logging

from ledger.events import AllBlocksCleared, BlockRemoved, BlockStored
from ledger.hashing import to_event_hash
from ledger.kv_cache_manager import KVCacheManager
from tests.ledger.conftest import admit, free_order

BS = 16


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_prefill(make_request, hasher):
    manager = KVCacheManager(11, BS, 8192)
    common = [i for i in range(3) for _ in range(16)]  # 3 full blocks
    req0 = make_request("0", common + [3] * 7)
    hits, num_hit, blocks = admit(manager, req0)
    assert len(req0.block_hashes) == 3 and hits == [] and num_hit == 0
    assert ids(blocks) == [1, 2, 3, 4]
    parent = None
    for block_id in (1, 2, 3):
        expected = hasher.hash_block(parent, common[(block_id - 1) * 16 : block_id * 16])
        block = manager.block_pool.blocks[block_id]
        assert block.block_hash == expected and block.ref_cnt == 1
        parent = expected
    assert manager.block_pool.blocks[4].block_hash is None  # partial: never cached

    # A hit on the common prefix while its blocks are still held.
    req1 = make_request("1", common + [3] * 5)
    hits, num_hit, blocks = admit(manager, req1)
    assert ids(hits) == [1, 2, 3] and num_hit == 48
    assert ids(blocks) == [5]
    assert all(b.ref_cnt == 2 for b in hits)
    assert manager.num_free_blocks == 5

    manager.free(req0)
    manager.free(req1)
    assert manager.num_free_blocks == 10
    # Partial blocks of req1 then req0 in front, untouched blocks, then the prefix tail first.
    assert free_order(manager) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    # A hit on the common prefix after its blocks were freed.
    req2 = make_request("2", common + [3] * 6)
    hits, num_hit, blocks = admit(manager, req2)
    assert ids(hits) == [1, 2, 3] and num_hit == 48
    assert ids(blocks) == [5]
    assert manager.num_free_blocks == 6
    assert all(b.ref_cnt == 0 for b in manager.block_pool.free_block_queue)
    manager.free(req2)

    # A miss that takes every block: the eviction order is the free order.
    req3 = make_request("3", [99] * (16 * 10))
    hits, _, blocks = admit(manager, req3)
    assert hits == []
    assert ids(blocks) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    queue = manager.block_pool.free_block_queue
    assert queue.num_free_blocks == 0 and queue.head.next_free_block is queue.tail


def test_decode(make_request):
    manager = KVCacheManager(11, BS, 8192)
    req0 = make_request("0", [i for i in range(3) for _ in range(16)] + [3] * 7)
    _, _, blocks = admit(manager, req0)
    assert ids(blocks) == [1, 2, 3, 4]
    req0.num_computed_tokens = 55
    # Four decode tokens fit in the partial block: no new block, still unhashed.
    req0.append_output_token_ids([8] * 4)
    assert manager.allocate_slots(req0, 4) == []
    assert manager.req_to_blocks["0"][-1].block_hash is None
    # Nineteen more cross the boundary: block 4 fills (and is cached), block 5 starts.
    req0.num_computed_tokens = 59
    req0.append_output_token_ids([7] * 19)
    new_blocks = manager.allocate_slots(req0, 19)
    assert len(new_blocks) == 1
    assert manager.req_to_blocks["0"][-2].block_hash is not None
    assert manager.req_to_blocks["0"][-1].block_hash is None


def test_evict(make_request):
    manager = KVCacheManager(11, BS, 8192)
    last = 5 * 16 + 7
    req0 = make_request("0", range(last))
    assert ids(admit(manager, req0)[2]) == [1, 2, 3, 4, 5, 6]
    req1 = make_request("1", range(last, last + 3 * 16))
    assert ids(admit(manager, req1)[2]) == [7, 8, 9]
    manager.free(req0)
    manager.free(req1)
    assert manager.num_free_blocks == 10
    assert free_order(manager) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]

    req2 = make_request("2", range(2 * 16 + 3))
    hits, num_hit, blocks = admit(manager, req2)
    assert ids(hits) == [1, 2] and num_hit == 32
    assert ids(blocks) == [6]
    assert manager.num_free_blocks == 7


def test_hash_block_correct_reuse(make_request):
    """A cached block reused for new data loses its old hash (one lendable block)."""
    manager = KVCacheManager(2, BS, 8192)
    req = make_request("0", range(16))
    assert ids(admit(manager, req)[2]) == [1]
    manager.free(req)
    req = make_request("1", range(15))
    blocks = admit(manager, req)[2]
    assert ids(blocks) == [1]
    assert manager.block_pool.blocks[1].block_hash is None
    assert len(manager.block_pool.cached_block_hash_to_block) == 0


def test_computed_blocks_not_evicted(make_request):
    """A hit block at the front of the free queue is touched before new blocks are taken."""
    manager = KVCacheManager(3, BS, 8192)
    req0 = make_request("0", range(16))
    assert ids(admit(manager, req0)[2]) == [1]
    req1 = make_request("1", range(16, 32))
    assert ids(admit(manager, req1)[2]) == [2]
    manager.free(req0)
    manager.free(req1)
    assert free_order(manager) == [1, 2]
    req2 = make_request("2", range(32))
    hits, num_hit, blocks = admit(manager, req2)
    assert ids(hits) == [1] and num_hit == 16
    assert ids(blocks) == [2]
    assert manager.block_pool.blocks[1].ref_cnt == 1
    assert manager.block_pool.blocks[1].block_hash == req2.block_hashes[0]


def test_basic_prefix_caching_disabled(make_request):
    manager = KVCacheManager(5, BS, 8192, enable_caching=False)
    req1 = make_request("1", range(10))
    assert ids(admit(manager, req1)[2]) == [1]
    manager.free(req1)
    # The same tokens again: no hit, the freed block comes back from the front.
    req2 = make_request("2", range(16))
    hits, num_hit, blocks = admit(manager, req2)
    assert hits == [] and num_hit == 0 and ids(blocks) == [1]
    assert manager.block_pool.blocks[1].block_hash is None
    req3 = make_request("3", range(16 * 4))
    assert admit(manager, req3)[2] is None  # 4 blocks needed, 3 free
    assert manager.prefix_cache_stats.queries == 0


def test_skip_reading_prefix_cache_reads_nothing_but_caches_its_blocks(make_request):
    manager = KVCacheManager(11, BS, 8192)
    common = [7] * (2 * BS)
    req0 = make_request("0", [*common, 1])
    admit(manager, req0)
    # Prompt logprobs need every position computed: no hit, no query counted, fresh blocks.
    req1 = make_request("1", [*common, 2], skip_reading_prefix_cache=True)
    hits, num_hit, blocks = admit(manager, req1)
    assert hits == [] and num_hit == 0 and ids(blocks) == [4, 5, 6]
    manager.record_prefix_cache_stats(req1, num_hit)
    assert manager.prefix_cache_stats.requests == 0  # a skipped lookup is no query
    manager.free(req0)
    manager.free(req1)
    req2 = make_request("2", [*common, 3])
    hits, num_hit, _ = admit(manager, req2)
    assert num_hit == 2 * BS  # the skipping request's blocks (or req0's) serve the next one


def test_cache_key_salting(make_request, hasher):
    manager = KVCacheManager(20, BS, 8192)
    tokens = list(range(3 * 16 + 5))
    salted = make_request("0", tokens, cache_salt="salt1")
    assert salted.block_hashes[0] == hasher.hash_block(
        None, tokens[:16], (("cache_salt", "salt1"),)
    )
    assert salted.block_hashes[1] == hasher.hash_block(salted.block_hashes[0], tokens[16:32], None)
    admit(manager, salted)
    assert admit(manager, make_request("1", tokens))[1] == 0  # no salt: a different chain
    assert admit(manager, make_request("2", tokens, cache_salt="salt2"))[1] == 0
    assert admit(manager, make_request("3", tokens, cache_salt="salt1"))[1] == 48


def test_prefill_not_enough_free_blocks_with_computed_blocks(make_request):
    """The seed's question 5: 3 free hit blocks + 1 new block, with 3 free blocks -> None."""
    manager = KVCacheManager(5, BS, 8192)
    req0 = make_request("0", range(3 * 16 + 1))
    assert ids(admit(manager, req0)[2]) == [1, 2, 3, 4]
    manager.free(req0)  # blocks 1-3 cached and free, block 4 free at the front
    hog = make_request("hog", [7] * 10)
    assert ids(admit(manager, hog)[2]) == [4]  # takes the uncached block first
    assert manager.num_free_blocks == 3
    before = (free_order(manager), [b.ref_cnt for b in manager.block_pool.blocks])
    req1 = make_request("1", list(range(3 * 16)) + [5] * 10)
    hits, num_hit, blocks = admit(manager, req1)
    assert ids(hits) == [1, 2, 3] and num_hit == 48
    assert blocks is None
    # Count first, change nothing: the free queue and every ref_cnt are untouched.
    assert (free_order(manager), [b.ref_cnt for b in manager.block_pool.blocks]) == before
    assert "1" not in manager.req_to_blocks
    assert manager.prefix_cache_stats.queries == 0  # the scheduler records only admitted lookups


def test_reset_prefix_cache(make_request, caplog):
    manager = KVCacheManager(10, BS, 8192, enable_kv_cache_events=True)
    req0 = make_request("0", range(40))
    admit(manager, req0)
    with caplog.at_level(logging.WARNING):
        assert manager.reset_prefix_cache() is False
    assert "not freed yet" in caplog.text
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    manager.free(req0)
    manager.take_events()
    assert manager.reset_prefix_cache() is True
    assert len(manager.block_pool.cached_block_hash_to_block) == 0
    assert all(b.block_hash is None for b in manager.block_pool.blocks)
    assert [type(e) for e in manager.take_events()] == [AllBlocksCleared]
    assert admit(manager, make_request("1", range(40)))[1] == 0


def test_kv_cache_events(make_request, hasher):
    manager = KVCacheManager(3, BS, 8192, enable_kv_cache_events=True)
    req0 = make_request("0", range(2 * 16))
    admit(manager, req0)
    (stored,) = manager.take_events()
    assert isinstance(stored, BlockStored)
    # The hit limit keeps the last token uncached in lookups, but both full blocks are stored.
    assert stored.block_hashes == [to_event_hash(h) for h in req0.block_hashes]
    assert stored.parent_block_hash is None
    assert stored.token_ids == list(range(32)) and stored.block_size == 16
    assert stored.medium == "GPU" and stored.lora_id is None and stored.extra_keys == [None, None]
    manager.free(req0)
    req1 = make_request("1", range(100, 120))
    admit(manager, req1)  # evicts block 2 then block 1 (tail first)
    events = manager.take_events()
    assert [type(e) for e in events] == [BlockRemoved, BlockRemoved, BlockStored]
    assert [e.block_hashes[0] for e in events[:2]] == [
        to_event_hash(h) for h in reversed(req0.block_hashes)
    ]
    assert manager.take_events() == []


def test_null_parent_block_hash_then_chained_parent(make_request):
    manager = KVCacheManager(6, BS, 8192, enable_kv_cache_events=True)
    req = make_request("0", range(20))
    admit(manager, req)
    (first,) = manager.take_events()
    assert first.parent_block_hash is None and len(first.block_hashes) == 1
    req.num_computed_tokens = 20
    req.append_output_token_ids(list(range(200, 212)))  # 32 tokens: block 2 is full
    manager.allocate_slots(req, 12)
    (second,) = manager.take_events()
    assert second.parent_block_hash == to_event_hash(req.block_hashes[0])
    assert second.block_hashes == [to_event_hash(req.block_hashes[1])]
    assert second.token_ids == list(range(16, 20)) + list(range(200, 212))


def test_one_hash_can_map_to_several_physical_blocks(make_request):
    """Two requests fill identical blocks before either is cached: both stay findable."""
    manager = KVCacheManager(10, BS, 8192)
    a, b = make_request("a", range(20)), make_request("b", range(20))
    admit(manager, a)
    # b was looked up before a was cached (simulated by allocating without its hit).
    manager.allocate_slots(b, 20)
    cache = manager.block_pool.cached_block_hash_to_block
    assert len(cache) == 1
    assert sorted(ids(cache.blocks_for(a.block_hashes[0]))) == [1, 3]
    manager.free(a)
    manager.free(b)
    # Evicting one of them leaves the other findable.
    admit(manager, make_request("c", [5] * 16 * 8))  # the 8th block taken is block 1
    remaining = cache.blocks_for(a.block_hashes[0])
    assert len(remaining) == 1
    assert admit(manager, make_request("d", range(20)))[1] == 16


def test_usage_counts_cached_free_blocks_as_free(make_request):
    manager = KVCacheManager(11, BS, 8192)
    req = make_request("0", range(40))
    admit(manager, req)
    assert manager.usage == 1.0 - 7 / 10
    manager.free(req)
    assert manager.usage == 0.0
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
