"""The fault-injection stack: `kvledger up` (supervising a ledger, a worker and a gateway) on a
redis-server this suite owns, so it can kill, restart and pause any of them; a steady load of
streaming and non-streaming greedy completions checked against a quiet run.

`-m faults` runs the full set; without -m only the tests not marked `faults` run (the short
version). Each fault states its bound: every request sent while it happens ends (the right
text, or an explicit error) within `BOUND_S` of being sent.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from services.transport.redis_server import _ping, find_redis_server, free_port
from tests.e2e.conftest import Served, launch, metric_value
from tests.harness.fixtures import redis_url, tiny_model

__all__ = ["redis_url", "tiny_model"]  # for the fault tests that run the stack in process

BOUND_S = 45.0  # a request in flight during a fault ends within this (recovery + recompute)
MODEL = "kvledger-tiny-llama"
PROMPTS = [f"fault {i}: the KV cache pages " + "x" * (i % 7) for i in range(8)]
MAX_TOKENS = 8


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.option.markexpr:  # -m given: pytest selects by it
        return
    full = [item for item in items if item.get_closest_marker("faults")]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if not item.get_closest_marker("faults")]


class Redis:
    """A redis-server on a fixed port that can be killed, restarted (its data kept only with
    AOF) and paused."""

    def __init__(self, aof: bool) -> None:
        self.port = free_port()
        self.aof = aof
        self.dir = tempfile.TemporaryDirectory(prefix="kvledger-faults-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> Redis:
        aof = (
            ["--appendonly", "yes", "--appendfsync", "always"]
            if self.aof
            else ["--appendonly", "no"]
        )
        self.process = subprocess.Popen(
            [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             *aof, "--dir", self.dir.name, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not _ping(self.port):
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def restart(self, keep_data: bool) -> None:
        self.kill()
        if not keep_data:
            for name in os.listdir(self.dir.name):
                path = os.path.join(self.dir.name, name)
                if os.path.isdir(path):
                    for inner in os.listdir(path):
                        os.remove(os.path.join(path, inner))
                else:
                    os.remove(path)
        self.start()

    def pause(self, seconds: float) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        time.sleep(seconds)
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.dir.cleanup()


@dataclass
class Outcome:
    prompt: int
    stream: bool
    sent: float
    ended: float = 0.0
    text: str | None = None  # None: an explicit error
    error: str = ""


def complete(url: str, prompt: int, stream: bool, timeout: float = BOUND_S) -> Outcome:
    out = Outcome(prompt, stream, time.monotonic())
    body = {"model": MODEL, "prompt": PROMPTS[prompt], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": stream}  # fmt: skip
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            raw = resp.read().decode()
        if stream:
            text = ""
            for line in raw.splitlines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out.error = json.dumps(chunk["error"])
                        break
                    text += "".join(c["text"] for c in chunk["choices"])
            out.text = None if out.error else text
            if not out.error and "data: [DONE]" not in raw:
                out.text, out.error = None, "the stream ended without [DONE]"
        else:
            out.text = json.loads(raw)["choices"][0]["text"]
    except urllib.error.HTTPError as exc:
        out.error = f"HTTP {exc.code}: {exc.read()[:200]!r}"
    except (TimeoutError, OSError) as exc:  # a hang (timeout) or a dropped connection
        out.error = f"{type(exc).__name__}: {exc}"
    out.ended = time.monotonic()
    return out


@dataclass
class Load:
    """`clients` threads sending completions back to back, alternating stream and not."""

    url: str
    clients: int = 4
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        for i in range(self.clients):
            thread = threading.Thread(target=self._client, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _client(self, i: int) -> None:
        n = i
        while not self._stop.is_set():
            self.outcomes.append(complete(self.url, n % len(PROMPTS), stream=n % 2 == 1))
            n += self.clients

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=BOUND_S + 10)
            assert not thread.is_alive(), "a client is still waiting: a request hung"


def expected_texts(url: str) -> dict[int, str]:
    """The quiet run: each prompt once, alone."""
    texts = {}
    for i in range(len(PROMPTS)):
        out = complete(url, i, stream=False)
        assert out.text is not None, out.error
        texts[i] = out.text
    return texts


def check(outcomes: list[Outcome], expected: dict[int, str]) -> dict[str, float]:
    """Every request: the quiet run's text, or an explicit error; none past the bound."""
    assert outcomes, "the load sent nothing"
    wrong = [o for o in outcomes if o.text is not None and o.text != expected[o.prompt]]
    assert not wrong, f"answers that differ from the quiet run: {wrong[:3]}"
    slow = [o for o in outcomes if o.ended - o.sent > BOUND_S]
    assert not slow, f"requests that took longer than {BOUND_S}s: {slow[:3]}"
    hangs = [o for o in outcomes if o.text is None and "timed out" in o.error]
    assert not hangs, f"requests that hung: {hangs[:3]}"
    errors = [o for o in outcomes if o.text is None]
    return {
        "requests": len(outcomes),
        "errors": len(errors),
        "max_s": round(max(o.ended - o.sent for o in outcomes), 2),
    }


def children(served: Served) -> dict[str, int]:
    """`kvledger up`'s children by role: {'ledger': pid, 'worker': pid, 'gateway': pid}."""
    out = subprocess.run(
        ["ps", "-o", "pid=,args=", "--ppid", str(served.process.pid)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    found = {}
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        parts = args.split()
        if "kvledger.cli" in parts:
            found[parts[parts.index("kvledger.cli") + 1]] = int(pid)
    return found


def wait_recovered(served: Served, expected: dict[int, str], timeout: float = 60.0) -> float:
    """Seconds until the stack answers right again and its ledger holds no block."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        out = complete(served.url, 0, stream=False, timeout=10)
        if out.text == expected[0]:
            break
        assert time.monotonic() < deadline, f"not serving again within {timeout}s: {out.error}"
        time.sleep(0.5)
    recovered = time.monotonic() - started
    while True:
        with contextlib.suppress(OSError, AssertionError):
            text = urllib.request.urlopen(served.ledger_metrics_url, timeout=5).read().decode()
            if (
                metric_value(text, "vllm:kv_cache_usage_perc") == 0
                and metric_value(text, "vllm:num_requests_running") == 0
                and metric_value(text, "vllm:num_requests_waiting") == 0
            ):
                return recovered
        assert time.monotonic() < deadline, "blocks still in use after the load ended"
        time.sleep(0.5)


@contextlib.contextmanager
def fault_stack(
    aof: bool = False, env: dict[str, str] | None = None, num_gpu_blocks: int = 256
) -> Iterator[tuple[Served, Redis]]:
    redis = Redis(aof).start()
    served = launch(
        "tiny", num_gpu_blocks=num_gpu_blocks, max_model_len=128,
        env={"KVLEDGER_REDIS_URL": redis.url, "KVLEDGER_REQUEST_TIMEOUT": str(BOUND_S - 5),
             **(env or {})},
    )  # fmt: skip
    try:
        served.wait_until_serving()
        yield served, redis
    finally:
        served.stop()
        redis.stop()
