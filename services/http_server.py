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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web

MIN_CONNECTIONS = 64
LINGER_S = 1.0  # a refused client gets this long to read the 503 before the socket closes


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

    def __call__(self) -> asyncio.BaseProtocol:
        if self.open >= self.max_connections:
            self.refused += 1
            if self._on_refused is not None:
                self._on_refused(self.open)
            return _Refusal(self.max_connections)
        self.open += 1
        self.accepted += 1
        return _Counted(self._factory(), self._release)

    def _release(self) -> None:
        self.open -= 1


class _Counted(asyncio.Protocol):
    """aiohttp's protocol, unchanged, with one decrement when its connection ends."""

    def __init__(self, inner: Any, release: Callable[[], None]) -> None:
        self._inner = inner
        self._release: Callable[[], None] | None = release

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
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
