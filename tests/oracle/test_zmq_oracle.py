"""KV events over ZMQ against vLLM 0.33 itself (tests/oracle/vllm_zmq_driver.py runs in vLLM's
venv): a subscriber built on vLLM's own decoder, checked first against vLLM's own
ZmqEventPublisher, reads a kvledger ledger's ZMQ output and gets exactly the Redis stream's
batches, in order, with no gap: from the start, joining late, missing batches on purpose, and
across a failover to a new ledger."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvledger.bridge import SOURCE_SEQ_FIELD
from ledger.events import AllBlocksCleared, BlockStored, decode_batch
from services.config import KVEventsConfig
from services.events.subscriber import KVEventSubscriber
from services.transport import redis_client, redis_streams
from services.transport.redis_server import free_port
from tests.harness.fixtures import redis_url, tiny_model
from tests.harness.processes import ROOT, ServiceProcess
from tests.harness.stack import Stack
from tests.oracle.conftest import HERE

pytestmark = pytest.mark.oracle
__all__ = ["redis_url", "tiny_model"]


class VllmZmqDriver:
    """vllm_zmq_driver.py in vLLM's venv: one command a line in, one `@@ ` answer a line out."""

    def __init__(self, python: Path) -> None:
        self.process = subprocess.Popen(
            [str(python), str(HERE / "vllm_zmq_driver.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.answers: queue.Queue[dict[str, Any]] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        assert self._next(600).get("ready"), self.tail()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("@@ "):
                self.answers.put(json.loads(line[3:]))
            else:
                self.output.append(line)
        self.answers.put({"error": "the driver exited", "output": self.tail()})

    def tail(self) -> str:
        return "".join(self.output[-30:])

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            return self.answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"no answer from vLLM's venv in {timeout}s:\n{self.tail()}"
            ) from None

    def call(self, cmd: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(cmd) + "\n")
        self.process.stdin.flush()
        got = self._next(timeout)
        assert "error" not in got, f"{got.get('error')}\n{got.get('trace', '')}{self.tail()}"
        return got

    async def acall(self, cmd: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
        return await asyncio.to_thread(self.call, cmd, timeout)

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def vllm_zmq(vllm_python):
    driver = VllmZmqDriver(vllm_python)
    yield driver
    driver.stop()


def test_the_subscriber_gets_exactly_what_vllms_own_publisher_sent(vllm_zmq):
    result = vllm_zmq.call({"cmd": "selfcheck", "ports": [free_port(), free_port()],
                            "batches": 300})  # fmt: skip
    for name in ("from_start", "late", "misses"):
        got = result[name]
        assert got["equal"] and got["accepted"] == 300, (name, got)
        assert got["lost"] == [] and got["roundtrip_differs"] == 0, (name, got)
        assert {"BlockStored", "BlockRemoved"} <= set(got["events"]), (name, got)
    # The one that missed batches filled every gap by replay; the late one started from one.
    assert result["misses"]["skipped"] > 80 and result["misses"]["replays"] > 10
    assert result["late"]["replays"] >= 1


async def stream_batches(stack: Stack) -> list[tuple[int, bytes]]:
    return [(int(f[b"seq"]), f[b"batch"]) for _, f in await stack.r.xrange(stack.streams.events)]


async def test_a_vllm_subscriber_reads_the_ledgers_zmq_output_as_the_redis_stream(
    redis_url, tiny_model, vllm_zmq, tmp_path
):
    ports = free_port(), free_port()
    config = KVEventsConfig(True, endpoint=f"tcp://*:{ports[0]}",
                            replay_endpoint=f"tcp://*:{ports[1]}", topic="kv@default@tiny")  # fmt: skip
    stack = await Stack(redis_url, tiny_model, num_blocks=32, kv_events_config=config).start()
    dial = {"endpoint": f"tcp://127.0.0.1:{ports[0]}",
            "replay_endpoint": f"tcp://127.0.0.1:{ports[1]}", "topic": "kv@default@tiny"}  # fmt: skip
    names = ["from_start", "misses", "late"]
    try:
        await vllm_zmq.acall({"cmd": "subscribe", "name": "from_start", **dial})
        await vllm_zmq.acall({"cmd": "subscribe", "name": "misses", "skip_every": 3, **dial})

        async def wave(tag: str, n: int) -> None:
            for i in range(n):  # more blocks than the pool: stores, evictions, removals
                await stack.submit(f"{tag}{i}", [40 + i % 5] * 40 + [i] * 30, 8)
            await stack.wait([f"{tag}{i}" for i in range(n)])

        await wave("a", 8)
        await vllm_zmq.acall({"cmd": "subscribe", "name": "late", **dial})
        await wave("b", 6)
        await stack.restart_ledger()  # a new leader: same endpoints, the sequence goes on
        await wave("c", 6)
        await asyncio.sleep(0.3)
        on_stream = await stream_batches(stack)
        last = on_stream[-1][0]
        assert [seq for seq, _ in on_stream] == list(range(last + 1))
        summaries = {}
        for name in names:
            out = tmp_path / f"{name}.msgpack"
            summary = await vllm_zmq.acall(
                {"cmd": "until", "name": name, "last": last, "out": str(out)}
            )
            got = [(seq, payload) for seq, payload in msgpack.unpackb(out.read_bytes())]
            assert got == on_stream, (name, summary)
            assert summary["lost"] == [] and summary["roundtrip_differs"] == 0, (name, summary)
            assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= set(summary["events"])
            summaries[name] = summary
        # The one that missed every third batch it saw live filled each gap by replay (how many
        # it saw live depends on the machine: a loaded one runs fewer, larger steps, and a
        # subscriber that joins catches up by replay); the late one started from a replay of
        # everything before it.
        misses = summaries["misses"]
        assert misses["skipped"] >= 1 and misses["replays"] >= 1, misses
        assert summaries["late"]["first"] == 0 and summaries["late"]["replays"] >= 1
    finally:
        await stack.stop()


# ---------------------------------------------------------------------- kvledger bridge


def bridge_process(url: str, prefix: str, ports: tuple[int, int], log: Path) -> ServiceProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
    env.update(
        KVLEDGER_REDIS_URL=url, KVLEDGER_STREAM_PREFIX=prefix, KVLEDGER_REPLICA="vllm-0",
        KVLEDGER_BRIDGE_ENDPOINT=f"tcp://127.0.0.1:{ports[0]}",
        KVLEDGER_BRIDGE_REPLAY_ENDPOINT=f"tcp://127.0.0.1:{ports[1]}",
        KVLEDGER_LOG_FORMAT="json", PYTHONPATH=str(ROOT),
    )  # fmt: skip
    return ServiceProcess("bridge", env, log_path=log).start()


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def stream_entries(url: str, prefix: str) -> list[dict[bytes, bytes]]:
    client = redis_client.connect_sync(url)
    try:
        return [fields for _, fields in client.xrange(f"{prefix}:{{vllm-0}}:kv-events")]
    finally:
        client.close()


def last_source_seq(url: str, prefix: str) -> int | None:
    client = redis_client.connect_sync(url)
    try:
        last = client.xrevrange(f"{prefix}:{{vllm-0}}:kv-events", count=1)
    finally:
        client.close()
    if not last or SOURCE_SEQ_FIELD not in last[0][1]:
        return None
    return int(last[0][1][SOURCE_SEQ_FIELD])


@pytest.mark.parametrize(
    ("rate", "batches"),
    [pytest.param(4_000, 240, id="4k-events-per-s"),
     pytest.param(20_000, 2_000, id="20k-events-per-s", marks=pytest.mark.slow)],
)  # fmt: skip
def test_a_bridge_killed_mid_stream_loses_and_repeats_no_batch_of_vllms_publisher(
    redis_url, vllm_zmq, tmp_path, rate, batches
):
    """vLLM's own ZmqEventPublisher sends random batches of 100 events at `rate` events/s
    (buffer_steps 10,000); the bridge is killed with SIGKILL part-way and started again. The
    replica's stream then holds every batch once, in order, vLLM's bytes unchanged, and the
    index read from it (snapshot or stream) is the one built from the batches directly."""
    ports = free_port(), free_port()
    prefix = f"o{uuid.uuid4().hex[:8]}"
    log = tmp_path / "bridge.log"
    out = tmp_path / "published.msgpack"
    caught_up = tmp_path / "caught-up"  # ends the publisher's linger (its replay socket kept up)
    # once the bridge has every batch (or has failed to get them)
    bridge = bridge_process(redis_url, prefix, ports, log)
    wait_for(lambda: bridge.records("bridge_following"), 60, f"bridge start:\n{bridge.output()}")
    publishing = threading.Thread(
        target=lambda: results.append(vllm_zmq.call({
            "cmd": "publish", "endpoint": f"tcp://*:{ports[0]}",
            "replay_endpoint": f"tcp://*:{ports[1]}", "batch_events": 100, "batches": batches,
            "rate": rate, "buffer_steps": 10_000, "seed": 7, "linger_s": 60.0,
            "linger_until": str(caught_up), "out": str(out),
        }, timeout=600))
    )  # fmt: skip
    results: list[dict] = []
    publishing.start()
    total_s = batches * 100 / rate
    wait_for(lambda: (last_source_seq(redis_url, prefix) or 0) > batches // 3, 120,
             f"the bridge forwards nothing:\n{bridge.output()}")  # fmt: skip
    bridge.kill9()
    killed_at = last_source_seq(redis_url, prefix)
    time.sleep(min(2.0, total_s / 4))  # batches go by with no bridge
    bridge = bridge_process(redis_url, prefix, ports, log)
    try:
        wait_for(lambda: last_source_seq(redis_url, prefix) == batches - 1, 300,
                 f"the restarted bridge did not catch up:\n{bridge.output()}")  # fmt: skip
        resumed = bridge.records("bridge_following")[0]
        assert resumed["resumed_after"] == killed_at
        assert bridge.records("bridge_reset") == []
    finally:
        caught_up.touch()
        bridge.stop()
        publishing.join()
    assert results and results[0]["batches"] == batches, results
    published = [payload for _, payload in msgpack.unpackb(out.read_bytes())]
    entries = stream_entries(redis_url, prefix)
    # The first start's AllBlocksCleared, then each of vLLM's batches once, in order, unchanged.
    assert SOURCE_SEQ_FIELD not in entries[0]
    assert [int(f[SOURCE_SEQ_FIELD]) for f in entries[1:]] == list(range(batches))
    assert [f[b"batch"] for f in entries[1:]] == published
    assert [int(f[b"seq"]) for f in entries] == list(range(len(entries)))
    expected = direct_index(published)
    assert len(expected) > 200
    asyncio.run(check_indexes(redis_url, prefix, expected))


def direct_index(payloads: list[bytes]) -> dict[int, int]:
    """The index built from the batches themselves, event by event (byte hashes turned into
    ints by vLLM's own rule: int.from_bytes(digest, "big") & (2**64 - 1))."""
    counts: dict[int, int] = {}
    for payload in payloads:
        for event in decode_batch(payload).events:
            if isinstance(event, AllBlocksCleared):
                counts.clear()
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


async def check_indexes(url: str, prefix: str, expected: dict[int, int]) -> None:
    r = redis_streams.connect(url)
    try:
        for mode in ("start", "snapshot"):
            sub = KVEventSubscriber(r, prefix, replica="vllm-0")
            await sub.start(mode)
            while await sub.poll(block_ms=None):
                pass
            assert dict(sub.index.counts) == expected, mode
    finally:
        await r.aclose()
