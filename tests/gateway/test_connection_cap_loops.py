"""The connection cap of `kvledger gateway` as a real process, on each event loop it runs on:
uvloop (the default, KVLEDGER_EVENT_LOOP unset) and asyncio's own. With every slot held by an
idle connection, each further client reads an explicit 503 with Retry-After (not a reset), and
once the idle ones leave the gateway serves again."""

from __future__ import annotations

import json
import socket
import time

import pytest

from services.transport.redis_server import RedisServer, free_port
from tests.e2e.conftest import _hermetic_env
from tests.harness.processes import ServiceProcess

CAP = 8
EXTRA_CLIENTS = 5


def _request(port: int, timeout_s: float = 10.0) -> bytes:
    """GET /health on a fresh connection; everything the server sends before it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def _listening(gateway: ServiceProcess, port: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert gateway.process is not None and gateway.process.poll() is None, gateway.output()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"the gateway never listened:\n{gateway.output()}"
            time.sleep(0.1)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_every_client_past_the_cap_reads_a_503_with_retry_after(loop):
    with RedisServer() as redis:
        port = free_port()
        env = {
            **_hermetic_env(), "KVLEDGER_REDIS_URL": redis.url, "KVLEDGER_PORT": str(port),
            "KVLEDGER_MAX_CONNECTIONS": str(CAP), "KVLEDGER_HEADER_TIMEOUT_S": "30",
        }  # fmt: skip
        if loop == "asyncio":
            env["KVLEDGER_EVENT_LOOP"] = "asyncio"  # unset: uvloop, the default
        gateway = ServiceProcess("gateway", env).start()
        held: list[socket.socket] = []
        try:
            _listening(gateway, port)
            assert _request(port).startswith(b"HTTP/1.1 "), "the gateway does not answer"
            for _ in range(CAP):  # every slot taken by a client that sends nothing
                held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            time.sleep(0.5)  # the server has accepted them all
            for _ in range(EXTRA_CLIENTS):
                answer = _request(port)
                head, _, body = answer.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 503 "), (answer[:200], gateway.output())
                assert b"\r\nRetry-After: 1\r\n" in head + b"\r\n", head
                assert "connection cap" in json.loads(body)["error"]["message"]
            refusals = gateway.records("connection_refused")
            assert refusals and refusals[0]["open_connections"] == CAP, gateway.output()
            assert "AssertionError" not in gateway.output(400), gateway.output(400)
            for sock in held:
                sock.close()
            held.clear()
            # With the idle clients gone the gateway itself answers again (/health without a
            # ledger: its own 503 body, not the cap's).
            deadline = time.monotonic() + 10
            while "connection cap" in (answer := _request(port)).decode(errors="replace"):
                assert time.monotonic() < deadline, "still refused after the idle clients left"
                time.sleep(0.1)
            assert json.loads(answer.partition(b"\r\n\r\n")[2])["status"] == "unavailable"
        finally:
            for sock in held:
                sock.close()
            gateway.stop()
