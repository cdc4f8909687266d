"""`kvledger up` in a subprocess, for tests that go through HTTP and every real process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from services.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]


class Served:
    """`with Served("--num-gpu-blocks-override", "24") as s: s.url` -> a serving stack."""

    def __init__(
        self, *flags: str, env: dict[str, str] | None = None, timeout: float = 120.0
    ) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.flags = [
            "--port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
            "--device",
            "cpu",
            *flags,
        ]
        self.env = dict(os.environ, KVLEDGER_LOG_FORMAT="json", **(env or {}))
        self.env.pop("KVLEDGER_REDIS_URL", None)
        self.timeout = timeout
        self.lines: list[str] = []
        self.capacity_line = ""
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._banner = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def __enter__(self) -> Served:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", *self.flags],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.timeout
        while not self._banner.wait(0.2):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError("kvledger up did not start:\n" + "".join(self.lines[-40:]))
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self.lines.append(line)
            if "KV cache size:" in line:
                self.capacity_line = line.strip()
            if "Press Ctrl-C to stop." in line:
                self._banner.set()

    def stop(self) -> int:
        """SIGTERM, as a supervisor would: services flush their spans and exit."""
        if self._proc is None:
            return 0
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        return self._proc.returncode

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_records(self) -> list[dict]:
        records = []
        for line in self.lines:
            if line.startswith("{"):
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return records


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample (the first whose labels include `labels`)."""
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            return float(match.group(2))
    raise KeyError(f"{name} {labels} not in the exposition")
