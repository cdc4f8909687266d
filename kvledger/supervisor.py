"""Supervising `kvledger up`'s children: a child that exits is started again, after a capped
exponential backoff, until the operator stops the stack (Ctrl-C, SIGTERM, or SIGINT sent to a
background `kvledger up`).

Each child dies with the launcher, even a launcher killed with SIGKILL (services/lifeline.py):
the kernel's parent-death signal, and a pipe the child watches.

A crash loop backs off up to `max_backoff_s`; a child that stayed up `stable_after_s` starts
over from the shortest delay. Every restart is printed (one line: which child, its exit code,
the delay and how many restarts so far), so an operator sees a flapping service.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from services.lifeline import Lifeline

STOP_ORDER = ("gateway", "worker", "ledger")  # the gateway first: it aborts in-flight requests


@dataclass
class Child:
    role: str  # "ledger", "worker-r0", "gateway": the kind is the part before the first dash
    command: list[str]
    env: dict[str, str]
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    delay_s: float = 0.0  # the next restart's backoff
    restart_at: float | None = None  # when an exited child is due to start again
    exit_codes: list[int] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.role.split("-")[0]


def backoff_delay(previous_s: float, min_s: float, max_s: float) -> float:
    """Capped exponential: min, 2*min, 4*min, ... max."""
    return min_s if previous_s <= 0 else min(previous_s * 2, max_s)


class Supervisor:
    def __init__(
        self,
        children: Sequence[Child],
        *,
        min_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        stable_after_s: float = 30.0,
        out: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        lifeline: Lifeline | None = None,
    ) -> None:
        self.children = {c.role: c for c in children}
        self.lifeline = lifeline
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_after_s = stable_after_s
        self.out = out
        self.clock = clock
        self.stopping = False

    def start(self) -> None:
        for child in self.children.values():
            self._spawn(child)

    def request_stop(self, *_: object) -> None:
        self.stopping = True

    def install_signal_handlers(self) -> None:
        # SIGINT too: a shell starts a background job with SIGINT ignored, and Python then
        # installs no KeyboardInterrupt handler, so `kill -INT` would do nothing.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.request_stop)

    def exited(self) -> list[Child]:
        """Children that are not running now (exited and not yet restarted)."""
        return [
            c for c in self.children.values() if c.process is None or c.process.poll() is not None
        ]

    def poll(self) -> None:
        """Notice exits and schedule their restart; start the children whose delay is over."""
        now = self.clock()
        for child in self.children.values():
            if self.stopping:
                return
            process = child.process
            if process is not None and process.poll() is not None and child.restart_at is None:
                code = process.returncode
                child.exit_codes.append(code)
                if now - child.started_at >= self.stable_after_s:
                    child.delay_s = 0.0  # it ran long enough: not a crash loop
                child.delay_s = backoff_delay(child.delay_s, self.min_backoff_s, self.max_backoff_s)
                child.restart_at = now + child.delay_s
                self._say(
                    f"kvledger up: the {child.role} exited with code {code}; restarting it in "
                    f"{child.delay_s:g}s (restart {child.restarts + 1})"
                )
            if child.restart_at is not None and now >= child.restart_at:
                child.restarts += 1
                child.restart_at = None
                self._spawn(child)

    def run(self, interval_s: float = 0.2) -> None:
        """Supervise until a stop is requested."""
        while not self.stopping:
            self.poll()
            time.sleep(interval_s)

    def stop(self, timeout_s: float = 15.0) -> None:
        self.stopping = True
        for kind in STOP_ORDER:
            for child in self.children.values():
                if (
                    child.kind == kind
                    and child.process is not None
                    and child.process.poll() is None
                ):
                    child.process.send_signal(signal.SIGTERM)
        for child in self.children.values():
            if child.process is None:
                continue
            try:
                child.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                child.process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.process.wait(timeout=5)

    def _spawn(self, child: Child) -> None:
        if self.lifeline is not None:
            child.process = subprocess.Popen(child.command, **self.lifeline.popen_kwargs(child.env))  # type: ignore[call-overload]
        else:
            child.process = subprocess.Popen(child.command, env=child.env)
        child.started_at = self.clock()

    def _say(self, line: str) -> None:
        print(line, file=self.out or sys.stderr, flush=True)
