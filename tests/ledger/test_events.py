"""KV events are byte-identical to vLLM 0.33's msgspec encoding, and decode both vLLM formats."""

from __future__ import annotations

import msgpack
import pytest

from ledger.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    KVEventBatch,
    decode_batch,
    decode_batch_generic,
    encode_batch,
)
from ledger.hashing import BlockHasher
from ledger.kv_cache_manager import KVCacheManager
from ledger.request import Request

# What vLLM 0.33.0 published (msgspec.msgpack.Encoder over KVCacheManager.take_events()) for the
# scenario in test_events_of_a_real_scenario_are_byte_identical_to_vllm: 4 blocks of 16, sha256,
# a 40-token request with cache_salt "s1" stored and freed, then a 64-token request evicting it.
# Generated with scripts/vllm-oracle-venv.sh; tests/oracle re-derives it live.
VLLM_SCENARIO_BATCH = bytes.fromhex(
    "93cb40934a000000000094de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf61860f8df659b6e4cf8dbf24902ae11a3db1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc0020000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1faa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b6579739291a27331c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf8dbf24902ae11a3da66d656469756da3475055a967726f75705f6964780084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf61860f8df659b6e4a66d656469756da3475055a967726f75705f69647800de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfd1ecdf87c874fd55cf2e94951059393917b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc00206465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7fcc80cc81cc82cc83aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6ec0"
)
VLLM_CLEARED_BATCH = bytes.fromhex(
    "93cb401d0000000000009181a474797065b0416c6c426c6f636b73436c656172656403"
)


def test_events_of_a_real_scenario_are_byte_identical_to_vllm():
    hasher = BlockHasher("sha256", seed="vllm-none-hash")
    manager = KVCacheManager(4, 16, 8192, enable_kv_cache_events=True)
    first = Request("0", list(range(40)), 17, block_hasher=hasher, cache_salt="s1")
    hits, num_hit = manager.get_computed_blocks(first)
    manager.allocate_slots(first, 40, num_hit, hits)
    manager.free(first)
    second = Request("1", list(range(100, 164)), 17, block_hasher=hasher)
    hits, num_hit = manager.get_computed_blocks(second)
    assert [b.block_id for b in manager.allocate_slots(second, 40, num_hit, hits)] == [3, 2, 1]
    assert encode_batch(KVEventBatch(1234.5, manager.take_events())) == VLLM_SCENARIO_BATCH
    manager.free(second)
    assert manager.reset_prefix_cache()
    assert (
        encode_batch(KVEventBatch(7.25, manager.take_events(), data_parallel_rank=3))
        == VLLM_CLEARED_BATCH
    )


def test_event_maps_start_with_type_and_keep_vllm_field_order():
    ts, events, rank = msgpack.unpackb(VLLM_SCENARIO_BATCH)
    assert (ts, rank) == (1234.5, None)
    stored = events[0]
    assert list(stored) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
    ]
    assert stored["extra_keys"] == [["s1"], None]  # the salt, untagged, in block 0 only
    assert list(events[1]) == ["type", "block_hashes", "medium", "group_idx"]


def test_decode_round_trips_our_batches():
    batch = decode_batch(VLLM_SCENARIO_BATCH)
    assert [type(e).__name__ for e in batch.events] == [
        "BlockStored",
        "BlockRemoved",
        "BlockRemoved",
        "BlockStored",
    ]
    assert batch.events[0].extra_keys == [("s1",), None]
    assert encode_batch(batch) == VLLM_SCENARIO_BATCH
    assert isinstance(decode_batch(VLLM_CLEARED_BATCH).events[0], AllBlocksCleared)


def test_msgspec_decoder_and_the_generic_reader_agree():
    fast = decode_batch(VLLM_SCENARIO_BATCH)
    generic = decode_batch_generic(VLLM_SCENARIO_BATCH)
    assert fast == generic
    assert fast.events[3].block_hashes == [0xD1ECDF87C874FD55, 0x2E94951059393917]
    assert fast.events[3].token_ids == list(range(100, 132))
    assert encode_batch(generic) == VLLM_SCENARIO_BATCH


def test_encoded_batches_own_their_bytes_across_calls_and_threads():
    # encode_batch writes into a buffer it keeps per thread: what it returns must not change
    # when it encodes again, in this thread (a smaller batch after a larger one) or another.
    from concurrent.futures import ThreadPoolExecutor

    scenario, cleared = decode_batch(VLLM_SCENARIO_BATCH), decode_batch(VLLM_CLEARED_BATCH)
    first = encode_batch(scenario)
    second = encode_batch(cleared)
    with ThreadPoolExecutor(4) as pool:
        elsewhere = list(pool.map(encode_batch, [scenario, cleared] * 50))
    assert first == VLLM_SCENARIO_BATCH and second == VLLM_CLEARED_BATCH
    assert elsewhere == [VLLM_SCENARIO_BATCH, VLLM_CLEARED_BATCH] * 50
    assert type(first) is bytes


def test_a_whole_number_timestamp_is_written_as_a_float_as_vllm_does():
    cleared: list = [AllBlocksCleared()]
    as_int = encode_batch(KVEventBatch(7, cleared, 3))  # type: ignore[arg-type]
    assert as_int == encode_batch(KVEventBatch(7.0, cleared, 3))
    assert as_int[1:10] == bytes.fromhex("cb401c000000000000")  # float64 7.0
    assert decode_batch(as_int).ts == 7.0


def test_decoder_accepts_older_positional_events():
    older = msgpack.packb(
        [
            99.0,
            [
                [
                    "BlockStored",
                    [11, 12],
                    None,
                    list(range(32)),
                    16,
                    None,
                ],  # before 'medium' existed
                ["BlockStored", [13], 12, list(range(16)), 16, None, "GPU", None],
                ["BlockRemoved", [11], "GPU"],
                ["AllBlocksCleared"],
            ],
            0,
        ]
    )
    batch = decode_batch(older)
    assert batch.data_parallel_rank == 0
    first, second, removed, cleared = batch.events
    assert first == BlockStored([11, 12], None, list(range(32)), 16, None, None, None)
    assert second.parent_block_hash == 12 and second.medium == "GPU"
    assert removed == BlockRemoved([11], "GPU")
    assert isinstance(cleared, AllBlocksCleared)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb({"ts": 1}), "array"),
        (msgpack.packb([1.0, [{"type": "BlockExploded"}], None]), "unknown KV event type"),
        (msgpack.packb([1.0, [{"type": "BlockRemoved"}], None]), "missing field"),
        (
            msgpack.packb(
                [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": None, "c": 1}], None]
            ),
            r"unknown field\(s\) \['c'\]",
        ),
        (msgpack.packb([1.0, [["BlockStored", [1]]], None]), "at least 4"),
    ],
)
def test_malformed_batches_raise_a_clear_error(payload, message):
    with pytest.raises(EventDecodeError, match=message):
        decode_batch(payload)
