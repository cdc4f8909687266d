"""Snapshots packed off the engine loop and incremental subscriber checkpoints keep exactly the
state of one stream entry."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter

import msgpack
import redis.asyncio as aioredis

import engine.event_stream as event_stream
from ledger.block_pool import BlockPool
from ledger.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from ledger.events import encode_batch as encode
from services.events.runs import batch_runs, batch_tier_runs
from services.events.snapshot import (
    CheckpointWriter,
    OpLog,
    decode_snapshot,
    snapshot_counts,
    snapshot_tier_counts,
)
from services.transport.keys import StreamNames


def stored(*hashes: int) -> BlockStored:
    return BlockStored(list(hashes), None, [0] * 16 * len(hashes), 16, None, "GPU", None)


async def test_a_background_snapshot_is_the_state_of_its_entry_while_events_keep_coming(
    redis_url, monkeypatch
):
    monkeypatch.setattr(event_stream, "SNAPSHOT_CHUNK", 2)  # yield between every two entries
    r = aioredis.from_url(redis_url)
    streams = StreamNames(f"t{uuid.uuid4().hex[:8]}")
    stream = event_stream.KVEventStream(
        r,
        streams,
        max_bytes=10_000_000,
        snapshot_interval_s=3600,
        block_size=16,
        hash_algo="sha256",
    )
    try:
        pool = BlockPool(8, enable_caching=True)
        await stream.publish([stored(1, 2, 3, 4, 5), stored(5)], pool, "e")  # first: a resync
        assert stream._snapshot_task is not None  # the first publish snapshots at once
        await stream._snapshot_task
        stream.counts = {1: 1, 2: 1, 3: 1, 4: 1, 5: 2}
        frozen_id = stream.last_id
        stream._snapshot_task = asyncio.create_task(stream._snapshot_in_background("e"))
        await asyncio.sleep(0)  # the snapshot has frozen the mirror and packed two entries
        # What publish() does once its XADD returns (awaiting a real XADD would let the packing
        # finish first): the changes go to the overlay while the mirror is being read.
        assert stream._frozen
        stream._apply(batch_runs([BlockRemoved([5], "GPU"), stored(6)]))
        stream._apply(batch_runs([BlockRemoved([1], "GPU")]))
        await stream._snapshot_task
        snapshot = decode_snapshot(await r.get(streams.events_snapshot))
        assert snapshot.stream_id == frozen_id.decode()
        assert snapshot_counts(snapshot) == {1: 1, 2: 1, 3: 1, 4: 1, 5: 2}
        assert stream.counts == {2: 1, 3: 1, 4: 1, 5: 1, 6: 1}

        stream._snapshot_task = asyncio.create_task(stream._snapshot_in_background("e"))
        await asyncio.sleep(0)
        stream._apply(batch_runs([AllBlocksCleared(), stored(7), stored(2)]))
        await stream._snapshot_task
        assert stream.counts == {7: 1, 2: 1}
        assert snapshot_counts(decode_snapshot(await r.get(streams.events_snapshot))) == {
            2: 1, 3: 1, 4: 1, 5: 1, 6: 1
        }  # fmt: skip
    finally:
        await r.delete(streams.events, streams.events_snapshot)
        await r.aclose()


def on_cpu(*hashes: int) -> list[BlockStored]:
    return [BlockStored([h], None, [], 0, None, "CPU", None, group_idx=0) for h in hashes]


async def test_a_background_snapshot_holds_the_cpu_tier_as_of_its_entry(redis_url, monkeypatch):
    monkeypatch.setattr(event_stream, "SNAPSHOT_CHUNK", 2)
    r = aioredis.from_url(redis_url)
    streams = StreamNames(f"t{uuid.uuid4().hex[:8]}")
    stream = event_stream.KVEventStream(r, streams, max_bytes=10_000_000,
                                        snapshot_interval_s=3600, block_size=16,
                                        hash_algo="sha256")  # fmt: skip
    try:
        pool = BlockPool(8, enable_caching=True)
        await stream.publish([stored(1), *on_cpu(1, 2, 3, 4, 5)], pool, "e")
        await stream._snapshot_task
        assert snapshot_tier_counts(decode_snapshot(await r.get(streams.events_snapshot))) == {
            "CPU": dict.fromkeys([1, 2, 3, 4, 5], 1)
        }
        stream._snapshot_task = asyncio.create_task(stream._snapshot_in_background("e"))
        await asyncio.sleep(0)  # frozen, partly packed
        events = [BlockRemoved([1, 2], "CPU", group_idx=0), *on_cpu(6)]
        stream._apply(batch_runs(events), batch_tier_runs(events))
        await stream._snapshot_task
        snapshot = decode_snapshot(await r.get(streams.events_snapshot))
        assert snapshot_tier_counts(snapshot) == {"CPU": dict.fromkeys([1, 2, 3, 4, 5], 1)}
        assert stream.tier_counts == {"CPU": dict.fromkeys([3, 4, 5, 6], 1)}
        stream._snapshot_task = asyncio.create_task(stream._snapshot_in_background("e"))
        await asyncio.sleep(0)
        events = [*on_cpu(7), AllBlocksCleared(), *on_cpu(8)]  # a clear clears the tier too
        stream._apply(batch_runs(events), batch_tier_runs(events))
        await stream._snapshot_task
        assert stream.tier_counts == {"CPU": {8: 1}} and stream.counts == {}
    finally:
        await r.delete(streams.events, streams.events_snapshot)
        await r.aclose()


def test_a_checkpoint_keeps_the_tiers_in_its_base_and_its_log(tmp_path):
    writer = CheckpointWriter(tmp_path / "sub.ckpt", min_compact_bytes=10**9)
    writer.compact("1-0", {1: 1}, {"CPU": {5: 1, 6: 2}})
    ops = OpLog()
    ops.tier("CPU").add(0, [7])
    ops.add(2, [])  # a clear: the tier's log repeats it
    ops.tier("CPU").add(0, [8])
    writer.append_ops("2-0", ops, {}, {"CPU": {8: 1}})
    reader = CheckpointWriter(tmp_path / "sub.ckpt")
    last_id, counts, logged = reader.load()
    assert (last_id, counts, reader.loaded_tiers) == ("1-0", {1: 1}, {"CPU": {5: 1, 6: 2}})
    [(entry_id, record)] = logged
    assert entry_id == "2-0" and list(record.runs()) == [(2, [])]
    assert record.tier_runs() == {"CPU": [(0, [7]), (2, []), (0, [8])]}


def batch(*events) -> bytes:
    return encode(KVEventBatch(1.0, list(events)))


def test_checkpoint_log_compacts_and_survives_a_crash_mid_write(tmp_path):
    writer = CheckpointWriter(tmp_path / "sub.ckpt", min_compact_bytes=10_000)
    writer.append([("1-0", batch(stored(1, 2)))], "1-0", {1: 1, 2: 1})  # no base yet: compacts
    writer.append([("2-0", batch(stored(3))), ("3-0", batch(stored(3)))], "3-0", {})
    assert writer.log_path.stat().st_size > 0
    last_id, counts, logged = CheckpointWriter(tmp_path / "sub.ckpt").load()
    assert (last_id, counts, [i for i, _ in logged]) == (
        "1-0",
        Counter({1: 1, 2: 1}),
        ["2-0", "3-0"],
    )

    with open(writer.log_path, "ab") as f:  # a record cut short by a crash
        f.write(b"\x92\xa34-0\xc4\x10abc")
    assert [i for i, _ in CheckpointWriter(tmp_path / "sub.ckpt").load()[2]] == ["2-0", "3-0"]

    writer.compact("3-0", {1: 1, 2: 1, 3: 2})
    with open(writer.log_path, "ab") as f:  # compacted, then crashed before the truncation
        f.write(__import__("msgpack").packb(["2-0", batch(stored(9))]))
    assert CheckpointWriter(tmp_path / "sub.ckpt").load() == (
        "3-0", Counter({1: 1, 2: 1, 3: 2}), []
    )  # fmt: skip


def test_a_json_checkpoint_of_an_earlier_release_still_loads(tmp_path):
    path = tmp_path / "sub.json"
    path.write_text(json.dumps({"last_id": "5-1", "counts": [[7, 2], [8, 1]]}))
    assert CheckpointWriter(path).load() == ("5-1", Counter({7: 2, 8: 1}), [])


# Order matters within and across batches: a removal of a hash not held is a no-op, a clear
# drops what came before it; 2**64 - 1 needs all of uint64 and a negative hash none of it.
ORDERED_BATCHES = [
    batch(stored(1, 2, 3), stored(3)),
    batch(BlockRemoved([9], "GPU"), stored(9), BlockRemoved([3], "GPU")),
    batch(stored(2**64 - 1), AllBlocksCleared(), stored(4, 5)),
    batch(BlockRemoved([5, 5], "GPU"), stored(5, 2**64 - 1), stored(6)),
    batch(stored(-7), BlockRemoved([4], "GPU"), stored(4)),
    batch(stored(8), BlockRemoved([8, 6], "GPU")),
]


async def _checkpoint_of(redis_url, tmp_path, old_format: bool):
    """A checkpointing subscriber polled 2 entries at a time over ORDERED_BATCHES; with
    `old_format`, its log rewritten into whole-batch records as earlier releases wrote them."""
    from services.events.subscriber import KVEventSubscriber

    r = aioredis.from_url(redis_url)
    prefix = f"t{uuid.uuid4().hex[:8]}"
    events = StreamNames(prefix).events
    ids = [(await r.xadd(events, {"batch": data})).decode() for data in ORDERED_BATCHES]
    path = tmp_path / "sub.ckpt"
    sub = KVEventSubscriber(r, prefix, checkpoint=path)
    await sub.start("start")
    while await sub.poll(block_ms=None, count=2):
        pass
    writer = CheckpointWriter(path)
    base_id, _, logged = writer.load()
    assert base_id == ids[1]  # the first poll wrote the base, the other two are logged
    if old_format:
        records = [msgpack.packb([i, d]) for i, d in zip(ids[2:], ORDERED_BATCHES[2:], strict=True)]
        writer.log_path.write_bytes(b"".join(records))
    resumed = KVEventSubscriber(r, prefix, checkpoint=path)
    await resumed.start()
    fresh = KVEventSubscriber(r, prefix)
    await fresh.start("start")
    while await fresh.poll(block_ms=None, count=100):
        pass
    await r.aclose()
    return sub.index.counts, resumed, fresh.index.counts, logged, ids


async def test_a_log_of_index_operations_replays_to_the_same_index(redis_url, tmp_path):
    counts, resumed, fresh, logged, ids = await _checkpoint_of(redis_url, tmp_path, False)
    assert counts == fresh == {4: 1, 5: 1, 2**64 - 1: 1, -7: 1}
    assert [type(d).__name__ for _, d in logged] == ["LoggedOps", "LoggedOps"]
    assert [i for i, _ in logged] == [ids[3], ids[5]]
    assert resumed.bootstraps == 0 and resumed.last_id == ids[5]
    assert resumed.index.counts == fresh


async def test_a_log_of_whole_batches_from_an_earlier_release_still_replays(redis_url, tmp_path):
    counts, resumed, fresh, _, ids = await _checkpoint_of(redis_url, tmp_path, True)
    assert resumed.bootstraps == 0 and resumed.last_id == ids[5]
    assert resumed.index.counts == counts == fresh


def ops_of(*pairs: tuple[int, list[int]]) -> OpLog:
    ops = OpLog()
    for kind, hashes in pairs:
        ops.add(kind, hashes)
    return ops


def test_operation_records_are_a_fraction_of_the_batches_and_a_cut_one_is_ignored(tmp_path):
    writer = CheckpointWriter(tmp_path / "sub.ckpt")
    writer.compact("1-0", {})
    writer.append_ops("2-0", ops_of((0, [11, 12]), (0, [13])), {})
    whole = len(msgpack.packb(["2-0", batch(stored(11, 12), stored(13))]))
    assert writer.log_path.stat().st_size < whole / 5
    ops = ops_of((0, [11]), (1, [11]), (1, [12]), (2, []), (2, []), (0, [2**64 - 1]))
    writer.append_ops("3-0", ops, {})
    (_, first), (_, logged) = CheckpointWriter(tmp_path / "sub.ckpt").load()[2]
    # Consecutive operations of a kind merge into one run; clears never do.
    assert list(first.runs()) == [(0, [11, 12, 13])]
    assert list(logged.runs()) == [(0, [11]), (1, [11, 12]), (2, []), (2, []), (0, [2**64 - 1])]
    with open(writer.log_path, "ab") as f:  # a new-format record cut short by a crash
        f.write(msgpack.packb(["4-0", b"\x00", b"\x01\x00\x00\x00", b"x" * 8])[:-3])
    assert [i for i, _ in CheckpointWriter(tmp_path / "sub.ckpt").load()[2]] == ["2-0", "3-0"]
