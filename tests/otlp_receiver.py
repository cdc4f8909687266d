"""An in-process OTLP/HTTP trace receiver for tests: POST /v1/traces on a free loopback port,
decoded with opentelemetry.proto into plain dicts (names, hex ids, attributes, links, resource).

    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        ...
        spans = receiver.wait_for_spans(3)
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan

# The proto's SpanKind numbers, named as opentelemetry.trace.SpanKind names them.
_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}

SpanDict = dict[str, Any]


class OtlpReceiver:
    """Collects every span posted to it; thread-safe, usable from sync and async tests."""

    def __init__(self) -> None:
        self._spans: list[SpanDict] = []
        self._changed = threading.Condition()
        self.requests = 0  # POSTs to /v1/traces, decoded or not
        self.errors: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        # A short poll interval: close() waits up to one interval for the serving thread.
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.02,), daemon=True, name="otlp-receiver"
        )

    @property
    def endpoint(self) -> str:
        """The base URL to put in OTEL_EXPORTER_OTLP_ENDPOINT."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def spans(self) -> list[SpanDict]:
        with self._changed:
            return list(self._spans)

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()

    def wait_for_spans(
        self,
        count: int = 1,
        *,
        timeout: float = 10.0,
        where: Callable[[SpanDict], bool] = lambda _: True,
    ) -> list[SpanDict]:
        """The spans matching `where`, once at least `count` arrived; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(matching := [s for s in self._spans if where(s)]) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"{len(matching)} of {count} spans after {timeout}s; received: "
                        f"{[s['name'] for s in self._spans]}; errors: {self.errors}"
                    )
                self._changed.wait(remaining)
            return matching

    def by_name(self, name: str) -> list[SpanDict]:
        return [span for span in self.spans if span["name"] == name]

    def clear(self) -> None:
        with self._changed:
            self._spans.clear()

    def _accept(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        spans = [
            span_to_dict(span, resource.resource.attributes, scope.scope.name)
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]
        with self._changed:
            self._spans.extend(spans)
            self._changed.notify_all()


def _handler_for(receiver: OtlpReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path.rstrip("/") != "/v1/traces":
                self._reply(404, b"only /v1/traces", "text/plain")
                return
            receiver.requests += 1
            try:
                body = _decompress(
                    self.rfile.read(int(self.headers.get("Content-Length", 0))),
                    self.headers.get("Content-Encoding", ""),
                )
                receiver._accept(body)
            except Exception as exc:  # recorded and answered 400, so a test can see why
                receiver.errors.append(f"{type(exc).__name__}: {exc}")
                self._reply(400, str(exc).encode(), "text/plain")
                return
            self._reply(
                200, ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf"
            )

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:  # keep test output clean
            pass

    return Handler


def _decompress(body: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    return body


def span_to_dict(span: PbSpan, resource_attributes: Any, scope_name: str) -> SpanDict:
    resource = attributes_to_dict(resource_attributes)
    return {
        "name": span.name,
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex() or None,
        "kind": _KINDS.get(span.kind, str(span.kind)),
        "start_ns": span.start_time_unix_nano,
        "end_ns": span.end_time_unix_nano,
        "attributes": attributes_to_dict(span.attributes),
        "events": [
            {
                "name": e.name,
                "time_ns": e.time_unix_nano,
                "attributes": attributes_to_dict(e.attributes),
            }
            for e in span.events
        ],
        "links": [
            {
                "trace_id": link.trace_id.hex(),
                "span_id": link.span_id.hex(),
                "attributes": attributes_to_dict(link.attributes),
            }
            for link in span.links
        ],
        "status": {
            "code": _STATUS.get(span.status.code, str(span.status.code)),
            "message": span.status.message,
        },
        "resource": resource,
        "service_name": resource.get("service.name"),
        "scope": scope_name,
    }


def attributes_to_dict(key_values: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in key_values}


def any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return None if kind is None else getattr(value, kind)
