"""`kvledger bridge` against kvledger's own ZMQ publisher (engine/zmq_events.py, the protocol
vLLM's publisher speaks; the same against vLLM's own publisher is in
tests/oracle/test_zmq_oracle.py): the replica's stream and snapshot give the index built from
the publisher's batches directly; gaps are filled by replay; a restarted publisher or batches
lost for good reset the replica's view; a restarted bridge resumes without a lost or repeated
batch; a bridge and a ledger never write one replica at once."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid

import pytest
import zmq

from engine.zmq_events import ZmqEventPublisher
from kvledger.bridge import SOURCE_SEQ_FIELD, Bridge
from ledger.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from services.config import BridgeConfig, KVEventsConfig
from services.events.subscriber import KVEventSubscriber, event_hash
from services.events.zmq_follower import Batch, Reset, ZmqFollower
from services.transport import redis_streams
from services.transport.redis_server import free_port
from services.wire import codec
from services.wire.messages import LedgerStatus
from tests.harness.fixtures import redis_url

__all__ = ["redis_url"]


class Batches:
    """Random store/remove batches, now and then a clear; byte hashes as vLLM's sha256 gives
    when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0."""

    def __init__(self, seed: int, byte_hashes: bool = False, cpu: bool = False) -> None:
        self.rng, self.byte_hashes, self.stored = random.Random(seed), byte_hashes, []
        self.cpu, self.on_cpu = cpu, []  # with `cpu`, vLLM's CPU tier's events too

    def event(self):
        if self.cpu and self.rng.random() < 0.3:
            if self.on_cpu and self.rng.random() < 0.4:
                removed = [self.on_cpu.pop(self.rng.randrange(len(self.on_cpu)))]
                return BlockRemoved(block_hashes=removed, medium="CPU", group_idx=0)
            self.on_cpu.append(self.rng.getrandbits(64))
            return BlockStored([self.on_cpu[-1]], None, [], 0, None, "CPU", None, group_idx=0)
        if self.rng.random() < 0.4 and self.stored:
            n = min(len(self.stored), self.rng.randint(1, 3))
            removed = [self.stored.pop(self.rng.randrange(len(self.stored))) for _ in range(n)]
            return BlockRemoved(block_hashes=removed, medium="GPU")
        hashes = [
            self.rng.randbytes(32) if self.byte_hashes else self.rng.getrandbits(64)
            for _ in range(self.rng.randint(1, 3))
        ]
        self.stored.extend(hashes)
        return BlockStored(hashes, None, [1] * 16 * len(hashes), 16, None, "GPU", None)

    def payload(self, events: int = 5, clear: bool = False) -> bytes:
        batch = [self.event() for _ in range(events)]
        if clear:  # the publisher's own clear, mid-batch
            self.stored.clear()
            self.on_cpu.clear()
            batch.insert(2, AllBlocksCleared())
        return encode_batch(KVEventBatch(time.time(), batch))


def direct_index(payloads: list[bytes], medium: str = "GPU") -> dict[int, int]:
    """The index of one medium built from the batches themselves, event by event (byte hashes
    turned into ints by vLLM's own rule: int.from_bytes(digest, "big") & (2**64 - 1)); a clear
    clears every medium."""
    counts: dict[int, int] = {}
    for payload in payloads:
        for event in decode_batch(payload).events:
            if isinstance(event, AllBlocksCleared):
                counts.clear()
                continue
            if (event.medium or "GPU") != medium:
                continue
            for h in event.block_hashes:
                key = h if isinstance(h, int) else int.from_bytes(h, "big") & (2**64 - 1)
                if isinstance(event, BlockStored):
                    counts[key] = counts.get(key, 0) + 1
                elif counts.get(key, 0) > 1:
                    counts[key] -= 1
                else:
                    counts.pop(key, None)
    return counts


class Publisher:
    """kvledger's ZmqEventPublisher on fixed ports, restartable, counting from a given seq."""

    def __init__(self) -> None:
        self.ports = free_port(), free_port()
        self.config = KVEventsConfig(True, endpoint=f"tcp://*:{self.ports[0]}",
                                     replay_endpoint=f"tcp://*:{self.ports[1]}", topic="kv")  # fmt: skip
        self.zmq: ZmqEventPublisher | None = None
        self.seq = 0
        self.sent: list[bytes] = []  # every payload of the current run, by seq

    def start(self, history: list[tuple[int, bytes]] = ()) -> Publisher:
        self.zmq = ZmqEventPublisher(self.config).start(history)
        assert self.zmq.bound.wait(5)
        self.live = self.zmq.sent = 0
        return self

    def restart(self) -> None:
        assert self.zmq is not None
        self.zmq.close()
        self.seq, self.sent = 0, []
        self.start()

    def flush(self) -> None:
        """Waits until the publisher's thread has sent (and buffered for replay) every batch
        queued so far."""
        assert self.zmq is not None
        deadline = time.monotonic() + 5
        while self.zmq.sent < self.live:
            assert time.monotonic() < deadline, (self.zmq.sent, self.live)
            time.sleep(0.001)

    def publish(self, payload: bytes, live: bool = True) -> None:
        assert self.zmq is not None
        if live:
            self.zmq.publish(self.seq, payload)
            self.live += 1
        else:  # into the replay buffer only: a batch every subscriber missed live
            self.flush()  # after the batches queued before it
            self.zmq.buffer.append((self.seq, payload))
        self.sent.append(payload)
        self.seq += 1

    def close(self) -> None:
        if self.zmq is not None:
            self.zmq.close()


def bridge_config(url: str, prefix: str, publisher: Publisher, **kwargs) -> BridgeConfig:
    return BridgeConfig(
        redis_url=url, stream_prefix=prefix, replica="vllm-0",
        endpoint=f"tcp://127.0.0.1:{publisher.ports[0]}",
        replay_endpoint=f"tcp://127.0.0.1:{publisher.ports[1]}", topic="kv",
        snapshot_interval_s=0.0, served_model_name="m", **kwargs,
    )  # fmt: skip


class Running:
    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge
        self.task = asyncio.create_task(bridge.run())

    async def ready(self) -> Running:
        await asyncio.wait_for(self.bridge.ready.wait(), 10)
        return self

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    async def until_forwarded(self, source_seq: int, timeout: float = 10.0) -> None:
        r, streams = self.bridge.r, self.bridge.streams
        deadline = time.monotonic() + timeout
        while True:
            if self.task.done():
                self.task.result()
            last = await r.xrevrange(streams.events, count=1)
            if last and last[0][1].get(SOURCE_SEQ_FIELD) == b"%d" % source_seq:
                return
            assert time.monotonic() < deadline, f"seq {source_seq} not forwarded: {last[:1]}"
            await asyncio.sleep(0.02)


async def subscriber_index(
    r, prefix: str, mode: str = "snapshot", medium: str = "GPU"
) -> dict[int, int]:
    sub = KVEventSubscriber(r, prefix, replica="vllm-0")
    await sub.start(mode)
    while await sub.poll(block_ms=None):
        pass
    return dict(sub.index.counts if medium == "GPU" else sub.index.tier(medium))


async def forwarded(r, prefix: str) -> list[tuple[int | None, bytes]]:
    entries = await r.xrange(f"{prefix}:{{vllm-0}}:kv-events")
    return [(int(f[SOURCE_SEQ_FIELD]) if SOURCE_SEQ_FIELD in f else None, f[b"batch"])
            for _, f in entries]  # fmt: skip


@pytest.fixture
async def env(redis_url):
    r = redis_streams.connect(redis_url)
    publisher = Publisher().start()
    yield r, f"b{uuid.uuid4().hex[:8]}", publisher
    publisher.close()
    await r.aclose()


@pytest.mark.parametrize("byte_hashes", [False, True])
async def test_the_bridge_writes_the_publishers_batches_as_a_ledger_would(
    redis_url, env, byte_hashes
):
    r, prefix, publisher = env
    batches = Batches(seed=1, byte_hashes=byte_hashes)
    for _ in range(5):  # published before the bridge starts: it replays them
        publisher.publish(batches.payload())
    running = await Running(Bridge(bridge_config(redis_url, prefix, publisher), r)).ready()
    try:
        for i in range(60):
            # Some missed live (replayed), one of the publisher's own clears.
            publisher.publish(batches.payload(clear=i == 20), live=i % 9 != 4)
            await asyncio.sleep(0.002)
        await running.until_forwarded(publisher.seq - 1)
        entries = await forwarded(r, prefix)
        # A fresh bridge starts an epoch with AllBlocksCleared, then every batch once, in order,
        # vLLM's bytes unchanged; the stream's own seq runs from 0.
        assert entries[0][0] is None and decode_batch(entries[0][1]).events == [AllBlocksCleared()]
        assert entries[1:] == list(enumerate(publisher.sent))
        fields = await r.xrange(f"{prefix}:{{vllm-0}}:kv-events")
        assert [int(f[b"seq"]) for _, f in fields] == list(range(len(fields)))
        expected = direct_index(publisher.sent)
        assert len(expected) > 20
        assert await subscriber_index(r, prefix, "start") == expected
        await asyncio.sleep(0.05)
        assert await subscriber_index(r, prefix, "snapshot") == expected  # snapshot + stream
        status = codec.decode(await r.get(f"{prefix}:{{vllm-0}}:ledger:status"), LedgerStatus)
        assert (status.block_size, status.hash_algo, status.model_name) == (16, "sha256", "m")
        assert running.bridge.follower.replays > 1 and running.bridge.resets == []
        if byte_hashes:
            assert all(isinstance(h, int) for h in expected)
            assert event_hash(b"\x00" * 24 + (5).to_bytes(8, "big")) == 5
    finally:
        await running.stop()


async def test_a_restarted_publisher_resets_the_replicas_view(redis_url, env):
    r, prefix, publisher = env
    batches = Batches(seed=2)
    running = await Running(Bridge(bridge_config(redis_url, prefix, publisher), r)).ready()
    try:
        for _ in range(20):
            publisher.publish(batches.payload())
        await running.until_forwarded(19)
        publisher.restart()  # counts from 0 again, knowing nothing of the old blocks
        await asyncio.sleep(0.3)  # the subscription reconnects
        for _ in range(10):
            publisher.publish(batches.payload())
        await running.until_forwarded(9)
        assert len(running.bridge.resets) == 1 and "restarted" in running.bridge.resets[0]
        entries = await forwarded(r, prefix)
        clears = [i for i, (seq, _) in enumerate(entries) if seq is None]
        assert len(clears) == 2  # the start, the reset
        assert entries[clears[1] + 1 :] == list(enumerate(publisher.sent))
        assert await subscriber_index(r, prefix, "start") == direct_index(publisher.sent)
    finally:
        await running.stop()


async def test_a_killed_bridge_resumes_without_a_lost_or_repeated_batch(redis_url, env):
    r, prefix, publisher = env
    batches = Batches(seed=3, cpu=True)  # a vLLM server with a CPU tier
    running = await Running(Bridge(bridge_config(redis_url, prefix, publisher), r)).ready()
    for _ in range(30):
        publisher.publish(batches.payload())
    await running.until_forwarded(29)
    await running.stop()
    await r.delete(f"{prefix}:{{vllm-0}}:ledger:leader")  # as a killed one's lease runs out
    for _ in range(25):  # while no bridge runs
        publisher.publish(batches.payload())
    resumed = await Running(Bridge(bridge_config(redis_url, prefix, publisher), r)).ready()
    try:
        assert resumed.bridge.resumed_at == 29
        for _ in range(10):
            publisher.publish(batches.payload())
        await resumed.until_forwarded(publisher.seq - 1)
        entries = await forwarded(r, prefix)
        assert [seq for seq, _ in entries] == [None, *range(publisher.seq)]
        assert entries[1:] == list(enumerate(publisher.sent))
        assert resumed.bridge.resets == []
        expected = direct_index(publisher.sent)
        assert await subscriber_index(r, prefix, "start") == expected
        await asyncio.sleep(0.05)
        assert await subscriber_index(r, prefix, "snapshot") == expected
        assert dict(resumed.bridge.events.counts) == expected  # the mirror rebuilt
        # The CPU tier's blocks too: in the stream's `tiers`, the snapshot and the mirror.
        on_cpu = direct_index(publisher.sent, "CPU")
        assert len(on_cpu) > 5
        assert await subscriber_index(r, prefix, "start", "CPU") == on_cpu
        assert await subscriber_index(r, prefix, "snapshot", "CPU") == on_cpu
        assert resumed.bridge.events.tier_counts.get("CPU") == on_cpu
    finally:
        await resumed.stop()


async def test_a_publisher_restarted_while_the_bridge_was_away_is_caught(redis_url, env):
    r, prefix, publisher = env
    batches = Batches(seed=4)
    running = await Running(Bridge(bridge_config(redis_url, prefix, publisher), r)).ready()
    for _ in range(10):
        publisher.publish(batches.payload())
    await running.until_forwarded(9)
    await running.stop()
    await r.delete(f"{prefix}:{{vllm-0}}:ledger:leader")
    publisher.restart()
    for _ in range(15):  # already past the old sequence when the bridge comes back
        publisher.publish(batches.payload())
    publisher.flush()  # so the replay holds batch 9, and its bytes tell the restart
    resumed = await Running(Bridge(bridge_config(redis_url, prefix, publisher), r)).ready()
    try:
        await resumed.until_forwarded(14)
        assert len(resumed.bridge.resets) == 1 and "not the one applied" in resumed.bridge.resets[0]
        assert await subscriber_index(r, prefix, "start") == direct_index(publisher.sent)
    finally:
        await resumed.stop()


async def test_batches_lost_for_good_reset_the_view(redis_url, env):
    r, prefix, publisher = env
    publisher.close()
    publisher.config = KVEventsConfig(True, endpoint=publisher.config.endpoint,
                                      replay_endpoint=publisher.config.replay_endpoint,
                                      topic="kv", buffer_steps=5)  # fmt: skip
    publisher.start()
    batches = Batches(seed=5)
    running = await Running(Bridge(bridge_config(redis_url, prefix, publisher), r)).ready()
    try:
        publisher.publish(batches.payload())
        await running.until_forwarded(0)
        for _ in range(8):  # missed live, and more than the replay buffer keeps
            publisher.publish(batches.payload(), live=False)
        publisher.publish(batches.payload())
        await running.until_forwarded(9)
        assert len(running.bridge.resets) == 1
        assert "no longer kept" in running.bridge.resets[0]
        # The view starts over from the oldest batch the publisher keeps.
        assert await subscriber_index(r, prefix, "start") == direct_index(publisher.sent[5:])
    finally:
        await running.stop()


async def test_the_follower_alone_hands_out_batches_and_resets_in_order(env):
    _, _, publisher = env
    follower = ZmqFollower(f"tcp://127.0.0.1:{publisher.ports[0]}",
                           f"tcp://127.0.0.1:{publisher.ports[1]}", "kv").open()  # fmt: skip
    got: list = []

    async def collect(until) -> None:
        deadline = time.monotonic() + 5
        while not until():
            assert time.monotonic() < deadline, got
            got.extend(await follower.poll(0.05))

    try:
        publisher.publish(b"a")
        publisher.publish(b"b", live=False)
        publisher.publish(b"c")
        await collect(lambda: len(got) >= 3)
        assert got == [Batch(0, b"a"), Batch(1, b"b"), Batch(2, b"c")]
        publisher.restart()
        await asyncio.sleep(0.3)
        publisher.publish(b"x")
        await collect(lambda: len(got) >= 5)
        assert isinstance(got[3], Reset) and got[4] == Batch(0, b"x")
    finally:
        follower.close()


async def test_one_writer_per_replica(redis_url, env):
    r, prefix, publisher = env
    first = await Running(Bridge(bridge_config(redis_url, prefix, publisher), r)).ready()
    second = Running(Bridge(bridge_config(redis_url, prefix, publisher), r))
    try:
        await asyncio.sleep(0.3)
        assert not second.bridge.ready.is_set() and second.bridge.leadership.standing_by
    finally:
        await second.stop()
        await first.stop()


async def test_a_replay_answer_that_never_comes_is_asked_for_again(env):
    _, _, publisher = env
    publisher.close()  # a publisher that takes the request and dies before it answers
    hung = zmq.Context.instance().socket(zmq.ROUTER)
    deadline = time.monotonic() + 5
    while True:  # ZMQ lets go of a closed socket's port in its own thread, a moment later
        try:
            hung.bind(f"tcp://*:{publisher.ports[1]}")
            break
        except zmq.ZMQError as error:
            assert error.errno == zmq.EADDRINUSE and time.monotonic() < deadline, error
            time.sleep(0.02)
    follower = ZmqFollower(f"tcp://127.0.0.1:{publisher.ports[0]}",
                           f"tcp://127.0.0.1:{publisher.ports[1]}", "kv",
                           replay_timeout_s=0.5).open()  # fmt: skip
    try:
        assert hung.poll(5000) and len(hung.recv_multipart()) == 3  # the request, unanswered
        hung.close(linger=0)
        publisher.start()  # the restarted publisher, same endpoints
        publisher.publish(b"a", live=False)
        got: list = []
        deadline = time.monotonic() + 10
        while Batch(0, b"a") not in got:
            assert time.monotonic() < deadline, got
            got.extend(await follower.poll(0.1))
        assert follower.replay_retries >= 1
    finally:
        follower.close()
