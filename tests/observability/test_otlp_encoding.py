"""kvledger's OTLP encoder writes the protobuf bytes itself (the SDK's encoder cost more than the
spans): what it writes must parse to exactly the message the SDK's own encoder builds, for every
kind of value, event, link, status, parent and grouping a span can have."""

from __future__ import annotations

import time

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

from observability.otlp_encoding import encode_spans

REMOTE = SpanContext(
    0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True,
    trace_flags=TraceFlags(1), trace_state=TraceState([("vendor", "x1"), ("other", "y")]),
)  # fmt: skip


def spans_of_every_shape():
    exporter = InMemorySpanExporter()
    limits = SpanLimits(max_attributes=12, max_events=4, max_links=3, max_event_attributes=4)
    providers = [
        TracerProvider(resource=Resource.create({"service.name": name}), span_limits=limits)
        for name in ("kvledger-gateway", "kvledger-ledger")
    ]
    for provider in providers:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    gateway = providers[0].get_tracer("kvledger", "1.2.3")
    other_scope = providers[0].get_tracer("aiohttp")
    ledger = providers[1].get_tracer("kvledger")
    with gateway.start_as_current_span("POST /v1/completions", kind=SpanKind.SERVER) as root:
        root.set_attributes(
            {
                "s": "text ü ✓", "empty": "", "t": True, "f": False, "i": 7, "neg": -3,
                "big": 2**63 - 1, "zero": 0, "x": 0.25, "nan_not": -1.5e300,
                "strs": ["a", "b"], "ints": [1, -2, 3], "floats": [0.5], "bools": [True, False],
                "dropped": 1,  # past max_attributes: counted as dropped
            }
        )  # fmt: skip
        root.add_event("e1", {"k": 1, "t": True, "i": 7, "l": [1, 2]}, timestamp=123)
        root.add_event("e0", {"k": True, "t": 1}, timestamp=124)  # True == 1 as dict keys
        root.add_event("e2")
        for i in range(4):  # one past max_events
            root.add_event(f"n{i}", {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5})  # past the limit
        root.set_status(Status(StatusCode.ERROR, "it broke"))
        child = gateway.start_span(
            "text_completion m",
            links=[Link(REMOTE, {"kvledger.request_id": "r1"}), Link(REMOTE)],
            attributes={"n": 1, "b": True},  # the ledger's spans swap them: True == 1 as keys
        )
        child.set_status(Status(StatusCode.OK))
        child.end()
        other_scope.start_span("GET /health", kind=SpanKind.CLIENT).end()
    remote_parent = set_span_in_context(NonRecordingSpan(REMOTE))
    for kind in (SpanKind.INTERNAL, SpanKind.PRODUCER, SpanKind.CONSUMER):
        span = ledger.start_span(
            "kvledger.queue", context=remote_parent, kind=kind, start_time=time.time_ns() - 5,
            attributes={"n": True, "b": 1},
        )  # fmt: skip
        for i in range(5):  # past max_links
            span.add_link(REMOTE, {"i": i})
        span.end()
    return exporter.get_finished_spans()


def test_the_bytes_parse_to_the_message_the_sdks_encoder_builds():
    spans = spans_of_every_shape()
    assert len(spans) == 6
    ours = ExportTraceServiceRequest.FromString(encode_spans(spans))
    theirs = sdk_encode(spans)
    assert ours == theirs
    assert len(ours.resource_spans) == 2
    assert [len(r.scope_spans) for r in ours.resource_spans] == [2, 1]
    assert ours.resource_spans[0].scope_spans[0].scope.version == "1.2.3"


def test_one_span_and_no_span():
    spans = spans_of_every_shape()[:1]
    assert ExportTraceServiceRequest.FromString(encode_spans(spans)) == sdk_encode(spans)
    assert encode_spans([]) == b""
