"""One kvledger service (`python -m kvledger.cli ROLE`) as a child process with its output kept,
for the tests and benchmarks that run the services apart (real processes, kill -9, restarts).
`kvledger up` supervises its own children in `kvledger.supervisor`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class ServiceProcess:
    def __init__(
        self,
        role: str,
        env: dict[str, str],
        log_path: Path | None = None,
        keep_lines: int | None = None,
        root: Path = ROOT,
    ) -> None:
        """`log_path`: also append the output there; `keep_lines`: keep only the last lines
        (enough to say why a process died) instead of everything; `root`: the checkout whose
        code runs (another commit's, for a before/after benchmark)."""
        self.role, self.env, self.log_path, self.keep_lines = role, env, log_path, keep_lines
        self.root = root
        self.lines: list[str] = []
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> ServiceProcess:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvledger.cli", self.role],
            cwd=self.root, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        threading.Thread(target=self._pump, args=(self.process,), daemon=True).start()
        return self

    def _pump(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        log = self.log_path.open("a") if self.log_path is not None else None
        for line in process.stdout:
            if log is not None:
                log.write(line)
                log.flush()
            self.lines.append(line)
            if self.keep_lines is not None:
                del self.lines[: -self.keep_lines]

    def kill9(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self, timeout: float = 15) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def records(self, event: str) -> list[dict]:
        """The service's JSON log records (KVLEDGER_LOG_FORMAT=json) of one event."""
        found = []
        for line in list(self.lines):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("event") == event:
                found.append(record)
        return found

    def output(self, last: int = 40) -> str:
        return "".join(self.lines[-last:])
