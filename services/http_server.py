"""What keeps slow or numerous clients from exhausting an HTTP service (gateway, ledger metrics,
indexer): a deadline for a request's headers (aiohttp's keep-alive timer, which runs from the
moment a connection opens until its first request is parsed, and again between requests), a
short lingering read after a response that left a body unread, and a cap on open connections
beyond which a new one gets a 503 and is closed at once instead of holding a file descriptor.
The body's deadline is the handler's (`asyncio.timeout` around `request.read()`).
"""

from __future__ import annotations

import asyncio
import json
import resource
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web

MIN_CONNECTIONS = 64
LINGER_S = 1.0  # a refused client gets this long to read the 503 before the socket closes
INTAKE_PER_TURN = 8  # connections whose bytes reach the HTTP server in one loop turn
READ_REQUEST = b"GET "  # a read (/health, /metrics, a model card): handed over at once


@dataclass(frozen=True, slots=True)
class HttpLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int | None = None  # None: half the open-file limit (see connection_cap)


def raise_open_file_limit() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard one (as Go's runtime does): 1,024 descriptors
    is far below what a server under load holds. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(limits: HttpLimits) -> int:
    """The configured cap, or half the open-file limit: the other half stays for Redis
    connections, files and the listening sockets, so accept() never fails for want of one."""
    if limits.max_connections is not None:
        return max(1, limits.max_connections)
    return max(MIN_CONNECTIONS, raise_open_file_limit() // 2)


def runner_options(limits: HttpLimits) -> dict[str, Any]:
    """Keyword arguments for `web.AppRunner` that bound how long a connection may sit idle or
    send its headers (aiohttp's default keep-alive is an hour)."""
    return {"keepalive_timeout": limits.header_timeout_s, "lingering_time": LINGER_S}


class ConnectionCap:
    """A protocol factory in front of aiohttp's: counts open connections and answers those
    beyond `max_connections` with a 503 before closing them."""

    def __init__(
        self,
        factory: Callable[[], asyncio.BaseProtocol],
        max_connections: int,
        on_refused: Callable[[int], object] | None = None,
    ) -> None:
        self._factory = factory
        self.max_connections = max_connections
        self.open = 0
        self.accepted = 0  # connections ever admitted
        self.refused = 0
        self._on_refused = on_refused
        self.intake = Intake()

    def __call__(self) -> asyncio.BaseProtocol:
        if self.open >= self.max_connections:
            self.refused += 1
            if self._on_refused is not None:
                self._on_refused(self.open)
            return _Refusal(self.max_connections)
        self.open += 1
        self.accepted += 1
        return _Counted(self._factory(), self._release, self.intake)

    def _release(self) -> None:
        self.open -= 1


class Intake:
    """Hands the bytes connections receive to the HTTP server, at most `per_turn` connections'
    in one turn of the event loop; the others wait in order of arrival for the next turns.
    Reads (`GET `) on a connection with nothing waiting are handed over at once.

    Why: an asyncio loop runs, in one turn, every callback that became ready before it. When a
    burst's connections all become readable together, each request's first step (routing, the
    admission check, a 429 written and logged, a body parsed) lands in the same turn, and that
    turn lasts as long as the burst is large: 750 requests at ~0.3 ms is a quarter second of
    CPU, during which /health, a few turns of its own, cannot answer. Bounded, a turn holds
    `per_turn` requests' first steps and the health check goes first."""

    def __init__(self, per_turn: int = INTAKE_PER_TURN) -> None:
        self.per_turn = per_turn
        self.handed = 0  # this turn
        self.waiting: deque[_Counted] = deque()
        self._next_turn_scheduled = False

    def offer(self, conn: _Counted, data: bytes) -> None:
        if conn.backlog is None and (self.handed < self.per_turn or data.startswith(READ_REQUEST)):
            self.handed += 1
            self._count_turns()
            conn.hand_over(data)
            return
        if conn.backlog is None:
            conn.backlog = bytearray()
            self.waiting.append(conn)
        conn.backlog += data
        self._count_turns()

    def _count_turns(self) -> None:
        if not self._next_turn_scheduled:
            self._next_turn_scheduled = True
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._next_turn_scheduled = False
        self.handed = 0
        while self.waiting and self.handed < self.per_turn:
            conn = self.waiting.popleft()
            if conn.backlog is None:  # the connection was lost meanwhile
                continue
            self.handed += 1
            try:
                conn.hand_over_backlog()
            except Exception as exc:  # as a transport whose protocol fails: that connection ends
                conn.fail(exc)
        if self.waiting:
            self._count_turns()


class _Counted(asyncio.Protocol):
    """aiohttp's protocol, with one decrement when its connection ends, and its bytes handed
    over through the site's Intake."""

    def __init__(self, inner: Any, release: Callable[[], None], intake: Intake) -> None:
        self._inner = inner
        self._release: Callable[[], None] | None = release
        self._intake = intake
        self._transport: asyncio.WriteTransport | None = None
        self.backlog: bytearray | None = None  # bytes received, waiting for the intake
        self._eof_waiting = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.WriteTransport, transport)  # uvloop's is no subclass
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._intake.offer(self, data)

    def hand_over(self, data: bytes) -> None:
        self._inner.data_received(data)

    def hand_over_backlog(self) -> None:
        data, self.backlog = self.backlog, None
        if data:
            self._inner.data_received(bytes(data))
        if self._eof_waiting:
            self._eof_waiting = False
            if not self._inner.eof_received() and self._transport is not None:
                self._transport.close()

    def fail(self, exc: Exception) -> None:
        asyncio.get_running_loop().call_exception_handler(
            {"message": "the HTTP server failed on a connection's bytes", "exception": exc}
        )
        if self._transport is not None:
            self._transport.abort()

    def eof_received(self) -> bool | None:
        if self.backlog is not None:  # after the bytes that wait: keep the socket till then
            self._eof_waiting = True
            return True
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.backlog = None  # nobody is there to answer
        release, self._release = self._release, None
        if release is not None:
            release()
        self._inner.connection_lost(exc)


class _Refusal(asyncio.Protocol):
    """Writes one 503 and half-closes; the socket closes when the client does or after
    LINGER_S (closing at once with its request unread would reset the connection and lose
    the 503)."""

    def __init__(self, max_connections: int) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": f"the server already holds {max_connections} open connections "
                    "(its connection cap); retry after 1s",
                    "type": "ServiceUnavailableError",  # vLLM's type for a 503
                    "param": None,
                    "code": 503,
                }
            }
        ).encode()
        self._response = (
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport by its methods, not its class: uvloop's TCPTransport (the
        # services' default loop) is no subclass of asyncio.Transport, and an isinstance check
        # here failed every refusal into a reset.
        stream = cast(asyncio.WriteTransport, transport)
        stream.write(self._response)
        if stream.can_write_eof():
            stream.write_eof()
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, stream.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request is not read: it was refused before it arrived

    def eof_received(self) -> bool:
        return False  # close now

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()


class CappedSite(web.BaseSite):
    """web.TCPSite with a ConnectionCap in front of the runner's protocol factory."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        max_connections: int,
        on_refused: Callable[[int], object] | None = None,
        backlog: int = 128,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port = host, port
        self._max_connections = max_connections
        self._on_refused = on_refused
        self.cap: ConnectionCap | None = None
        self.port = port  # the bound port once started (useful with port 0)

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self.cap = ConnectionCap(server, self._max_connections, self._on_refused)
        self._server = await asyncio.get_running_loop().create_server(
            self.cap, self._host, self._port, backlog=self._backlog, reuse_address=True
        )
        if self._server.sockets:
            self.port = self._server.sockets[0].getsockname()[1]


def limits_of(config: Any) -> HttpLimits:
    """The limits of a service config that carries services.config.HttpServerConfig's fields."""
    return HttpLimits(config.header_timeout_s, config.body_timeout_s, config.max_connections)
