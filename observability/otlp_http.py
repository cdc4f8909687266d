"""The OTLP/HTTP exporter's transport to a plain-HTTP collector: one kept-alive `http.client`
connection, in place of the SDK's default (requests), which costs ~4x the CPU a POST (~0.5 ms
against ~0.13), and every traced process exports every 5 s.

Used only where it sends what requests would (`plain_http_transport`): an http:// endpoint (no
certificates to find), no proxy for it in the environment, no .netrc login for it, no credential
provider. The SDK's client keeps its retries, timeouts, headers and compression: this is only
the wire. Imported only when tracing is on.
"""

from __future__ import annotations

import http.client
import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.exporter.http.transport._base import BaseHTTPResult, BaseHTTPTransport

_CREDENTIAL_PROVIDERS = (
    "OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER",
    "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER",
)


def plain_http_transport(endpoint: str) -> BaseHTTPTransport | None:
    """A KeptAliveTransport where it sends what the SDK's default would, else None."""
    if urlsplit(endpoint).scheme != "http" or any(os.environ.get(n) for n in _CREDENTIAL_PROVIDERS):
        return None
    try:
        from requests.utils import get_environ_proxies, get_netrc_auth
    except ImportError:
        return None
    if get_environ_proxies(endpoint) or get_netrc_auth(endpoint):
        return None
    return KeptAliveTransport()


@dataclass(frozen=True, slots=True)
class _Result(BaseHTTPResult):
    body: bytes = b""
    raw_headers: list[tuple[str, str]] = field(default_factory=list, hash=False, compare=False)

    def content(self) -> bytes:
        return self.body

    def headers(self) -> Mapping[str, str]:
        """Case-insensitive; a header sent twice is one comma-separated value (as the SDK's
        transports give them). Built only when asked: the client reads Retry-After on errors."""
        from requests.structures import CaseInsensitiveDict

        merged: CaseInsensitiveDict[str] = CaseInsensitiveDict()
        for name, value in self.raw_headers:
            merged[name] = f"{merged[name]}, {value}" if name in merged else value
        return merged


class _ConnectFailed(ConnectionError):
    """The connection could not be made (a timeout or a name that does not resolve included)."""


class KeptAliveTransport(BaseHTTPTransport):
    """POSTs over one HTTP/1.1 connection, made again when the server closed it or it failed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the batch processor's thread and force_flush
        self._conn: http.client.HTTPConnection | None = None
        self._origin: tuple[str, int] | None = None

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        data: bytes | None = None,
    ) -> BaseHTTPResult:
        parts = urlsplit(url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        with self._lock:
            try:
                conn = self._connection(parts.hostname or "", parts.port or 80, timeout)
                conn.request(method, path, body=data, headers=headers or {})
                response = conn.getresponse()
                body = response.read()
            except (OSError, http.client.HTTPException) as error:
                self._drop()
                return _Result(error=error)
            if response.will_close:  # http.client has closed it; the next request reconnects
                self._drop()
            return _Result(
                status_code=response.status,
                reason=response.reason,
                body=body,
                raw_headers=response.getheaders(),
            )

    def _connection(
        self, host: str, port: int, timeout: float | None
    ) -> http.client.HTTPConnection:
        conn = self._conn
        if conn is None or self._origin != (host, port):
            self._drop()
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
            try:
                conn.connect()
            except (OSError, http.client.HTTPException) as error:
                conn.close()
                raise _ConnectFailed(str(error)) from error
            self._conn, self._origin = conn, (host, port)
        elif conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = self._origin = None

    def is_connection_error(self, exception: Exception | None) -> bool:
        """A connection that could not be made, or one the server dropped (a kept-alive
        connection gone stale): the client then retries at once, as with urllib3's."""
        return isinstance(
            exception, (ConnectionError, http.client.RemoteDisconnected, socket.gaierror)
        )

    def close(self) -> None:
        with self._lock:
            self._drop()


def exporter_kwargs(endpoint: str) -> dict[str, Any]:
    """The `_transport` the SDK's OTLPSpanExporter takes, where plain_http_transport applies."""
    transport = plain_http_transport(endpoint)
    return {"_transport": transport} if transport is not None else {}
