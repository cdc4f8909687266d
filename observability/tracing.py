"""Tracing: the one OpenTelemetry set-up every kvledger service uses, plus the helpers that carry
a W3C `traceparent` inside Redis stream messages. The span and attribute names below are a
contract: dashboards and the end-to-end trace test rely on them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

if TYPE_CHECKING:  # the SDK is imported only when tracing is on
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)

Attributes = Mapping[str, AttributeValue]


class SpanName:
    """Span names issue 5 promises; the gateway's SERVER span follows HTTP semconv instead."""

    QUEUE = "kvledger.queue"  # enqueue -> admission, recorded with record_span
    ADMIT = "kvledger.admit"  # each admission, and again on resume after a preemption
    PREEMPT = "kvledger.preempt"
    EVICT = "kvledger.evict"  # in the trace of the request whose allocation evicted
    STEP = "kvledger.step"  # one per scheduler step on the worker, linked to its requests
    ROUTE = "kvledger.route"  # the gateway's choice of replica, with every replica's score


class Attr:
    """Attribute keys: OpenTelemetry GenAI and messaging conventions first, then kvledger's own."""

    GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
    GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
    GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    GEN_AI_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"

    HTTP_REQUEST_METHOD = "http.request.method"
    HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
    URL_PATH = "url.path"
    ERROR_TYPE = "error.type"

    MESSAGING_SYSTEM = "messaging.system"  # "redis"
    MESSAGING_OPERATION_TYPE = "messaging.operation.type"  # "process" on the step span
    MESSAGING_DESTINATION_NAME = "messaging.destination.name"  # the stream key
    MESSAGING_MESSAGE_ID = "messaging.message.id"  # the stream entry id
    MESSAGING_BATCH_MESSAGE_COUNT = "messaging.batch.message_count"

    REQUEST_ID = "kvledger.request_id"
    PREFIX_HIT_TOKENS = "kvledger.prefix_hit.tokens"
    PREFIX_HIT_BLOCKS = "kvledger.prefix_hit.blocks"
    # kvledger.route: the decision, then every replica's score as parallel arrays in one order
    ROUTE_POLICY = "kvledger.route.policy"
    ROUTE_REPLICA = "kvledger.route.replica"
    ROUTE_CACHED_TOKENS = "kvledger.route.cached_tokens"  # the chosen replica's expected hit
    ROUTE_REPLICAS = "kvledger.route.replicas"
    ROUTE_HEALTH = "kvledger.route.health"
    ROUTE_REPLICA_CACHED_TOKENS = "kvledger.route.replica_cached_tokens"
    ROUTE_LOAD_COSTS = "kvledger.route.load_costs"
    ROUTE_COSTS = "kvledger.route.costs"
    ROUTE_COST_UNIT = "kvledger.route.cost_unit"  # s (measured costs) or tokens (weights)
    ROUTE_EVICTED_BLOCKS = "kvledger.route.replica_evicted_blocks"  # cached, evicted first
    RESUMED = "kvledger.resumed"  # an admission that resumes a preempted request
    EVICTED_FROM_REQUEST_IDS = "kvledger.evicted_from_request_ids"
    BLOCKS_ALLOCATED = "kvledger.blocks_allocated"
    FREE_BLOCKS_AFTER = "kvledger.free_blocks_after"
    WATERMARK_APPLIED = "kvledger.watermark_applied"
    PREEMPT_REASON = "kvledger.preempt.reason"
    BLOCKS_FREED = "kvledger.blocks_freed"
    CAUSED_BY_REQUEST_ID = "kvledger.caused_by.request_id"
    EVICTED_BLOCK_HASHES = "kvledger.evicted_block_hashes"  # hex strings, see format_block_hashes
    NUM_EVICTED_BLOCKS = "kvledger.num_evicted_blocks"
    STEP_ID = "kvledger.step_id"
    WORKER_ID = "kvledger.worker_id"
    BATCH_SIZE = "kvledger.batch_size"
    NUM_TOKENS = "kvledger.num_tokens"
    NUM_PREFILL_TOKENS = "kvledger.num_prefill_tokens"
    NUM_DECODE_TOKENS = "kvledger.num_decode_tokens"
    TIME_TO_FIRST_TOKEN = "kvledger.time_to_first_token_s"


MAX_LINKS = 4096
_EXPORTERS = ("otlp", "console", "none")
_PROTOCOLS = ("http/protobuf", "grpc")
_PROPAGATOR = TraceContextTextMapPropagator()
_lock = threading.Lock()
_providers: dict[str, TracerProvider] = {}


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """Where spans go. Off (no exporter) unless an endpoint or an exporter is named."""

    endpoint: str | None = None  # OTLP base URL, e.g. http://jaeger:4318
    exporters: str | None = None  # comma-separated: otlp, console, none
    protocol: str = "http/protobuf"  # or grpc
    service_name: str | None = None  # replaces the service's own name when set

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> TracingSettings:
        """OpenTelemetry's standard variables, as every OpenTelemetry SDK reads them."""

        def get(name: str) -> str | None:
            return environ.get(name) or None

        return cls(
            endpoint=get("OTEL_EXPORTER_OTLP_ENDPOINT"),
            exporters=get("OTEL_TRACES_EXPORTER"),
            protocol=get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf",
            service_name=get("OTEL_SERVICE_NAME"),
        )


_settings = TracingSettings()  # of the last setup_tracing call: get_tracer resolves names by it


def setup_tracing(
    service_name: str, settings: TracingSettings | None = None, *, set_global: bool = True
) -> TracerProvider | None:
    """Configure tracing for `service_name`; None when tracing is off. `settings` default to
    `TracingSettings.from_environ()` (the OTEL_* variables).

    Off (the default) costs nothing: no SDK import, no exporter, spans are non-recording.
    Idempotent per service name; the first provider becomes OpenTelemetry's global one, others
    (several services in one process, or tests passing set_global=False) are reached with
    `get_tracer(service_name)`.
    """
    global _settings
    settings = TracingSettings.from_environ() if settings is None else settings
    name = settings.service_name or service_name
    with _lock:
        _settings = settings
        if name in _providers:
            return _providers[name]
        exporters = _exporters(settings)
        if not exporters:
            log.debug("tracing_off", extra={"service": name})
            return None
        provider = _new_provider(name, exporters)
        _providers[name] = provider
        # OpenTelemetry accepts one global provider per process and warns on a second.
        if set_global and isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            trace.set_tracer_provider(provider)
    log.info(
        "tracing_on", extra={"service": name, "exporters": [type(e).__name__ for e in exporters]}
    )
    return provider


def get_tracer(service_name: str, instrumentation: str = "kvledger") -> Tracer:
    """The tracer of `service_name`'s provider, or the global (no-op when off) tracer."""
    provider = _providers.get(_settings.service_name or service_name)
    if provider is None:
        return trace.get_tracer(instrumentation)
    return provider.get_tracer(instrumentation, _version())


def tracer_if_on(service_name: str, instrumentation: str = "kvledger") -> Tracer | None:
    """`service_name`'s tracer when tracing is on for it, else None: a role then skips
    building spans altogether (the ledger and the worker, whose hot paths make many)."""
    if _providers.get(_settings.service_name or service_name) is None:
        return None
    return get_tracer(service_name, instrumentation)


def shutdown_tracing(timeout_s: float = 5.0) -> None:
    """Flush and close every provider set up here; safe to call twice, or when tracing is off."""
    with _lock:
        providers = list(_providers.values())
        _providers.clear()
    for provider in providers:
        provider.force_flush(int(timeout_s * 1000))
        provider.shutdown()


def _exporters(settings: TracingSettings) -> list[SpanExporter]:
    endpoint, raw = settings.endpoint, settings.exporters
    names = ["otlp"] if raw is None and endpoint else _parse_exporter_names(raw)
    if "none" in names:
        return []
    if "otlp" in names and not endpoint:
        raise ValueError(
            "OTEL_TRACES_EXPORTER=otlp needs OTEL_EXPORTER_OTLP_ENDPOINT, e.g. http://jaeger:4318; "
            "unset OTEL_TRACES_EXPORTER to leave tracing off"
        )
    exporters: list[SpanExporter] = []
    if "otlp" in names:
        exporters.append(_otlp_exporter(endpoint or "", settings.protocol))
    if "console" in names:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        exporters.append(ConsoleSpanExporter())
    return exporters


def _parse_exporter_names(raw: str | None) -> list[str]:
    names = [part.strip().lower() for part in (raw or "").split(",") if part.strip()]
    unknown = [n for n in names if n not in _EXPORTERS]
    if unknown:
        raise ValueError(
            f"OTEL_TRACES_EXPORTER={raw!r}: kvledger knows {', '.join(_EXPORTERS)} "
            "(comma-separated, e.g. otlp,console)"
        )
    return names


def _otlp_exporter(endpoint: str, protocol: str) -> SpanExporter:
    if not endpoint.startswith(("http://", "https://")):
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_ENDPOINT={endpoint!r} must be a URL such as http://jaeger:4318"
        )
    protocol = protocol.lower()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=otlp_traces_url(endpoint))
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter as GrpcSpanExporter,
            )
        except ImportError:
            raise RuntimeError(
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the gRPC exporter, which is not installed: "
                "pip install opentelemetry-exporter-otlp-proto-grpc, or use http/protobuf "
                "(Jaeger takes it on port 4318)"
            ) from None
        return GrpcSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    raise ValueError(
        f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: kvledger supports {' or '.join(_PROTOCOLS)}"
    )


def otlp_traces_url(endpoint: str) -> str:
    """OTEL_EXPORTER_OTLP_ENDPOINT is a base URL; the HTTP exporter wants the traces path on it."""
    return endpoint.rstrip("/") + "/v1/traces"


def _new_provider(service_name: str, exporters: Sequence[SpanExporter]) -> TracerProvider:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create(
        {
            "service.name": service_name,
            "service.namespace": "kvledger",
            "service.version": _version(),
        }
    )
    # The SDK keeps 128 links per span; a step links every request in its batch, and
    # KVLEDGER_MAX_NUM_SEQS may be larger. shutdown_on_exit: a service that dies without calling
    # shutdown_tracing still flushes.
    provider = TracerProvider(
        resource=resource, span_limits=SpanLimits(max_links=MAX_LINKS), shutdown_on_exit=True
    )
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


@cache
def _version() -> str:
    try:
        return metadata.version("kvledger")
    except metadata.PackageNotFoundError:
        return "0+unknown"


# --- carrying context through stream messages -------------------------------------------------


def inject_traceparent(span_or_context: Span | SpanContext | Context | None = None) -> str | None:
    """The W3C traceparent of the given span (or the current one) for a stream message.

    None when there is no valid span, e.g. when tracing is off and nothing came in from outside.
    """
    if isinstance(span_or_context, SpanContext):
        span_or_context = NonRecordingSpan(span_or_context)
    if isinstance(span_or_context, Span):
        span_or_context = trace.set_span_in_context(span_or_context, Context())
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=span_or_context)
    return carrier.get("traceparent")


def extract_context(traceparent: str | bytes | None) -> Context:
    """A parent Context from a traceparent string; anything unparsable gives an empty Context."""
    span_context = span_context_from_traceparent(traceparent)
    if span_context is None:
        return Context()
    return trace.set_span_in_context(NonRecordingSpan(span_context), Context())


def span_context_from_traceparent(traceparent: str | bytes | None) -> SpanContext | None:
    """The remote SpanContext a traceparent names, or None for garbage; never raises."""
    if isinstance(traceparent, bytes):
        traceparent = traceparent.decode("ascii", errors="replace")
    if not isinstance(traceparent, str) or not traceparent:
        return None
    try:
        context = _PROPAGATOR.extract({"traceparent": traceparent.strip()}, context=Context())
    except Exception:  # a malformed message must never take down the consumer that reads it
        return None
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


def link_from_traceparent(
    traceparent: str | bytes | None, attributes: Attributes | None = None
) -> Link | None:
    """A span link to the span a traceparent names (messaging-style: batch -> each message)."""
    span_context = span_context_from_traceparent(traceparent)
    if span_context is None:
        return None
    return Link(span_context, attributes)


def links_from_traceparents(
    traceparents: Iterable[tuple[str | bytes | None, Attributes | None]],
) -> list[Link]:
    """Links for (traceparent, attributes) pairs, skipping messages that carried none."""
    links = (link_from_traceparent(tp, attributes) for tp, attributes in traceparents)
    return [link for link in links if link is not None]


# --- spans that already happened, and attribute helpers -----------------------------------------


def record_span(
    tracer: Tracer,
    name: str,
    *,
    start_ns: int,
    end_ns: int | None = None,
    context: Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes | None = None,
    links: Sequence[Link] | None = None,
) -> Span:
    """Record a span whose start lies in the past, e.g. kvledger.queue from the enqueue time.

    Times are epoch nanoseconds (`time.time_ns()`), never monotonic readings: they come from
    other processes. The end is clamped to the start because those processes may sit on hosts
    whose clocks disagree, and a negative duration breaks trace viewers. Returns the ended span,
    whose context can still be injected or linked.
    """
    span = tracer.start_span(
        name, context=context, kind=kind, attributes=attributes, links=links, start_time=start_ns
    )
    span.end(end_time=max(start_ns, end_ns if end_ns is not None else time.time_ns()))
    return span


def usage_attributes(
    *,
    input_tokens: int,
    output_tokens: int,
    cache_read_input_tokens: int,
    time_to_first_token_s: float | None = None,
) -> dict[str, AttributeValue]:
    """The GenAI usage attributes for the end of a request's root span."""
    attributes: dict[str, AttributeValue] = {
        Attr.GEN_AI_INPUT_TOKENS: input_tokens,
        Attr.GEN_AI_OUTPUT_TOKENS: output_tokens,
        Attr.GEN_AI_CACHE_READ_INPUT_TOKENS: cache_read_input_tokens,
    }
    if time_to_first_token_s is not None:
        attributes[Attr.TIME_TO_FIRST_TOKEN] = time_to_first_token_s
    return attributes


def format_block_hashes(block_hashes: Iterable[int | bytes]) -> list[str]:
    """Block hashes as 16-digit hex strings, the form they take in span attributes.

    OTLP integers are signed 64-bit, so an unsigned hash above 2**63 would be dropped by the
    exporter. Digests (bytes) keep their last 8 bytes, as the KV events do.
    """
    formatted = []
    for block_hash in block_hashes:
        if isinstance(block_hash, bytes):
            block_hash = int.from_bytes(block_hash[-8:], "big")
        formatted.append(f"{block_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}")
    return formatted
