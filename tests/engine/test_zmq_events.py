"""KV events over ZMQ as vLLM 0.33 publishes them (engine/zmq_events.py): vLLM's config JSON,
the three frames, the replay protocol, the bounded queue, the ledger's stream and its ZMQ output
batch for batch, the sequence across a failover, and fencing.

The same output read by a subscriber in vLLM's own venv, with vLLM's decoder, is in
tests/oracle/test_zmq_oracle.py."""

from __future__ import annotations

import argparse
import asyncio
import time

import pytest
import zmq

from engine.leadership import Leadership, LeadershipLost
from engine.zmq_events import END_OF_REPLAY, ZmqEventPublisher
from ledger.events import AllBlocksCleared
from observability import LedgerMetrics, new_registry
from services.config import (
    KVEventsConfig,
    LedgerConfig,
    add_arguments,
    from_arguments,
    parse_kv_events_config,
)
from services.environment import ConfigError
from services.events.snapshot import decode_snapshot
from services.transport import redis_streams
from services.transport.keys import StreamNames
from services.transport.redis_server import free_port
from tests.harness.stack import Stack

CTX = zmq.Context.instance()


def local(endpoint: str) -> str:
    """A bound wildcard endpoint as a client dials it."""
    return endpoint.replace("0.0.0.0", "127.0.0.1").replace("*", "127.0.0.1")


class RawSubscriber:
    """The protocol by hand: SUB frames as they come, replay over a DEALER."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: bytes = b"") -> None:
        self.sub = CTX.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(local(endpoint))
        self.replay_endpoint = replay_endpoint

    def live(self, timeout_s: float = 5.0) -> list[bytes]:
        if not self.sub.poll(int(timeout_s * 1000)):
            raise TimeoutError("no live batch")
        return self.sub.recv_multipart()

    def drain(self, idle_ms: int = 300) -> list[list[bytes]]:
        out = []
        while self.sub.poll(idle_ms):
            out.append(self.sub.recv_multipart())
        return out

    def replay(self, start: int) -> list[list[bytes]]:
        """Every message of one replay answer, its end marker last."""
        assert self.replay_endpoint is not None
        dealer = CTX.socket(zmq.DEALER)
        dealer.connect(local(self.replay_endpoint))
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got = []
            while True:
                if not dealer.poll(5000):
                    raise TimeoutError("replay did not end")
                frames = dealer.recv_multipart()
                assert frames[0] == b""
                got.append(frames[1:])
                if frames[2] == END_OF_REPLAY:
                    return got
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)


def seq_of(frames: list[bytes]) -> int:
    return int.from_bytes(frames[1], "big", signed=True)


# ---------------------------------------------------------------------- the configuration


def test_kv_events_config_is_vllms_json_with_vllms_defaults():
    default = parse_kv_events_config("{}")
    assert default == KVEventsConfig()
    assert (default.endpoint, default.replay_endpoint, default.buffer_steps) == (
        "tcp://*:5557", None, 10_000)  # fmt: skip
    assert (default.hwm, default.max_queue_size, default.topic) == (100_000, 100_000, "")
    # vLLM: publisher unset means zmq when events are enabled, null otherwise.
    assert not default.zmq and default.resolved_publisher == "null"
    on = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert on.zmq and on.resolved_publisher == "zmq"
    null = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}')
    assert not null.zmq
    full = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000", '
        '"replay_endpoint": "tcp://*:6001", "buffer_steps": 5, "hwm": 7, "max_queue_size": 9, '
        '"topic": "kv@pod@model"}'
    )
    assert full == KVEventsConfig(True, "zmq", "tcp://*:6000", "tcp://*:6001", 5, 7, 9,
                                  "kv@pod@model")  # fmt: skip
    assert parse_kv_events_config(full.to_json()) == full


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "'endpont'"),
        ('{"hwm": "100"}', "'hwm'"),
        ('{"buffer_steps": true}', "'buffer_steps'"),
        ('{"buffer_steps": 0}', "'buffer_steps'"),
        ('{"publisher": "kafka"}', "'publisher'"),
        ('{"endpoint": "5557"}', "'endpoint'"),
        ('["enable_kv_cache_events"]', "JSON object"),
        ("{enable_kv_cache_events: true}", "not JSON"),
    ],
)
def test_kv_events_config_refuses_other_keys_and_bad_values_by_name(text, named):
    parser = argparse.ArgumentParser()
    add_arguments(parser, LedgerConfig)
    args = parser.parse_args(["--kv-events-config", text])
    with pytest.raises(ConfigError) as raised:
        from_arguments(LedgerConfig, args)
    assert str(raised.value).startswith("--kv-events-config: ")
    assert named in str(raised.value)


def test_kv_events_config_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVLEDGER_KV_EVENTS_CONFIG", '{"enable_kv_cache_events": true}')
    assert from_arguments(LedgerConfig).kv_events_config == KVEventsConfig(True)
    monkeypatch.setenv("KVLEDGER_KV_EVENTS_CONFIG", '{"topics": "x"}')
    with pytest.raises(ConfigError, match="KVLEDGER_KV_EVENTS_CONFIG: key 'topics'"):
        from_arguments(LedgerConfig)


def test_endpoints_are_offset_per_replica_as_vllm_offsets_per_dp_rank():
    config = KVEventsConfig(True, endpoint="tcp://*:5557", replay_endpoint="tcp://*:5600")
    assert config.offset(0) == config
    assert (config.offset(3).endpoint, config.offset(3).replay_endpoint) == (
        "tcp://*:5560", "tcp://*:5603")  # fmt: skip
    assert config.offset(2).buffer_steps == config.buffer_steps
    assert KVEventsConfig(endpoint="tcp://*:0").offset(4).endpoint == "tcp://*:0"
    assert KVEventsConfig(endpoint="ipc:///tmp/kv").offset(1).endpoint == "ipc:///tmp/kv_dp1"
    assert KVEventsConfig(replay_endpoint=None).offset(1).replay_endpoint is None


# ---------------------------------------------------------------------- the publisher alone


def started(buffer_steps: int = 4, **kwargs) -> ZmqEventPublisher:
    config = KVEventsConfig(
        True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0", buffer_steps=buffer_steps,
        topic="kv@pod@m",
    )  # fmt: skip
    publisher = ZmqEventPublisher(config, **kwargs).start()
    assert publisher.bound.wait(5)
    return publisher


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.005)


def test_three_frames_then_replay_from_a_sequence_ending_with_minus_one():
    publisher = started(buffer_steps=4)
    assert publisher.endpoint is not None and publisher.replay_endpoint is not None
    sub = RawSubscriber(publisher.endpoint, publisher.replay_endpoint)
    try:
        time.sleep(0.2)  # the subscription reaches the PUB socket
        for seq in range(10, 16):
            assert publisher.publish(seq, b"batch-%d" % seq)
        live = [sub.live() for _ in range(6)]
        assert live == [[b"kv@pod@m", seq.to_bytes(8, "big"), b"batch-%d" % seq]
                        for seq in range(10, 16)]  # fmt: skip
        # Only the last buffer_steps batches are kept; the answer ends with seq -1.
        answer = sub.replay(0)
        assert [seq_of(f) for f in answer] == [12, 13, 14, 15, -1]
        assert answer[0] == [b"kv@pod@m", (12).to_bytes(8, "big"), b"batch-12"]
        assert answer[-1] == [b"", END_OF_REPLAY, b""]
        assert [seq_of(f) for f in sub.replay(14)] == [14, 15, -1]
        assert [seq_of(f) for f in sub.replay(99)] == [-1]
        # A malformed request is stepped over; the socket keeps answering.
        bad = CTX.socket(zmq.DEALER)
        bad.connect(local(publisher.replay_endpoint))
        bad.send_multipart([b"", b"short"])
        bad.close(linger=0)
        assert [seq_of(f) for f in sub.replay(15)] == [15, -1]
        assert publisher.replays == 4 and publisher.sent == 6
    finally:
        sub.close()
        publisher.close()


class Fence:
    """A lease as the publisher sees it (the real one is tested with Redis below)."""

    def __init__(self) -> None:
        self.is_held, self.lost = True, False

    def held(self) -> bool:
        return self.is_held


def test_a_full_queue_drops_and_counts_and_never_blocks():
    metrics = LedgerMetrics(new_registry(), "m")
    fence = Fence()
    fence.is_held = False  # the thread waits for the lease: nothing leaves the queue
    config = KVEventsConfig(True, endpoint="tcp://*:0", max_queue_size=3)
    publisher = ZmqEventPublisher(
        config, fence=fence, on_drop=metrics.record_kv_events_zmq_dropped
    ).start()
    try:
        assert publisher.bound.wait(5)
        assert publisher.publish(0, b"a") is True
        time.sleep(0.05)  # the thread took seq 0 and waits on the lease
        started_at = time.perf_counter()
        accepted = [publisher.publish(seq, b"x") for seq in range(1, 1001)]
        elapsed = time.perf_counter() - started_at
        assert accepted.count(True) == 3 and publisher.dropped == 997
        assert elapsed < 1.0  # 1,000 calls: never waited on the full queue (a generous bound)
        sample = metrics.registry.get_sample_value(
            "kvledger:kv_events_zmq_dropped_total", {"model_name": "m", "engine": "0"}
        )
        assert sample == 997
        sub = RawSubscriber(publisher.endpoint or "", None)
        time.sleep(0.2)
        fence.is_held = True  # renewed: what was queued goes out, in order
        assert [seq_of(sub.live()) for _ in range(4)] == [0, 1, 2, 3]
        sub.close()
    finally:
        publisher.close()


def test_once_deposed_nothing_more_goes_out_and_the_address_is_freed():
    fence = Fence()
    port = free_port()
    config = KVEventsConfig(True, endpoint=f"tcp://*:{port}")
    publisher = ZmqEventPublisher(config, fence=fence).start()
    sub = RawSubscriber(f"tcp://127.0.0.1:{port}", None)
    try:
        time.sleep(0.2)
        publisher.publish(0, b"a")
        assert seq_of(sub.live()) == 0
        fence.is_held = False  # paused past the lease ...
        publisher.publish(1, b"b")
        publisher.publish(2, b"c")
        time.sleep(0.1)
        fence.lost = True  # ... and a successor took it
        wait_until(lambda: publisher.fenced == 2)
        assert publisher.publish(3, b"d") is False
        assert sub.drain() == []
        # A successor on this host binds the same address.
        successor = ZmqEventPublisher(config).start()
        assert successor.bound.wait(5)
        successor.close()
    finally:
        sub.close()
        publisher.close()


def test_a_successor_binds_once_its_predecessor_lets_the_address_go():
    port = free_port()
    config = KVEventsConfig(True, endpoint=f"tcp://*:{port}")
    first = ZmqEventPublisher(config).start()
    second = ZmqEventPublisher(config).start()  # still held: bound by the thread later
    try:
        assert first.bound.is_set() and not second.bound.wait(0.3)
        assert second.publish(0, b"queued while waiting")
        first.close()
        assert second.bound.wait(5)
    finally:
        second.close()


# ---------------------------------------------------------------------- the ledger


def zmq_config(**kwargs) -> KVEventsConfig:
    kwargs = {"endpoint": f"tcp://*:{free_port()}", "replay_endpoint": f"tcp://*:{free_port()}",
              **kwargs}  # fmt: skip
    return KVEventsConfig(True, **kwargs)


async def stream_batches(stack: Stack) -> list[tuple[int, bytes]]:
    return [(int(f[b"seq"]), f[b"batch"]) for _, f in await stack.r.xrange(stack.streams.events)]


async def zmq_batches(publisher_endpoint: str, start: int) -> list[tuple[int, bytes]]:
    sub = RawSubscriber("tcp://127.0.0.1:1", publisher_endpoint)
    try:
        answer = await asyncio.to_thread(sub.replay, start)
    finally:
        sub.close()
    assert answer[-1][1] == END_OF_REPLAY
    return [(seq_of(f), f[2]) for f in answer[:-1]]


async def test_the_ledger_publishes_the_streams_batches_over_zmq_and_a_successor_goes_on(
    redis_url, tiny_model
):
    config = zmq_config(topic="kv@r0@tiny")
    stack = await Stack(redis_url, tiny_model, num_blocks=32, kv_events_config=config).start()
    try:
        publisher = stack.ledger.zmq
        assert publisher is not None and publisher.bound.wait(5)
        sub = RawSubscriber(publisher.endpoint or "", None)
        await asyncio.sleep(0.2)
        for i in range(10):  # more prompts than blocks: stores, evictions, removals
            await stack.submit(f"a{i}", [40 + i] * 70, 10)
        await stack.wait([f"a{i}" for i in range(10)])
        await asyncio.sleep(0.3)
        on_stream = await stream_batches(stack)
        kinds = b"".join(batch for _, batch in on_stream)
        assert b"BlockStored" in kinds and b"BlockRemoved" in kinds
        assert [seq for seq, _ in on_stream] == list(range(len(on_stream)))
        live = await asyncio.to_thread(sub.drain)
        # Live: every batch after the subscription, frame for frame; replay: all of them.
        assert [
            [b"kv@r0@tiny", s.to_bytes(8, "big"), b] for s, b in on_stream[-len(live) :]
        ] == live
        assert len(live) >= len(on_stream) - 1  # at most the start-up clear came before it
        assert await zmq_batches(publisher.replay_endpoint or "", 0) == on_stream
        sub.close()

        # The snapshot names the sequence of its entry: load it, replay from seq + 1.
        snapshot = decode_snapshot(await stack.r.get(stack.streams.events_snapshot))
        entries = {eid.decode(): int(f[b"seq"]) for eid, f in
                   await stack.r.xrange(stack.streams.events)}  # fmt: skip
        assert snapshot.seq == entries[snapshot.stream_id]

        # A new leader binds the same endpoints, goes on with the sequence (a new epoch starts
        # with AllBlocksCleared) and keeps its predecessor's batches for replay.
        before = len(on_stream)
        await stack.restart_ledger()
        successor = stack.ledger.zmq
        assert successor is not None and successor is not publisher
        assert successor.bound.wait(5) and successor.endpoint == publisher.endpoint
        await stack.submit("b", [7] * 40, 4)
        await stack.wait(["b"])
        await asyncio.sleep(0.3)
        on_stream = await stream_batches(stack)
        assert [seq for seq, _ in on_stream] == list(range(len(on_stream)))
        assert on_stream[before][1].find(b"AllBlocksCleared") > 0
        assert await zmq_batches(successor.replay_endpoint or "", 0) == on_stream
        assert await zmq_batches(successor.replay_endpoint or "", before) == on_stream[before:]
    finally:
        await stack.stop()


async def test_a_deposed_ledger_appends_and_publishes_nothing(redis_url, tiny_model):
    stack = await Stack(redis_url, tiny_model, num_blocks=32, kv_events_config=zmq_config()).start()
    try:
        publisher = stack.ledger.zmq
        assert publisher is not None
        await stack.submit("a", [3] * 40, 4)
        await stack.wait(["a"])
        await asyncio.sleep(0.2)
        sent, entries = publisher.sent, await stack.r.xlen(stack.streams.events)
        # A successor draws a later token while this ledger, to its own clock, still leads.
        await stack.r.delete(stack.streams.leader)
        r = redis_streams.connect(redis_url)
        successor = Leadership(r, StreamNames(stack.prefix, "default"), 30.0)
        await successor.acquire(asyncio.Event())
        assert stack.ledger.leadership.held()
        with pytest.raises(LeadershipLost):
            await stack.ledger._publish_events([AllBlocksCleared()])
        await asyncio.sleep(0.2)
        assert await stack.r.xlen(stack.streams.events) == entries
        assert publisher.sent == sent
        await r.aclose()
    finally:
        await stack.stop()
