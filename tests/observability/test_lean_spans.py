"""Lean spans (observability.lean_spans) must export exactly what the SDK's spans export: the same
messages for every shape a span can take (limits, cleaning, events, links, status, parents), the
same sampling decisions, and the SDK's own tracer wherever lean could not be exact."""

from __future__ import annotations

import random

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider, sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    TraceFlags,
    get_current_span,
    get_tracer,
    set_span_in_context,
)

from observability.lean_spans import LeanSpan, LeanTracer
from observability.otlp_encoding import encode_spans
from observability.tracing import (
    Attr,
    inject_traceparent,
    kvledger_sampler,
    lean_tracer,
    never_sampled,
    record_root_span,
    span_context_from_traceparent,
)
from tests.observability import test_otlp_encoding as shapes


class CountingIds(IdGenerator):
    """The same ids in the same order for both tracers, so their messages can be compared."""

    def __init__(self) -> None:
        self.n = 0

    def generate_span_id(self) -> int:
        self.n += 1
        return self.n

    def generate_trace_id(self) -> int:
        self.n += 1
        return (0xABC << 64) | self.n


def _timeless(request: ExportTraceServiceRequest) -> ExportTraceServiceRequest:
    """Start, end and event times zeroed: the two runs read the clock at different moments."""
    for resource in request.resource_spans:
        for scope in resource.scope_spans:
            for span in scope.spans:
                span.start_time_unix_nano = span.end_time_unix_nano = 0
                for event in span.events:
                    event.time_unix_nano = 0
    return request


def _every_shape(monkeypatch, lean: bool):
    made = []
    real = TracerProvider

    def provider(*args, **kwargs):
        made.append(real(*args, id_generator=CountingIds(), **kwargs))
        return made[-1]

    monkeypatch.setattr(shapes, "TracerProvider", provider)
    if lean:
        original = real.get_tracer
        monkeypatch.setattr(
            real, "get_tracer", lambda self, *a, **k: lean_tracer(original(self, *a, **k))
        )
    return shapes.spans_of_every_shape()


def test_lean_spans_export_the_messages_the_sdks_spans_do(monkeypatch):
    sdk_spans = _every_shape(monkeypatch, lean=False)
    monkeypatch.undo()
    lean_spans = _every_shape(monkeypatch, lean=True)
    assert len(lean_spans) == len(sdk_spans) == 6
    theirs = _timeless(sdk_encode(sdk_spans))
    ours = _timeless(sdk_encode(lean_spans))
    assert ours == theirs
    # and kvledger's encoder writes the same message for lean spans
    assert _timeless(ExportTraceServiceRequest.FromString(encode_spans(lean_spans))) == theirs
    root = next(s for s in lean_spans if s.name == "POST /v1/completions")
    assert root.dropped_attributes == 3 and root.dropped_events == 3
    assert root.attributes["strs"] == ("a", "b")  # cleaned as the SDK cleans: tuples
    assert any(type(span._attributes) is dict for span in lean_spans)  # made lean indeed
    assert not any(type(span._attributes) is dict for span in sdk_spans)


def test_the_tracer_is_lean_only_where_it_can_be_exact():
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    tracer = lean_tracer(provider.get_tracer("t"))
    assert isinstance(tracer, LeanTracer)
    assert lean_tracer(tracer) is tracer
    assert isinstance(tracer.start_span("s"), LeanSpan)
    assert lean_tracer(None) is None
    noop = get_tracer("t")  # no provider: the API's no-op tracer
    assert lean_tracer(noop) is noop

    class WatchesStarts(SpanProcessor):
        def on_start(self, span, parent_context=None):
            span.set_attribute("seen", True)

    provider.add_span_processor(WatchesStarts())  # checked again after a processor is added
    span = tracer.start_span("s")
    assert not isinstance(span, LeanSpan)
    span.end()


def test_a_span_ended_twice_or_changed_after_its_end_exports_once():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    span = lean_tracer(provider.get_tracer("t")).start_span("s", attributes={"a": 1})
    span.end()
    span.set_attribute("b", 2)
    span.add_link(span.get_span_context())
    span.end()
    (exported,) = exporter.get_finished_spans()
    assert dict(exported.attributes) == {"a": 1} and exported.links == ()


def _sdk_sampler(name: str, ratio: float) -> sampling.Sampler:
    root = {
        "always_on": sampling.ALWAYS_ON,
        "always_off": sampling.ALWAYS_OFF,
        "traceidratio": sampling.TraceIdRatioBased(ratio),
    }[name.removeprefix("parentbased_")]
    return sampling.ParentBased(root) if name.startswith("parentbased_") else root


def test_the_samplers_decide_as_the_sdks_samplers_do():
    rng = random.Random(7)
    for name in ("parentbased_traceidratio", "traceidratio", "parentbased_always_on", "always_off"):
        ours, theirs = kvledger_sampler(name, "0.3"), _sdk_sampler(name, 0.3)
        for _ in range(400):
            trace_id = rng.getrandbits(128)
            parent = None
            if rng.random() < 0.7:
                parent = SpanContext(
                    trace_id, rng.getrandbits(64), is_remote=rng.random() < 0.5,
                    trace_flags=TraceFlags(rng.getrandbits(2)),
                )  # fmt: skip
            context = set_span_in_context(NonRecordingSpan(parent)) if parent else None
            expected = theirs.should_sample(context, trace_id, "s").decision.is_sampled()
            assert ours.should_sample(context, trace_id, "s").decision.is_sampled() == expected
            assert ours.decide(parent, trace_id) == expected
        # the rule for batches: a root linked to sampled work is kept; one that only says it
        # computed sampled requests is decided as any root (a step where they went on decoding)
        sampled = SpanContext(1, 2, is_remote=True, trace_flags=TraceFlags(1))
        unsampled = SpanContext(1, 3, is_remote=True, trace_flags=TraceFlags(0))
        dropped = (1 << 128) - 1  # above every ratio's bound
        assert ours.decide(None, dropped, links=[Link(unsampled), Link(sampled)])
        root = theirs.should_sample(None, dropped, "s").decision.is_sampled()
        assert ours.decide(None, dropped, links=[Link(unsampled)]) == root
        assert ours.decide(None, dropped, attributes={Attr.NUM_TRACED_REQUESTS: 2}) == root


def test_a_lean_tracer_follows_the_parents_flag_and_the_ratio():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=kvledger_sampler("parentbased_traceidratio", "0.5"))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = lean_tracer(provider.get_tracer("t"))
    for flags in (0, 1):
        parent = SpanContext(7, 8, is_remote=True, trace_flags=TraceFlags(flags))
        span = tracer.start_span("child", context=set_span_in_context(NonRecordingSpan(parent)))
        assert span.is_recording() == bool(flags)
        assert span.get_span_context().trace_id == 7
        span.end()
    kept = 0
    for _ in range(200):
        with tracer.start_as_current_span("root") as root:
            kept += root.get_span_context().trace_flags.sampled
    assert 60 < kept < 140
    assert len(exporter.get_finished_spans()) == 1 + kept


def test_never_sampled_never_says_so_of_a_sampled_traceparent():
    """The worker skips parsing what never_sampled rules out: it must agree with the parser."""
    rng = random.Random(3)
    trace_id, span_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    samples = [
        None,
        "",
        "garbage",
        b"00-x",
        f"00-{trace_id}-{span_id}",
        f"00-{trace_id}-{span_id}-01-extra",
    ]
    for flags in range(256):
        for version in ("00", "01", "cc", "ff"):
            samples.append(f"{version}-{trace_id}-{span_id}-{flags:02x}")
            samples.append(f"{version}-{trace_id}-{span_id}-{flags:02X}")
    samples += ["".join(rng.choice("0123456789abcdef-") for _ in range(55)) for _ in range(500)]
    for traceparent in samples:
        parsed = span_context_from_traceparent(traceparent)
        if never_sampled(traceparent):
            assert parsed is None or not parsed.trace_flags.sampled, traceparent
    assert never_sampled(f"00-{trace_id}-{span_id}-00")
    assert not never_sampled(f"00-{trace_id}-{span_id}-01")


def test_a_trace_left_out_costs_one_span_object_and_still_carries_its_trace_id():
    provider = TracerProvider(sampler=kvledger_sampler("parentbased_traceidratio", "0.5"))
    tracer = lean_tracer(provider.get_tracer("t"))
    seen = {True: 0, False: 0}
    for _ in range(100):
        with tracer.start_as_current_span("POST /v1/completions") as root:
            with tracer.start_as_current_span("text_completion m") as child:
                traceparent = inject_traceparent()
            assert get_current_span() is root  # the root is current again
        sampled = root.get_span_context().trace_flags.sampled
        seen[sampled] += 1
        assert child.get_span_context().trace_id == root.get_span_context().trace_id
        assert traceparent == inject_traceparent(child)
        assert int(traceparent[-2:], 16) & 1 == sampled  # the flags say whether it was kept
        # a sampled child is a span of its own; a left-out one is its parent's span
        assert (child is root) is not sampled
    assert seen[True] and seen[False]


def test_a_root_recorded_at_once_is_the_span_the_sdk_makes_and_builds_nothing_dropped(
    monkeypatch,
):
    exported = {}
    for lean in (False, True):
        exporter = InMemorySpanExporter()
        provider = TracerProvider(sampler=kvledger_sampler(), id_generator=CountingIds())
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = provider.get_tracer("t")
        tracer = lean_tracer(tracer) if lean else tracer
        linked = SpanContext(5, 6, is_remote=True, trace_flags=TraceFlags(1))
        context = record_root_span(
            tracer, "kvledger.step", kind=SpanKind.CONSUMER, start_ns=10, end_ns=20,
            links=[Link(linked, {Attr.REQUEST_ID: "r"})],
            sampling_attributes={Attr.NUM_TRACED_REQUESTS: 1},
            attributes=lambda: {"a": 1, Attr.NUM_TRACED_REQUESTS: 1, "b": ["x"]},
        )  # fmt: skip
        (span,) = exporter.get_finished_spans()
        assert context == span.get_span_context()
        exported[lean] = sdk_encode([span])
    assert exported[True] == exported[False]

    never = InMemorySpanExporter()
    provider = TracerProvider(sampler=kvledger_sampler("parentbased_traceidratio", "0"))
    provider.add_span_processor(SimpleSpanProcessor(never))

    def not_built() -> dict:
        raise AssertionError("the attributes of a dropped span were built")

    for tracer in (provider.get_tracer("t"), lean_tracer(provider.get_tracer("t"))):
        kept = record_root_span(
            tracer, "kvledger.step", kind=SpanKind.CONSUMER, start_ns=1, end_ns=2, links=[],
            sampling_attributes={Attr.NUM_TRACED_REQUESTS: 0}, attributes=not_built,
        )  # fmt: skip
        assert kept is None
    assert never.get_finished_spans() == ()
