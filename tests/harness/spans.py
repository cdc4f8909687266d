"""Spans for the tests that run the services in process: a real SDK tracer provider per service
(its own service.name, as the processes would have) exporting synchronously to memory, read back
as the same plain dicts `tests.otlp_receiver` decodes from OTLP, and helpers over those dicts
(traces by request, span trees as text) shared by the in-process and end-to-end tests."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer

from observability.tracing import MAX_LINKS, kvledger_sampler

SpanDict = dict[str, Any]


class SpanCollector:
    """`collector.tracer("kvledger-ledger")`: a tracer whose spans land in `collector.spans`."""

    def __init__(self, sampler: Any = None) -> None:
        self.exporter = InMemorySpanExporter()
        self.sampler = sampler if sampler is not None else kvledger_sampler()
        self.providers: dict[str, TracerProvider] = {}

    def tracer(self, service: str) -> Tracer:
        provider = self.providers.get(service)
        if provider is None:
            provider = TracerProvider(
                resource=Resource.create({"service.name": service}),
                sampler=self.sampler,
                span_limits=SpanLimits(max_links=MAX_LINKS),
            )
            provider.add_span_processor(SimpleSpanProcessor(self.exporter))
            self.providers[service] = provider
        return provider.get_tracer("kvledger")

    @property
    def spans(self) -> list[SpanDict]:
        return [readable_to_dict(span) for span in self.exporter.get_finished_spans()]

    def clear(self) -> None:
        self.exporter.clear()


def readable_to_dict(span: ReadableSpan) -> SpanDict:
    """An SDK span as `tests.otlp_receiver.span_to_dict` gives a span received over OTLP."""
    context = span.get_span_context()
    assert context is not None
    resource = dict(span.resource.attributes)
    return {
        "name": span.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": _plain(span.attributes),
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": _plain(e.attributes)}
            for e in span.events
        ],
        "links": [
            {
                "trace_id": f"{link.context.trace_id:032x}",
                "span_id": f"{link.context.span_id:016x}",
                "attributes": _plain(link.attributes),
            }
            for link in span.links
        ],
        "status": {"code": span.status.status_code.name, "message": span.status.description or ""},
        "resource": resource,
        "service_name": resource.get("service.name"),
        "scope": span.instrumentation_scope.name if span.instrumentation_scope else "",
    }


def _plain(attributes: Any) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (attributes or {}).items()}


# --- over span dicts --------------------------------------------------------------------------


def by_trace(spans: Iterable[SpanDict]) -> dict[str, list[SpanDict]]:
    traces: dict[str, list[SpanDict]] = defaultdict(list)
    for span in spans:
        traces[span["trace_id"]].append(span)
    return traces


def traces_by_request(spans: Iterable[SpanDict]) -> dict[str, list[SpanDict]]:
    """req_id -> every span of the trace that request's spans are in (the gateway's, or the
    test's own root when there is no gateway), found through kvledger.request_id."""
    traces = by_trace(spans)
    out: dict[str, list[SpanDict]] = {}
    for trace_spans in traces.values():
        for span in trace_spans:
            rid = span["attributes"].get("kvledger.request_id")
            if rid is not None and span["name"] != "kvledger.step":
                out.setdefault(rid, trace_spans)
    return out


def named(spans: Iterable[SpanDict], name: str) -> list[SpanDict]:
    return sorted((s for s in spans if s["name"] == name), key=lambda s: s["start_ns"])


def render_tree(
    spans: list[SpanDict],
    *,
    attributes: Iterable[str] = (),
    everything: Iterable[SpanDict] = (),
) -> str:
    """One trace as an indented tree (children in start order) with the chosen attributes and
    each span's links, named by the span they lead to when it is among `everything`."""
    keys = tuple(attributes)
    targets = {s["span_id"]: s for s in everything}
    by_parent: dict[str | None, list[SpanDict]] = defaultdict(list)
    ids = {s["span_id"] for s in spans}
    for span in spans:
        parent = span["parent_span_id"] if span["parent_span_id"] in ids else None
        by_parent[parent].append(span)
    t0 = min(s["start_ns"] for s in spans)
    lines: list[str] = []

    def walk(parent: str | None, depth: int) -> None:
        pad = "  " * depth
        for span in sorted(by_parent[parent], key=lambda s: (s["start_ns"], s["name"])):
            start_ms = (span["start_ns"] - t0) / 1e6
            length_ms = (span["end_ns"] - span["start_ns"]) / 1e6
            text = f"{pad}{span['name']} [{span['service_name']}] +{start_ms:.1f} ms, {length_ms:.1f} ms"
            shown = [
                f"{k}={_short(span['attributes'][k])}" for k in keys if k in span["attributes"]
            ]
            lines.append(text + ("  " + " ".join(shown) if shown else ""))
            for event in span["events"]:
                event_attrs = " ".join(f"{k}={_short(v)}" for k, v in event["attributes"].items())
                lines.append(f"{pad}  · event {event['name']} {event_attrs}".rstrip())
            for link in span["links"]:
                target = targets.get(link["span_id"])
                if target is None:
                    described = "a span outside this collection"
                else:
                    rid = target["attributes"].get("kvledger.request_id")
                    described = f"{target['name']} [{target['service_name']}]"
                    if target["trace_id"] != span["trace_id"]:
                        described += f" in the trace of {rid}" if rid else " in another trace"
                lines.append(f"{pad}  → link to {described}")
            walk(span["span_id"], depth + 1)

    walk(None, 0)
    return "\n".join(lines)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and len(value) > 4:
        return f"[{', '.join(map(str, value[:4]))}, … {len(value)} in all]"
    return str(value)
