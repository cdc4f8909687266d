"""The `hashes` field beside vLLM's bytes: `batch` stays byte-identical to vLLM 0.33, the runs
apply exactly what the events do, and a subscriber reads entries with the field, without it
(older ledgers, other publishers) and with a malformed one."""

from __future__ import annotations

import random
import time
import uuid

import msgpack
import pytest

import engine.event_stream as event_stream
from ledger.block_pool import BlockPool
from ledger.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from services.events.runs import (
    HASHES_FIELD,
    TIERS_FIELD,
    batch_runs,
    batch_tier_runs,
    decode_runs,
    decode_tier_runs,
    encode_runs,
    encode_tier_runs,
)
from services.events.snapshot import CLEARED, REMOVED, STORED, OpLog, pack_ops
from services.events.subscriber import (
    KVEventSubscriber,
    PrefixIndex,
    batch_hash_runs,
    batch_runs_by_tier,
)
from services.transport.keys import StreamNames
from services.transport.redis_streams import connect
from tests.ledger.test_events import VLLM_SCENARIO_BATCH


def stored(*hashes: int) -> BlockStored:
    return BlockStored(list(hashes), None, list(range(16 * len(hashes))), 16, None, "GPU", None)


def stored_on_cpu(block_hash: int) -> BlockStored:
    """The CPU tier's BlockStored, as vLLM's OffloadingConnector publishes it."""
    return BlockStored([block_hash], None, [], 0, None, "CPU", None, group_idx=0)


def random_events(rng: random.Random, n: int) -> list:
    # Few distinct hashes, so that stores, removals of held and of unheld hashes and repeats
    # within one batch all occur.
    events: list = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.03:
            events.append(AllBlocksCleared())
        elif roll < 0.1:  # the CPU tier's: in the batch, out of the GPU's index
            events.append(stored_on_cpu(rng.randrange(12)))
        elif roll < 0.15:
            events.append(BlockRemoved(rng.choices(range(12), k=2), "CPU", group_idx=0))
        elif roll < 0.5:
            events.append(stored(*rng.choices(range(12), k=rng.randint(1, 4))))
        else:
            events.append(BlockRemoved(rng.choices(range(12), k=rng.randint(1, 3)), "GPU"))
    return events


def test_runs_apply_what_the_events_do_in_their_order():
    rng = random.Random(7)
    by_events, by_runs = PrefixIndex(), PrefixIndex()
    for _ in range(400):
        events = random_events(rng, rng.randint(1, 9))
        events_ops, runs_ops = OpLog(), OpLog()
        by_events.apply(KVEventBatch(1.0, events), events_ops)
        by_runs.apply_runs(decode_runs(encode_runs(batch_runs(events))), runs_ops)
        by_runs.apply_tier_runs(
            decode_tier_runs(encode_tier_runs(batch_tier_runs(events))), runs_ops
        )
        assert by_runs.counts == by_events.counts
        assert _held(by_runs.tiers) == _held(by_events.tiers)
        # The checkpoint logs the same operations either way.
        assert pack_ops(runs_ops) == pack_ops(events_ops)
        # The bridge's runs, from vLLM's bytes, are the ledger's.
        assert batch_runs_by_tier(encode_batch(KVEventBatch(1.0, events))) == (
            batch_runs(events),
            batch_tier_runs(events),
        )


def _held(tiers: dict[str, dict[int, int]]) -> dict[str, dict[int, int]]:
    return {medium: counts for medium, counts in tiers.items() if counts}


def test_a_polls_logged_operations_replay_to_the_same_tiers():
    """A checkpoint logs a whole poll's GPU operations, then each tier's: a clear in a later
    entry must still clear what the tier stored in an earlier one."""
    rng = random.Random(11)
    for _ in range(100):
        live, by_events = PrefixIndex(), PrefixIndex()
        runs_ops, events_ops = OpLog(), OpLog()
        for _ in range(rng.randint(1, 6)):  # the entries of one poll
            events = random_events(rng, rng.randint(1, 6))
            live.apply_runs(batch_runs(events), runs_ops)
            live.apply_tier_runs(batch_tier_runs(events), runs_ops)
            by_events.apply(KVEventBatch(1.0, events), events_ops)
        for ops in (runs_ops, events_ops):
            replayed = PrefixIndex()
            replayed.apply_ops(pack_ops(ops))
            assert replayed.counts == live.counts == by_events.counts
            assert _held(replayed.tiers) == _held(live.tiers) == _held(by_events.tiers)


def test_the_tier_runs_repeat_the_clears_after_a_mediums_first_event():
    events = [
        AllBlocksCleared(),  # before any CPU event: the GPU's clear clears the tiers
        stored_on_cpu(1),
        stored_on_cpu(2),
        BlockRemoved([1], "CPU", group_idx=0),
        AllBlocksCleared(),
        stored_on_cpu(3),
        stored(9),
    ]
    assert batch_tier_runs(events) == {
        "CPU": [(STORED, [1, 2]), (REMOVED, [1]), (CLEARED, []), (STORED, [3])]
    }
    assert batch_tier_runs([stored(1), BlockRemoved([1], "GPU")]) == {}
    index = PrefixIndex()
    index.tiers = {"CPU": {7: 1}}
    index.apply_runs(batch_runs(events))
    index.apply_tier_runs(batch_tier_runs(events))
    assert index.tiers == {"CPU": {3: 1}} and index.counts == {9: 1}


def test_the_cpu_tiers_events_leave_the_gpu_index_alone():
    events = [stored(1, 2), stored_on_cpu(3), BlockRemoved([1], "CPU", group_idx=0), stored(3)]
    assert batch_runs(events) == [(STORED, [1, 2, 3])]
    data = encode_batch(KVEventBatch(1.0, events))
    assert batch_hash_runs(data) == batch_runs(events)
    by_bytes, by_batch = PrefixIndex(), PrefixIndex()
    by_bytes.apply_bytes(data)
    by_batch.apply(decode_batch(data))
    assert by_bytes.counts == by_batch.counts == {1: 1, 2: 1, 3: 1}
    # ... and go to the CPU tier's own index.
    assert by_bytes.tiers == by_batch.tiers == {"CPU": {3: 1}}
    assert by_bytes.tier_blocks("CPU", [1, 3, 4], 1) == 1


def test_runs_merge_consecutive_events_of_a_kind_and_keep_clears_apart():
    events = [
        stored(1, 2),
        stored(3),
        BlockRemoved([1], "GPU"),
        AllBlocksCleared(),
        AllBlocksCleared(),
        stored(4),
        BlockRemoved([4], "GPU"),
        BlockRemoved([9, 4], "GPU"),
    ]
    assert batch_runs(events) == [
        (STORED, [1, 2, 3]),
        (REMOVED, [1]),
        (CLEARED, []),
        (CLEARED, []),
        (STORED, [4]),
        (REMOVED, [4, 9, 4]),
    ]
    assert msgpack.unpackb(encode_runs(batch_runs(events))) == [
        [0, [1, 2, 3]], [1, [1]], [2, []], [2, []], [0, [4]], [1, [4, 9, 4]]
    ]  # fmt: skip


async def test_published_entries_keep_vllms_bytes_and_add_the_runs(redis_url, monkeypatch):
    r = connect(redis_url)
    streams = StreamNames(f"h{uuid.uuid4().hex[:8]}")
    stream = event_stream.KVEventStream(r, streams, max_bytes=10**7, snapshot_interval_s=1e9,
                                        block_size=16, hash_algo="sha256")  # fmt: skip
    stream._last_snapshot_start = time.monotonic()  # no snapshot: this test reads entries
    try:
        vllm_batch = decode_batch(VLLM_SCENARIO_BATCH)
        monkeypatch.setattr(event_stream.time, "time", lambda: vllm_batch.ts)
        for _ in range(2):
            await stream.publish(vllm_batch.events, BlockPool(4, enable_caching=True), "e")
        monkeypatch.undo()
        entries = await r.xrange(streams.events)
        assert [sorted(fields) for _, fields in entries] == [[b"batch", b"hashes", b"seq"]] * 2
        assert [fields[b"seq"] for _, fields in entries] == [b"0", b"1"]
        assert [fields[b"batch"] for _, fields in entries] == [VLLM_SCENARIO_BATCH] * 2
        scenario = decode_batch(VLLM_SCENARIO_BATCH).events
        assert decode_runs(entries[0][1][b"hashes"]) == batch_runs(scenario)
        assert [kind for kind, _ in batch_runs(scenario)] == [STORED, REMOVED, STORED]
        # The memory budget counts the extra field.
        total = sum(
            len(b"".join(f)) + len(b"".join(f.values())) - len(b"batch") for _, f in entries
        )
        assert stream._entry_bytes == total
    finally:
        await r.delete(streams.events, streams.events_snapshot)
        await r.aclose()


async def test_the_cpu_tiers_events_go_to_the_tiers_field_the_mirror_and_the_snapshot(
    redis_url, tmp_path
):
    r = connect(redis_url)
    streams = StreamNames(f"h{uuid.uuid4().hex[:8]}")
    stream = event_stream.KVEventStream(r, streams, max_bytes=10**7, snapshot_interval_s=1e9,
                                        block_size=16, hash_algo="sha256")  # fmt: skip
    stream._last_snapshot_start = time.monotonic()
    pool = BlockPool(4, enable_caching=True)
    try:
        await stream.publish([AllBlocksCleared()], pool, "e")
        await stream.publish([stored(1, 2), stored_on_cpu(1), stored_on_cpu(2)], pool, "e")
        await stream.publish([BlockRemoved([1], "GPU")], pool, "e")  # no CPU event: no field
        entries = await r.xrange(streams.events)
        assert [TIERS_FIELD in fields for _, fields in entries] == [False, True, False]
        assert decode_tier_runs(entries[1][1][TIERS_FIELD]) == {"CPU": [(STORED, [1, 2])]}
        assert stream.tier_counts == {"CPU": {1: 1, 2: 1}}
        follower = KVEventSubscriber(r, streams.prefix, checkpoint=tmp_path / "f.ckpt")
        await follower.start("start")
        await follower.poll(block_ms=None)
        await stream.write_snapshot(None, "e")
        late = KVEventSubscriber(r, streams.prefix)
        await late.start("snapshot")
        for sub in (follower, late):
            assert sub.index.counts == {2: 1} and sub.index.tiers == {"CPU": {1: 1, 2: 1}}
        # The tier evicts one; a new epoch clears them all, the tier with the GPU.
        await stream.publish([BlockRemoved([2], "CPU", group_idx=0)], pool, "e")
        await follower.poll(block_ms=None)
        assert follower.index.tiers == {"CPU": {1: 1}} == stream.tier_counts
        await stream.publish([AllBlocksCleared()], pool, "e")
        await follower.poll(block_ms=None)
        assert follower.index.tiers == {} and stream.tier_counts == {"CPU": {}}
        resumed = KVEventSubscriber(r, streams.prefix, checkpoint=tmp_path / "f.ckpt")
        await resumed.start("snapshot")
        assert resumed.index.tiers == {} and resumed.last_id == follower.last_id
    finally:
        await r.delete(streams.events, streams.events_snapshot)
        await r.aclose()


async def test_a_malformed_tiers_field_is_read_from_batch(redis_url):
    r = connect(redis_url)
    streams = StreamNames(f"h{uuid.uuid4().hex[:8]}")
    try:
        events = [stored(1), stored_on_cpu(1)]
        await r.xadd(streams.events, {b"batch": encode_batch(KVEventBatch(1.0, events)),
                                      HASHES_FIELD: encode_runs(batch_runs(events)),
                                      TIERS_FIELD: msgpack.packb({"CPU": [[5, [1]]]})})  # fmt: skip
        sub = KVEventSubscriber(r, streams.prefix)
        assert await sub.poll(block_ms=None) == 1
        assert sub.hashes_refused == 1
        assert sub.index.counts == {1: 1} and sub.index.tiers == {"CPU": {1: 1}}
    finally:
        await r.delete(streams.events)
        await r.aclose()


async def test_a_subscriber_reads_entries_with_without_and_with_a_malformed_hashes_field(
    redis_url,
):
    r = connect(redis_url)
    streams = StreamNames(f"h{uuid.uuid4().hex[:8]}")
    try:

        async def add(events: list, hashes: bytes | None = None, batch: bytes | None = None):
            fields = {b"batch": batch or encode_batch(KVEventBatch(1.0, events))}
            if hashes is not None:
                fields[HASHES_FIELD] = hashes
            await r.xadd(streams.events, fields)

        await add([stored(1, 2, 3)], encode_runs(batch_runs([stored(1, 2, 3)])))
        await add([stored(4), BlockRemoved([1], "GPU")])  # an older ledger: `batch` alone
        await add([stored(5)], b"\xc1")  # `hashes` not msgpack: read from `batch`
        await add([stored(6)], msgpack.packb([[7, [6]]]))  # kind 7: refused, `batch` read
        await add([stored(8)], msgpack.packb([[0, [b"x" * 8]]]))  # a hash not an int: same
        await add([], b"\xc1", batch=b"\xc1")  # nothing parses: skipped
        await r.xadd(streams.events, {b"other": b"x"})  # no field of ours: skipped
        await add([BlockRemoved([2], "GPU")], encode_runs([(REMOVED, [2])]), batch=b"\xc1")

        sub = KVEventSubscriber(r, streams.prefix)
        assert await sub.poll(block_ms=None) == 8
        assert sub.index.counts == {3: 1, 4: 1, 5: 1, 6: 1, 8: 1}
        assert sub.hashes_refused == 4  # three malformed fields and the one of the bad entry
        assert sub.skipped == 2
        assert sub.batches_applied == 6
    finally:
        await r.delete(streams.events)
        await r.aclose()


@pytest.mark.parametrize("count", [1, 3, 4])
async def test_a_backlog_read_page_ahead_applies_every_entry_once_in_order(
    redis_url, tmp_path, count
):
    # 10 entries in pages of `count`: every full page asks for the next before it is applied.
    r = connect(redis_url)
    streams = StreamNames(f"h{uuid.uuid4().hex[:8]}")
    rng = random.Random(count)
    expected = PrefixIndex()
    try:
        for _ in range(10):
            events = random_events(rng, 4)
            expected.apply(KVEventBatch(1.0, events))
            fields = {b"batch": encode_batch(KVEventBatch(1.0, events)),
                      HASHES_FIELD: encode_runs(batch_runs(events))}  # fmt: skip
            if tiers := batch_tier_runs(events):
                fields[TIERS_FIELD] = encode_tier_runs(tiers)
            await r.xadd(streams.events, fields)
        sub = KVEventSubscriber(r, streams.prefix, checkpoint=tmp_path / "sub.ckpt")
        await sub.start("start")
        pages = []
        while got := await sub.poll(block_ms=None, count=count):
            pages.append(got)
        assert sum(pages) == 10 and sub._ahead is None
        assert sub.index.counts == expected.counts
        assert _held(sub.index.tiers) == _held(expected.tiers)
        resumed = KVEventSubscriber(r, streams.prefix, checkpoint=tmp_path / "sub.ckpt")
        await resumed.start("start")
        assert resumed.last_id == sub.last_id and resumed.index.counts == expected.counts
        # The CPU tier's index resumes from the checkpoint too.
        assert _held(resumed.index.tiers) == _held(expected.tiers)
    finally:
        await r.delete(streams.events)
        await r.aclose()


async def test_a_short_page_is_read_during_the_poll_that_returns_it(redis_url):
    # The page asked for ahead held the stream's end as it was then; a poll returning fewer
    # entries than asked reads again, so what was appended meanwhile is in it (a follower takes
    # a short page for "caught up now").
    r = connect(redis_url)
    streams = StreamNames(f"h{uuid.uuid4().hex[:8]}")
    try:
        for i in range(6):
            await r.xadd(streams.events, {HASHES_FIELD: encode_runs([(STORED, [i])])})
        sub = KVEventSubscriber(r, streams.prefix)
        assert await sub.poll(block_ms=None, count=4) == 4
        assert sub._ahead is not None  # entries 5 and 6, asked for before the 7th was added
        await r.xadd(streams.events, {HASHES_FIELD: encode_runs([(STORED, [6])])})
        assert await sub.poll(block_ms=None, count=4) == 3
        assert sub.index.counts == dict.fromkeys(range(7), 1)
    finally:
        await r.delete(streams.events)
        await r.aclose()


def test_runs_read_from_another_publishers_bytes_int_or_byte_hashes():
    """`kvledger bridge` writes the `hashes` field from vLLM's bytes: the same runs as the
    ledger's own for int hashes, and vLLM's byte hashes turned into ints as vLLM turns them."""
    rng = random.Random(7)
    for _ in range(50):
        events = random_events(rng, rng.randint(1, 30))
        data = encode_batch(KVEventBatch(1.0, events))
        assert batch_hash_runs(data) == batch_runs(events)
    assert batch_hash_runs(VLLM_SCENARIO_BATCH) == batch_runs(
        decode_batch(VLLM_SCENARIO_BATCH).events
    )
    digests = [bytes(range(i, i + 32)) for i in range(3)]
    with_bytes = msgpack.packb([1.0, [
        {"type": "BlockStored", "block_hashes": digests[:2], "parent_block_hash": None,
         "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU",
         "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": digests[1:], "medium": "GPU"},
        {"type": "AllBlocksCleared"}, {"type": "AllBlocksCleared"},
    ]])  # fmt: skip
    as_int = [int.from_bytes(d, "big") & (2**64 - 1) for d in digests]  # vLLM's own rule
    assert batch_hash_runs(with_bytes) == [
        (STORED, as_int[:2]), (REMOVED, as_int[1:]), (CLEARED, []), (CLEARED, []),
    ]  # fmt: skip
    with pytest.raises(EventDecodeError):
        batch_hash_runs(b"\x93not a batch")
