"""The KV-events stream: subscribers that start from the beginning, from a mid-run snapshot, or
restart from a checkpoint all end with the ledger's cached hash set."""

from __future__ import annotations

import asyncio
import re
from collections import Counter

from ledger.hashing import BlockHasher, resolve_none_hash_seed, to_event_hash
from services.events.subscriber import KVEventSubscriber
from tests.engine.test_ledger_service import prompts
from tests.harness.stack import Stack


async def drain(sub: KVEventSubscriber) -> None:
    while await sub.poll(block_ms=None) or await sub.poll(block_ms=50):
        pass


def ledger_cached(stack: Stack) -> Counter:
    return Counter(
        to_event_hash(b.block_hash) for b in stack.ledger.manager.block_pool.blocks if b.block_hash
    )


async def run_wave(stack: Stack, name: str, batch: list[list[int]]) -> None:
    ids = [f"{name}{i}" for i in range(len(batch))]
    for req_id, prompt in zip(ids, batch, strict=True):
        await stack.submit(req_id, prompt, 20)
    await stack.wait(ids, timeout=120)


async def test_snapshot_replay_and_restart_subscribers_agree_with_the_ledger(
    redis_url, tiny_model, tmp_path
):
    # A small pool so that later waves evict earlier blocks (BlockRemoved events).
    stack = await Stack(redis_url, tiny_model, num_blocks=32, max_model_len=160).start()
    try:
        from_start = KVEventSubscriber(stack.r, stack.prefix)
        await from_start.start("start")
        restarted = KVEventSubscriber(stack.r, stack.prefix, checkpoint=tmp_path / "sub.json")
        await restarted.start("snapshot")

        await run_wave(stack, "a", prompts(4, 70, seed=10, shared=32))
        await drain(restarted)
        checkpoint_id = restarted.last_id
        del restarted  # the subscriber process stops here

        await run_wave(stack, "b", prompts(4, 70, seed=11, shared=48))
        late = KVEventSubscriber(stack.r, stack.prefix)
        await late.start("snapshot")  # bootstraps mid-run, without the history
        assert late.bootstraps == 1 and late.last_id != "0-0"

        await run_wave(stack, "c", prompts(5, 60, seed=12, shared=16))
        resumed = KVEventSubscriber(stack.r, stack.prefix, checkpoint=tmp_path / "sub.json")
        await resumed.start("snapshot")
        assert resumed.bootstraps == 0 and resumed.last_id == checkpoint_id  # resumed, not rebuilt

        for sub in (from_start, late, resumed):
            await drain(sub)
        expected = ledger_cached(stack)
        assert stack.ledger.metrics.snapshot().evicted_blocks > 0
        assert from_start.index.counts == expected
        assert late.index.counts == expected
        assert resumed.index.counts == expected

        # A router hashing a prompt itself finds the ledger's hit.
        hasher = BlockHasher("sha256", seed=resolve_none_hash_seed("sha256"))
        probe = prompts(5, 60, seed=12, shared=16)[0]
        request_hashes = hasher.hash_blocks(probe, 16)
        cached_blocks = 0
        for block_hash in request_hashes:
            if stack.ledger.manager.block_pool.get_cached_block(block_hash) is None:
                break
            cached_blocks += 1
        assert late.index.cached_prefix_tokens(probe, hasher, 16) == cached_blocks * 16 > 0
    finally:
        await stack.stop()


async def test_a_subscriber_whose_position_was_trimmed_away_rebuilds_from_the_snapshot(
    redis_url, tiny_model, tmp_path
):
    stack = await Stack(redis_url, tiny_model, num_blocks=32, max_model_len=160).start()
    try:
        sub = KVEventSubscriber(stack.r, stack.prefix, checkpoint=tmp_path / "sub.json")
        await sub.start("start")
        await drain(sub)
        await run_wave(stack, "a", prompts(3, 50, seed=20))
        await asyncio.sleep(0)
        await stack.ledger._write_snapshot()
        await stack.r.xtrim(stack.streams.events, maxlen=1, approximate=False)
        again = KVEventSubscriber(stack.r, stack.prefix, checkpoint=tmp_path / "sub.json")
        await again.start("start")
        assert again.bootstraps == 1
        await drain(again)
        assert again.index.counts == ledger_cached(stack)
    finally:
        await stack.stop()


async def test_kvledger_events_prints_one_readable_line_per_event(redis_url, tiny_model, capsys):
    from services.events.subscriber import print_events

    stack = await Stack(redis_url, tiny_model, num_blocks=32, max_model_len=160).start()
    try:
        await run_wave(stack, "a", prompts(1, 40, seed=30))
        await print_events(redis_url, stack.prefix, "start", count=2)
        printed = capsys.readouterr().out.splitlines()
        lines = [line for line in printed if re.match(r"^\d\d:\d\d:\d\d\.\d{3} +\d+-\d+  ", line)]
        assert len(lines) == 2
        assert lines[0].endswith("AllBlocksCleared")
        cached = {
            f"{to_event_hash(h):016x}" for h in stack.ledger.manager.block_pool.cached_hashes()
        }
        assert "BlockStored    2 block(s) of 16, parent none:" in lines[1]  # the 40-token prompt
        printed_hashes = lines[1].split(": ", 1)[1].split(", ")
        assert len(printed_hashes) == 2 and set(printed_hashes) <= cached
    finally:
        await stack.stop()


async def test_a_snapshot_over_one_part_is_written_in_parts_and_read_whole(redis_url):
    # 200k cached blocks, 150k distinct hashes: ~1.8 MB, written as two parts under a temporary key and
    # renamed over the live one; a subscriber bootstraps every hash with its count.
    from engine.event_stream import SNAPSHOT_PART_BYTES, KVEventStream
    from ledger.block_pool import BlockPool
    from services.transport.keys import StreamNames
    from services.transport.redis_streams import connect

    r = connect(redis_url)
    streams = StreamNames("parts")
    pool = BlockPool(200_001, enable_caching=True)
    for block in pool.blocks[1:]:
        block.block_hash = (block.block_id % 150_000).to_bytes(32, "big")  # some counted twice
    stream = KVEventStream(r, streams, max_bytes=10**8, snapshot_interval_s=1e9, block_size=16,
                           hash_algo="sha256")  # fmt: skip
    stream.last_id = await r.xadd(streams.events, {b"batch": b"x"})
    await stream.write_snapshot(pool, "e1")
    assert await r.strlen(streams.events_snapshot) > SNAPSHOT_PART_BYTES
    assert not [k async for k in r.scan_iter(f"{streams.events_snapshot}:writing*")]
    sub = KVEventSubscriber(r, "parts")
    await sub.bootstrap()
    expected = Counter(to_event_hash(b.block_hash) for b in pool.blocks[1:])
    assert dict(sub.index.counts) == dict(expected)
    assert sub.last_id == stream.last_id.decode()
    await r.aclose()


def test_the_hashes_only_decoder_applies_what_the_full_decoder_does():
    # Real batches (stores with token ids, removals, a clear), vLLM's positional events, hashes
    # that are not ints (the full decoder's path) and entries both decoders refuse.
    import msgpack
    import pytest

    from ledger.events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        EventDecodeError,
        KVEventBatch,
        decode_batch,
        encode_batch,
    )
    from services.events.subscriber import PrefixIndex

    def stored(*hashes):
        return BlockStored(list(hashes), None, list(range(16 * len(hashes))), 16, None, "GPU", None)

    batches = [
        encode_batch(KVEventBatch(1.0, [stored(1, 2, 3), stored(2, 4)])),
        encode_batch(KVEventBatch(2.0, [BlockRemoved([2, 9], "GPU"), stored(5)])),
        msgpack.packb([3.0, [["BlockStored", [6, 7], 5, [0] * 32, 16], ["BlockRemoved", [1]]]]),
        msgpack.packb(
            [
                4.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [b"\x08" * 32, 8],
                        "parent_block_hash": None,
                        "token_ids": [0] * 32,
                        "block_size": 16,
                        "lora_id": None,
                        "medium": "GPU",
                        "lora_name": None,
                    }
                ],
            ]
        ),
    ]
    fast, slow = PrefixIndex(), PrefixIndex()
    for data in batches:
        fast.apply_bytes(data)
        slow.apply(decode_batch(data))
        assert fast.counts == slow.counts
    assert fast.counts == {2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1, 8: 1}
    refused = [
        b"\xc1",  # not msgpack
        msgpack.packb([5.0, [{"type": "BlockStored", "block_hashes": [1]}]]),  # fields missing
        msgpack.packb(
            [5.0, [{"type": "BlockRemoved", "block_hashes": [2], "medium": None, "colour": 1}]]
        ),
        msgpack.packb([5.0, [{"type": "BlockEvicted", "block_hashes": [2]}]]),
    ]
    for data in refused:
        with pytest.raises(EventDecodeError):
            fast.apply_bytes(data)
    assert fast.counts == slow.counts
    fast.apply_bytes(encode_batch(KVEventBatch(6.0, [AllBlocksCleared(), stored(9)])))
    assert fast.counts == {9: 1}
