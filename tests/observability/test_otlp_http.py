"""The OTLP/HTTP transport to a plain-HTTP collector (observability.otlp_http): spans arrive over
one kept-alive connection, a server that closes connections or goes away is reconnected to or
reported as the SDK's client expects, and it is used only where it sends what requests would."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from observability.otlp_encoding import fast_otlp_http_exporter
from observability.otlp_http import KeptAliveTransport, plain_http_transport
from observability.tracing import lean_tracer


@contextmanager
def collector(
    protocol: str, status: int = 200, drop: bool = False
) -> Iterator[tuple[str, list, set]]:
    """A server answering every POST with `status`: (its URL, the bodies, the client ports).
    `drop`: it closes each connection after answering without saying so (a stale keep-alive)."""
    bodies: list[bytes] = []
    ports: set[int] = set()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = protocol

        def do_POST(self) -> None:
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            ports.add(self.client_address[1])
            self.send_response(status)
            self.send_header("Retry-After", "0")
            self.send_header("Content-Length", "0")
            self.end_headers()
            self.close_connection = drop

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", bodies, ports
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("protocol", ["HTTP/1.1", "HTTP/1.0"])
def test_spans_arrive_over_one_connection_while_the_server_keeps_it(protocol, monkeypatch):
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    with collector(protocol) as (url, bodies, ports):
        exporter = fast_otlp_http_exporter(url)
        assert isinstance(exporter._client._transport, KeptAliveTransport)
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = lean_tracer(provider.get_tracer("t"))
        for i in range(5):
            tracer.start_span(f"s{i}").end()
        provider.shutdown()
    assert len(bodies) == 5 and all(b"s" in body for body in bodies)
    # HTTP/1.1 keeps the connection; an HTTP/1.0 server closes it and each POST reconnects
    assert len(ports) == (1 if protocol == "HTTP/1.1" else 5)


def test_a_stale_connection_is_a_connection_error_the_client_retries():
    with collector("HTTP/1.1", drop=True) as (url, bodies, _):
        transport = KeptAliveTransport()
        assert transport.request("POST", url, data=b"x", timeout=5).status_code == 200
        time.sleep(0.2)  # the server has closed the connection the transport keeps
        result = transport.request("POST", url, data=b"x", timeout=5)
        assert result.status_code is None and transport.is_connection_error(result.error)
        assert transport.request("POST", url, data=b"x", timeout=5).status_code == 200  # anew
        # and through the SDK's client, which retries a connection error at once: no failure
        exporter = fast_otlp_http_exporter(url)
        exporter._client._transport = transport
        time.sleep(0.2)
        assert exporter._client.export(b"y").success
    assert bodies[-1] == b"y"
    with socket.socket() as probe:  # a port nobody listens on: refused
        probe.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{probe.getsockname()[1]}/v1/traces"
    result = transport.request("POST", refused, data=b"x", timeout=5)
    assert transport.is_connection_error(result.error)
    transport.close()


def test_an_error_status_comes_back_with_its_headers():
    with collector("HTTP/1.1", status=503) as (url, _, _):
        result = KeptAliveTransport().request("POST", url, data=b"x", timeout=5)
    assert result.status_code == 503
    assert result.headers()["retry-after"] == "0" == result.headers()["Retry-After"]


def test_only_where_requests_would_send_the_same(monkeypatch, tmp_path):
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    url = "http://collector:4318/v1/traces"
    assert isinstance(plain_http_transport(url), KeptAliveTransport)
    assert plain_http_transport("https://collector:4318/v1/traces") is None  # certificates
    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    assert plain_http_transport(url) is None
    monkeypatch.setenv("NO_PROXY", "collector")
    assert isinstance(plain_http_transport(url), KeptAliveTransport)
    (tmp_path / "netrc").write_text("machine collector login u password p\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert plain_http_transport(url) is None  # requests would log in
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER", "x")
    assert plain_http_transport(url) is None
