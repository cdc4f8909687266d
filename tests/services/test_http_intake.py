"""The intake in front of an HTTP service (services.http_server.Intake, under CappedSite): a burst
of connections that all become readable at once reaches the handlers a few connections per loop
turn, in order of arrival, with reads (GET) handed over at once; bytes that waited are delivered
whole and in order, and a connection lost while it waits costs nothing."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections import Counter

from aiohttp import web

from services.http_server import INTAKE_PER_TURN, CappedSite, ConnectionCap

BURST = 100  # below the listening backlog: every connection is made before any is read


class Turns:
    """Counts the event loop's turns: a task that yields once per turn."""

    def __init__(self) -> None:
        self.count = 0
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(0)

    def stop(self) -> None:
        self._task.cancel()


async def _serve(app: web.Application) -> tuple[web.AppRunner, CappedSite]:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = CappedSite(runner, "127.0.0.1", 0, max_connections=1000)
    await site.start()
    return runner, site


def _post(body: bytes = b"{}") -> bytes:
    return (
        b"POST /work HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


HEALTH = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def _read_response(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"ok"):
        chunk = await loop.sock_recv(sock, 65536)
        if not chunk:
            break
        data += chunk
    return data


async def test_a_burst_reaches_the_handlers_a_few_a_turn_and_a_read_goes_first():
    turns = Turns()
    started: list[tuple[str, int]] = []

    async def work(request: web.Request) -> web.Response:
        started.append(("post", turns.count))
        await request.read()
        return web.Response(text="ok")

    async def health(_: web.Request) -> web.Response:
        started.append(("health", turns.count))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/work", work)
    app.router.add_get("/health", health)
    runner, site = await _serve(app)
    socks: list[socket.socket] = []
    try:
        for _ in range(BURST + 1):  # the kernel completes each handshake; accept() comes later
            socks.append(socket.create_connection(("127.0.0.1", site.port)))
        assert site.cap is not None
        await _until(lambda: site.cap.accepted == BURST + 1)
        # Every request written before the server reads any: they all become readable in the
        # same turn, the health check last.
        for sock in socks[:BURST]:
            sock.sendall(_post())
        socks[BURST].sendall(HEALTH)
        for sock in socks:
            sock.setblocking(False)
        answers = await asyncio.gather(*(_read_response(sock) for sock in socks))
    finally:
        turns.stop()
        for sock in socks:
            sock.close()
        await runner.cleanup()

    assert all(answer.startswith(b"HTTP/1.1 200 ") for answer in answers)
    assert len(started) == BURST + 1
    per_turn = Counter(turn for _, turn in started)
    # At most INTAKE_PER_TURN connections handed over between two of the intake's turns, which
    # may straddle one of the loop's: twice that in one turn at the most (all 101 at once before).
    assert max(per_turn.values()) <= 2 * INTAKE_PER_TURN + 1, per_turn
    assert len(per_turn) >= BURST // (2 * INTAKE_PER_TURN)
    # The read went first, though it came last (101st before).
    rank = [kind for kind, _ in started].index("health")
    assert rank <= 2 * INTAKE_PER_TURN, started


async def test_bytes_that_wait_are_delivered_whole_in_order_and_a_lost_connection_is_dropped():
    bodies: list[bytes] = []

    async def work(request: web.Request) -> web.Response:
        bodies.append(await request.read())
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/work", work)
    runner, site = await _serve(app)
    socks: list[socket.socket] = []
    try:
        for _ in range(BURST):
            socks.append(socket.create_connection(("127.0.0.1", site.port)))
        assert site.cap is not None
        await _until(lambda: site.cap.accepted == BURST)
        # Each request in two writes (headers, then the body); the last 10 clients leave at once.
        expected = []
        for i, sock in enumerate(socks):
            body = b'{"i": %d, "pad": "%s"}' % (i, b"x" * 2000)
            request = _post(body)
            sock.sendall(request[:40])
            sock.sendall(request[40:])
            if i < BURST - 10:
                expected.append(body)
        for sock in socks[BURST - 10 :]:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # a reset: the connection is lost while its bytes may wait
        kept = socks[: BURST - 10]
        for sock in kept:
            sock.setblocking(False)
        answers = await asyncio.gather(*(_read_response(sock) for sock in kept))
        assert all(answer.startswith(b"HTTP/1.1 200 ") for answer in answers)
        assert sorted(b for b in bodies if b in expected) == sorted(expected)
        await _until(lambda: site.cap.open == BURST - 10)  # the lost ones are released
    finally:
        for sock in socks:
            sock.close()
        await runner.cleanup()


class _Echo(asyncio.Protocol):
    """A server protocol of its own under the intake: echoes, and fails on b"boom"."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if data == b"boom":
            raise RuntimeError("boom")
        self.transport.write(data)  # type: ignore[attr-defined]


async def test_a_connection_whose_waiting_bytes_fail_the_server_ends_and_the_others_go_on():
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: errors.append(context))
    cap = ConnectionCap(_Echo, max_connections=1000)
    server = await loop.create_server(cap, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(3 * INTAKE_PER_TURN)]
    try:
        await _until(lambda: cap.accepted == len(socks))
        for i, sock in enumerate(socks):  # the failing one waits for a later turn
            sock.sendall(b"boom" if i == 2 * INTAKE_PER_TURN else b"x%d" % i)
        for sock in socks:
            sock.setblocking(False)

        async def read(sock: socket.socket) -> bytes:
            try:
                return await asyncio.wait_for(loop.sock_recv(sock, 100), 5.0)
            except ConnectionResetError:
                return b""

        answers = await asyncio.gather(*(read(sock) for sock in socks))
    finally:
        loop.set_exception_handler(previous)
        for sock in socks:
            sock.close()
        server.close()
    assert answers[2 * INTAKE_PER_TURN] == b""  # its connection ended
    expected = [b"x%d" % i for i in range(len(socks)) if i != 2 * INTAKE_PER_TURN]
    assert [a for i, a in enumerate(answers) if i != 2 * INTAKE_PER_TURN] == expected
    assert [str(e.get("exception")) for e in errors] == ["boom"]
