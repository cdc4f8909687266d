"""The CPU tier's manager (ledger.offloading) on small cases with known answers.

The op-by-op equality with vLLM 0.33's CPUOffloadingManager is in
tests/oracle/test_offload_differential.py; these pin the behaviour a reader should expect.
"""

from __future__ import annotations

import hashlib

import msgpack
import pytest

from ledger.events import KVEventBatch, encode_batch, encode_event
from ledger.hashing import to_event_hash
from ledger.offloading.base import LookupResult, RequestContext, make_offload_key, num_cpu_chunks
from ledger.offloading.events import to_kv_events
from ledger.offloading.manager import CPUOffloadingManager
from ledger.offloading.policies import ARCPolicy

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def key(name: str) -> bytes:
    return make_offload_key(hashlib.sha256(name.encode()).digest())


A, B, C, D, E = (key(n) for n in "abcde")


def request(rid: str, *keys: bytes, block_size: int = 16) -> RequestContext:
    context = RequestContext(rid)
    for index, k in enumerate(keys):
        context.set_position(k, (index + 1) * block_size)
    return context


def stored(manager: CPUOffloadingManager, context: RequestContext, *keys: bytes) -> list[int]:
    out = manager.prepare_store(list(keys), context)
    assert out is not None
    manager.complete_store(out.keys_to_store, context)
    return out.chunk_ids


def test_a_store_is_pending_until_it_completes_then_hits() -> None:
    manager = CPUOffloadingManager(4, enable_events=True)
    r = request("r", A, B)
    out = manager.prepare_store([A, B], r)
    assert out is not None
    assert (out.keys_to_store, out.chunk_ids, out.evicted_keys) == ([A, B], [0, 1], [])
    assert manager.lookup(A) is PENDING and manager.lookup(C) is MISS
    # Offering them again while in flight stores nothing more.
    again = manager.prepare_store([A, B], r)
    assert again is not None and again.keys_to_store == []
    manager.complete_store([A, B], r)
    assert manager.lookup(A) is HIT and manager.lookup(B) is HIT
    events = manager.take_events()
    assert [(e.keys, e.removed) for e in events] == [([A, B], False)]


def test_chunks_are_handed_out_fresh_then_last_freed_first() -> None:
    manager = CPUOffloadingManager(3)
    r = RequestContext("r")  # no positions: each key is ranked by when it was stored
    assert stored(manager, r, A, B, C) == [0, 1, 2]
    out = manager.prepare_store([D, E], RequestContext("s"))
    assert out is not None
    assert out.evicted_keys == [A, B]
    # A's chunk 0 and B's chunk 1 were freed in that order; the last freed goes first.
    assert out.chunk_ids == [1, 0]


def test_lru_evicts_a_finished_requests_tail_before_its_head() -> None:
    manager = CPUOffloadingManager(3)
    r = request("r", A, B, C)
    stored(manager, r, A, B, C)
    manager.on_request_finished(r)
    out = manager.prepare_store([D], request("s", D))
    assert out is not None and out.evicted_keys == [C]
    out = manager.prepare_store([E], request("t", E))
    assert out is not None and out.evicted_keys == [B]


def test_a_store_is_refused_while_every_chunk_is_pinned() -> None:
    manager = CPUOffloadingManager(2, enable_events=True)
    r = request("r", A, B, C)
    first = manager.prepare_store([A, B], r)
    assert first is not None
    # Both chunks are being written: nothing can be evicted for C.
    assert manager.prepare_store([C], r) is None
    manager.complete_store([A, B], r)
    assert manager.prepare_load([A], r) == [0]  # A is read: pinned
    out = manager.prepare_store([C], r)
    assert out is not None and out.evicted_keys == [B] and out.chunk_ids == [1]
    manager.complete_load([A], r)
    assert manager.lookup(A) is HIT and manager.lookup(B) is MISS


def test_keys_offered_together_are_not_evicted_for_each_other() -> None:
    manager = CPUOffloadingManager(2)
    r = RequestContext("r")
    stored(manager, r, A, B)
    # A is the least recent, but it is in the offer: B goes instead.
    out = manager.prepare_store([A, C], RequestContext("s"))
    assert out is not None and out.keys_to_store == [C] and out.evicted_keys == [B]


def test_a_failed_store_is_released_without_a_block_removed() -> None:
    manager = CPUOffloadingManager(2, enable_events=True)
    r = request("r", A, B)
    out = manager.prepare_store([A, B], r)
    assert out is not None
    manager.complete_store([A], r, success=False)
    manager.complete_store([B], r)
    assert manager.lookup(A) is MISS and manager.lookup(B) is HIT
    assert manager.free_list == [0]
    events = manager.take_events()
    assert [(e.keys, e.removed, e.metadata_only) for e in events] == [
        ([A], True, True),
        ([B], False, False),
    ]
    assert [type(e).__name__ for e in to_kv_events(events)] == ["BlockStored"]


def test_kv_events_are_vllms_placeholder_payloads_with_medium_cpu() -> None:
    manager = CPUOffloadingManager(1, enable_events=True)
    r = RequestContext("r")
    stored(manager, r, A)
    stored(manager, r, B)  # evicts A
    events = to_kv_events(manager.take_events())
    h = lambda k: to_event_hash(k[:-4])  # noqa: E731
    # Each event a map in vLLM's field order (the bytes against vLLM's own encoder are checked
    # by the differential).
    decoded = [list(msgpack.unpackb(encode_event(e)).items()) for e in events]
    assert decoded == [
        list(
            {
                "type": "BlockStored",
                "block_hashes": [h(A)],
                "parent_block_hash": None,
                "token_ids": [],
                "block_size": 0,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
                "group_idx": 0,
            }.items()
        ),
        list(
            {
                "type": "BlockRemoved",
                "block_hashes": [h(A)],
                "medium": "CPU",
                "group_idx": 0,
            }.items()
        ),
        list(
            {
                "type": "BlockStored",
                "block_hashes": [h(B)],
                "parent_block_hash": None,
                "token_ids": [],
                "block_size": 0,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
                "group_idx": 0,
            }.items()
        ),
    ]
    assert encode_batch(KVEventBatch(ts=1.5, events=events[:1]))[:2] == b"\x93\xcb"


def test_arc_promotes_a_reused_block_and_learns_from_its_ghosts() -> None:
    manager = CPUOffloadingManager(2, eviction_policy="arc")
    policy = manager.policy
    assert isinstance(policy, ARCPolicy)
    writer = request("w", A, B)
    stored(manager, writer, A, B)
    manager.on_request_finished(writer)  # storing is not a use: both stay in T1
    assert (list(policy.t1), list(policy.t2)) == ([B, A], [])
    reader = request("r", A)
    manager.prepare_load([A], reader)
    manager.complete_load([A], reader)
    manager.on_request_finished(reader)
    assert (list(policy.t1), list(policy.t2)) == ([B], [A])
    out = manager.prepare_store([C], request("c", C))
    assert out is not None and out.evicted_keys == [B] and list(policy.b1) == [B]
    # B comes back: a B1 hit grows T1's target by one.
    manager.prepare_store([B], request("b", B))
    assert policy.target_t1_size == 1


def test_store_threshold_stores_a_key_on_its_second_offer() -> None:
    manager = CPUOffloadingManager(4, store_threshold=2)
    r = RequestContext("r")
    first = manager.prepare_store([A, B], r)
    assert first is not None and first.keys_to_store == []
    second = manager.prepare_store([B, C], RequestContext("s"))
    assert second is not None and second.keys_to_store == [B]
    assert manager.stores_skipped == 3


def test_reset_forgets_everything_and_starts_the_chunks_over() -> None:
    manager = CPUOffloadingManager(2)
    r = request("r", A, B, C)
    stored(manager, r, A)
    assert manager.prepare_store([B], r) is not None  # still in flight at the reset
    manager.reset_cache()
    assert manager.lookup(A) is MISS and manager.lookup(B) is MISS
    # The running request's context is taken up again under the new generation.
    assert stored(manager, r, C, A) == [0, 1]
    assert manager.usage() == 0.0


def test_an_unknown_eviction_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="Unknown eviction_policy 'fifo': choose one of lru, arc"):
        CPUOffloadingManager(4, eviction_policy="fifo")


def test_the_tier_holds_whole_pages_per_block_of_every_worker() -> None:
    # The counts vLLM 0.33's CPUOffloadingSpec gives for the same settings (run in its venv).
    # SmolLM2-135M, block size 16, bf16: 30 layers x 2 x 3 heads x 64 x 16 tokens x 2 bytes.
    per_block = 30 * 2 * 3 * 64 * 16 * 2
    assert per_block == 368_640 and per_block % 4096 == 0
    assert num_cpu_chunks(4 * 2**30, per_block) == 4 * 2**30 // per_block == 11_650
    # Two workers (TP 2): each holds half the heads, the chunk both halves.
    assert num_cpu_chunks(4 * 2**30, per_block // 2, world_size=2) == 11_650
    # A tiny block is padded to a page: 1 GiB is 262,144 pages.
    assert num_cpu_chunks(1.0 * 2**30, 128) == 262_144
    assert num_cpu_chunks(0.5 * 2**30, 4097) == 2**29 // 8192
    assert num_cpu_chunks(2**30, 0) == 0
