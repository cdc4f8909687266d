"""Redis memory stays bounded, on a real redis-server: the KV-events stream is capped by bytes,
and outputs streams nobody writes or reads expire."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

from engine.event_stream import KVEventStream
from gateway.output_reader import OutputDispatcher
from ledger.block_pool import BlockPool
from ledger.events import BlockStored
from services.transport import redis_streams
from services.transport.keys import OUTPUTS_TTL_S, StreamNames
from services.wire.messages import GenerateRequest, SamplingParams
from tests.harness.stack import GATEWAY, Stack


def _stored(rng: random.Random, blocks: int, vocab: int = 32_000) -> BlockStored:
    return BlockStored(
        block_hashes=[rng.getrandbits(63) for _ in range(blocks)],
        parent_block_hash=rng.getrandbits(63),
        token_ids=[rng.randrange(vocab) for _ in range(16 * blocks)],
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


async def test_the_kv_events_stream_stays_within_its_memory_budget(redis_url):
    r = redis_streams.connect(redis_url)
    streams = StreamNames(f"b{uuid.uuid4().hex[:6]}", "default")
    budget = 600_000
    events = KVEventStream(
        r, streams, max_bytes=budget, snapshot_interval_s=1e9, block_size=16, hash_algo="sha256"
    )
    pool = BlockPool(8, enable_caching=True)
    rng = random.Random(0)
    try:
        for i in range(10_000):  # a few hundred bytes each: over 5x the budget in all
            await events.publish([_stored(rng, 1 + i % 6)], pool, "e.1")
        written = events._entry_bytes
        used = await r.memory_usage(streams.events, samples=0)
        length = await r.xlen(streams.events)
        assert written > 5 * budget
        # Approximate trimming drops whole listpack nodes, so the stream may overshoot a bit.
        assert used <= 1.25 * budget, (used, length, events.maxlen)
        assert used >= 0.5 * budget  # and it keeps what the budget allows, not a token amount
    finally:
        await r.delete(streams.events)
        await r.aclose()


async def test_the_budget_holds_for_large_kv_event_entries(redis_url):
    # Entries of ~2.5 KB (a prefill's stored blocks with a large vocabulary's token ids): Redis
    # keeps each in an allocation rounded up to its size class, hundreds of bytes over the
    # payload, so a budget divided by the payload plus a fixed overhead let the stream grow
    # ~15% past it. The publisher measures what Redis holds per entry instead.
    r = redis_streams.connect(redis_url)
    streams = StreamNames(f"b{uuid.uuid4().hex[:6]}", "default")
    budget = 8_000_000
    events = KVEventStream(
        r, streams, max_bytes=budget, snapshot_interval_s=1e9, block_size=16, hash_algo="sha256"
    )
    pool = BlockPool(8, enable_caching=True)
    rng = random.Random(1)
    batches = [[_stored(rng, 28, vocab=128_256)] for _ in range(32)]
    try:
        for i in range(4 * budget // 2500):
            await events.publish(batches[i % len(batches)], pool, "e.1")
        used = await r.memory_usage(streams.events, samples=0)
        assert 2000 < events._entry_bytes / events.batches < 3500  # the entries meant
        assert 0.85 * budget <= used <= 1.05 * budget, (used, events.maxlen)
    finally:
        await r.delete(streams.events)
        await r.aclose()


async def test_outputs_streams_expire_unless_written_or_read(redis_url, tiny_model):
    stack = await Stack(redis_url, tiny_model).start()
    try:
        # A request naming a gateway nobody runs: its stream is written once, then expires.
        await stack.submit("mine", [1, 2, 3], 4)
        nobody = stack.streams.outputs("gone-gateway")
        msg = GenerateRequest(
            req_id="orphan", gateway_id="gone-gateway", prompt_token_ids=[1, 2, 3],
            sampling=SamplingParams(max_tokens=4), arrival_time=time.time(),
        )  # fmt: skip
        await redis_streams.append(stack.r, stack.streams.requests, msg)
        await stack.wait(["mine"])
        deadline = time.monotonic() + 30
        while await stack.r.xlen(nobody) == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        for stream in (nobody, stack.streams.outputs(GATEWAY)):
            assert 0 < await stack.r.ttl(stream) <= OUTPUTS_TTL_S
    finally:
        await stack.stop()


async def test_the_gateway_reader_refreshes_its_outputs_stream(redis_url):
    r = redis_streams.connect(redis_url)
    stream = f"o:{uuid.uuid4().hex}"
    await r.xadd(stream, {b"m": b"x"})
    dispatcher = OutputDispatcher(r, stream, f"d:{uuid.uuid4().hex}", block_ms=50)
    try:
        await dispatcher.start()
        deadline = time.monotonic() + 10
        while await r.ttl(stream) < 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert await r.ttl(stream) <= OUTPUTS_TTL_S
    finally:
        await dispatcher.stop()
        await r.delete(stream)
        await r.aclose()
