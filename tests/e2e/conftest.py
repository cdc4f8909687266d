"""End-to-end tests: `kvledger up` as a subprocess, and the real gateway, ledger and worker in
process (`tests/harness/stack.py`, `gateway_stack.py`) for the tests that talk to them as clients do.

`serve(model_dir, ...)` starts `python -m kvledger.cli up` (private redis-server, ledger, worker,
gateway) on a free port, waits for its banner and a healthy gateway, yields a `Served` with the
base URL, and stops it with SIGTERM (SIGKILL to its process group if it hangs). `launch` and
`serving` do the same for several stacks that start side by side.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from services.transport.redis_server import free_port
from tests.harness.fixtures import redis_url, tiny_model

__all__ = ["redis_url", "tiny_model"]  # for the tests that run the stack in process

ROOT = Path(__file__).resolve().parents[2]
BANNER_END = "Press Ctrl-C to stop."
BANNER_METRICS = re.compile(r"^kvledger is serving .*\(metrics: (\S+)\)")


@dataclass
class Served:
    """One `kvledger up`: its gateway URL, the ledger's /metrics URL and everything it printed."""

    url: str
    process: subprocess.Popen
    command: str
    startup_timeout: float
    lines: list[str] = field(default_factory=list)
    ledger_metrics_url: str = ""  # live; the gateway's /metrics mirrors it once a second
    banner: threading.Event = field(default_factory=threading.Event)
    pump: threading.Thread | None = None

    def output(self, last: int = 200) -> str:
        return "".join(self.lines[-last:])

    def log_records(self, *events: str) -> list[dict]:
        """The services' JSON log records (KVLEDGER_LOG_FORMAT=json), of these events if given."""
        records = []
        for line in list(self.lines):
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and (not events or record.get("event") in events):
                    records.append(record)
        return records

    @property
    def capacity_line(self) -> str:
        return next((line.strip() for line in self.lines if "KV cache size:" in line), "")

    def wait_until_serving(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while not self.banner.wait(0.1):
            if self.process.poll() is not None:
                self._fail(f"exited with code {self.process.returncode} before its banner")
            if time.monotonic() > deadline:
                self._fail(f"printed no banner within {self.startup_timeout:.0f}s")
        if not self.ledger_metrics_url:
            self._fail("printed a banner without the ledger's metrics URL")
        # The banner means the ledger is serving; the gateway may still be binding its port.
        while _http_status(f"{self.url}/health") != 200:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self._fail(f"never answered GET {self.url}/health with 200")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # the launcher stops its children and Redis
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)  # the group launch() started
            self.process.wait(timeout=10)
        if self.pump is not None:
            self.pump.join(timeout=5)
        # Captured by pytest; shown only when a test of this stack failed.
        print(f"--- {self.command} ---\n{self.output()}")

    def _fail(self, why: str) -> None:
        pytest.fail(f"{self.command} {why}; its output:\n{self.output()}", pytrace=False)


def launch(
    model_dir: str | Path | None,
    *,
    num_gpu_blocks: int,
    max_model_len: int,
    block_size: int = 16,
    extra_args: tuple[str, ...] = (),
    startup_timeout: float = 90.0,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> Served:
    """Start `kvledger up` on the CPU (on `port`, or a free one) and return at once; `serving`
    waits for it and stops it. `model_dir` None: no --model flag, so the stack serves its
    default model."""
    port = port or free_port()
    flags = [
        *(["--model", str(model_dir)] if model_dir is not None else []),
        "--port",
        str(port),
        "--device",
        "cpu",
        "--num-gpu-blocks-override",
        str(num_gpu_blocks),
        "--max-model-len",
        str(max_model_len),
        "--block-size",
        str(block_size),
        "--startup-timeout",
        str(startup_timeout),
        *extra_args,
    ]
    process = subprocess.Popen(
        [sys.executable, "-m", "kvledger.cli", "up", *flags],
        cwd=ROOT,
        env={**_hermetic_env(), **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, so a kill reaches the children too
    )
    served = Served(
        f"http://127.0.0.1:{port}", process, f"kvledger up {' '.join(flags)}", startup_timeout
    )
    served.pump = threading.Thread(target=_pump, args=(served,), daemon=True)
    served.pump.start()
    return served


@contextlib.contextmanager
def serving(*stacks: Served) -> Iterator[tuple[Served, ...]]:
    """Wait until every launched stack serves, yield them, stop them all, and check each one
    exited cleanly (code 0) on SIGTERM."""
    try:
        for served in stacks:
            served.wait_until_serving()
        yield stacks
    finally:
        for served in stacks:
            served.stop()
    for served in stacks:
        assert served.process.returncode == 0, (
            f"{served.command} did not stop cleanly on SIGTERM (exit code "
            f"{served.process.returncode}):\n{served.output(60)}"
        )


@contextlib.contextmanager
def serve(model_dir: str | Path, **settings) -> Iterator[Served]:
    """`with serve(folder, num_gpu_blocks=40, max_model_len=96) as served: served.url`"""
    with serving(launch(model_dir, **settings)) as (served,):
        yield served


@pytest.fixture(autouse=True)
def one_torch_thread():
    # The transformers reference is tiny; one thread leaves the other core to the stack.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def metric_value(metrics_text: str, name: str) -> float:
    """One Prometheus sample name in a /metrics page, summed over its label sets."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    values = [float(v) for v in pattern.findall(metrics_text)]
    assert values, f"{name} is not on the /metrics page"
    return sum(values)


def _hermetic_env() -> dict[str, str]:
    # A KVLEDGER_REDIS_URL or an OTLP endpoint in the caller's shell would leak into the stack.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEDGER_", "OTEL_"))}
    env["KVLEDGER_LOG_FORMAT"] = "json"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _pump(served: Served) -> None:
    assert served.process.stdout is not None
    for line in served.process.stdout:
        served.lines.append(line)
        if found := BANNER_METRICS.search(line):
            served.ledger_metrics_url = found.group(1)
        if BANNER_END in line:
            served.banner.set()


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None
