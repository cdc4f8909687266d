"""KV events over ZMQ against vLLM 0.33 itself (tests/oracle/vllm_zmq_driver.py runs in vLLM's
venv): a subscriber built on vLLM's own decoder, checked first against vLLM's own
ZmqEventPublisher, reads a kvledger ledger's ZMQ output and gets exactly the Redis stream's
batches, in order, with no gap: from the start, joining late, missing batches on purpose, and
across a failover to a new ledger."""

from __future__ import annotations

import asyncio
import json
import queue
import subprocess
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest

from services.config import KVEventsConfig
from services.transport.redis_server import free_port
from tests.harness.fixtures import redis_url, tiny_model
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
        # The one that missed every third batch filled each gap by replay; the late one started
        # from a replay of everything before it.
        assert summaries["misses"]["skipped"] >= last // 4 and summaries["misses"]["replays"] > 3
        assert summaries["late"]["first"] == 0 and summaries["late"]["replays"] >= 1
    finally:
        await stack.stop()
