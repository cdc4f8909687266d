"""The Redis Streams transport on a real redis-server: pending entries are re-read once after a
restart, a dead consumer's entries can be claimed, and dead letters keep what they replace."""

from __future__ import annotations

import hashlib
import uuid

from services.transport import redis_streams
from services.wire.messages import AbortRequest


async def test_a_restarted_consumer_rereads_its_pending_entries_once_then_new_ones(redis_url):
    r = redis_streams.connect(redis_url)
    stream = f"t:{uuid.uuid4().hex}"
    try:
        first = redis_streams.GroupReader(r, [stream], "g", "c")
        await first.ensure_groups("0")
        ids = [
            await redis_streams.append(r, stream, AbortRequest(req_id=f"r{i}")) for i in range(3)
        ]
        assert [e.entry_id for e in await first.read(count=10, block_ms=None)] == ids  # not acked
        restarted = redis_streams.GroupReader(r, [stream], "g", "c")
        page1 = await restarted.read(count=2, block_ms=None)
        page2 = await restarted.read(count=2, block_ms=None)
        assert [e.entry_id for e in page1 + page2] == ids  # each pending entry handed out once
        new_id = await redis_streams.append(r, stream, AbortRequest(req_id="new"))
        assert [e.entry_id for e in await restarted.read(count=10, block_ms=100)] == [new_id]
        assert await restarted.read(count=10, block_ms=50) == []  # still pending, not redelivered
        await restarted.ack(page1 + page2)
        assert (await r.xpending(stream, "g"))["pending"] == 1
    finally:
        await r.delete(stream)
        await r.aclose()


async def test_entries_of_a_dead_consumer_can_be_claimed(redis_url):
    r = redis_streams.connect(redis_url)
    stream = f"t:{uuid.uuid4().hex}"
    try:
        dead = redis_streams.GroupReader(r, [stream], "g", "dead")
        await dead.ensure_groups("0")
        entry_id = await redis_streams.append(r, stream, AbortRequest(req_id="x"))
        await dead.read(count=10, block_ms=None)
        alive = redis_streams.GroupReader(r, [stream], "g", "alive")
        claimed = await alive.claim_stale(min_idle_ms=0)
        assert [e.entry_id for e in claimed] == [entry_id]
        assert redis_streams.decode_entry(claimed[0], AbortRequest).req_id == "x"
        consumers = {c["name"]: c["pending"] for c in await r.xinfo_consumers(stream, "g")}
        assert consumers[b"alive"] == 1 and consumers[b"dead"] == 0
    finally:
        await r.delete(stream)
        await r.aclose()


async def test_a_dead_letter_keeps_the_entry_and_the_error(redis_url):
    r = redis_streams.connect(redis_url)
    stream, dead = f"t:{uuid.uuid4().hex}", f"d:{uuid.uuid4().hex}"
    try:
        entry_id = await r.xadd(stream, {b"m": b"\xc1", b"extra": b"1"})
        entry = redis_streams.Entry(stream, entry_id, {b"m": b"\xc1", b"extra": b"1"})
        await redis_streams.dead_letter(r, dead, entry, "not msgpack")
        ((_, fields),) = await r.xrange(dead)
        assert fields[b"source_stream"] == stream.encode() and fields[b"source_id"] == entry_id
        assert fields[b"error"] == b"not msgpack"
        assert fields[b"orig:m"] == b"\xc1" and fields[b"orig:extra"] == b"1"
        assert fields[b"size:m"] == b"1"
        assert fields[b"sha256:m"] == hashlib.sha256(b"\xc1").hexdigest().encode()
    finally:
        await r.delete(stream, dead)
        await r.aclose()


async def test_a_dead_letter_keeps_a_prefix_the_size_and_the_digest_of_a_large_entry(redis_url):
    r = redis_streams.connect(redis_url)
    dead = f"d:{uuid.uuid4().hex}"
    payload = bytes(range(256)) * 16_384  # 4 MiB of garbage
    try:
        entry = redis_streams.Entry("s", b"1-1", {b"m": payload})
        await redis_streams.dead_letter(r, dead, entry, "x" * 100_000)
        ((_, fields),) = await r.xrange(dead)
        assert fields[b"orig:m"] == payload[: redis_streams.DEAD_LETTER_PREFIX_BYTES]
        assert fields[b"size:m"] == str(len(payload)).encode()
        assert fields[b"sha256:m"] == hashlib.sha256(payload).hexdigest().encode()
        assert len(fields[b"error"]) == redis_streams.DEAD_LETTER_PREFIX_BYTES
        assert await r.memory_usage(dead) < 16_384  # not the 4 MiB
    finally:
        await r.delete(dead)
        await r.aclose()
