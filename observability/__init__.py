"""Observability for every kvledger service: tracing (OTLP to Jaeger), structured logs that carry
trace ids, and Prometheus metrics with vLLM's names. No business logic lives here.

Part of the common layer beside `services`, and independent of it: the application passes in
the settings (log level and format, secrets to redact, `TracingSettings`).
"""

from __future__ import annotations

from observability.logging import configure_logging, get_logger
from observability.metrics import (
    CONTENT_TYPE,
    GatewayMetrics,
    LedgerMetrics,
    LedgerSnapshot,
    metrics_handler,
    new_registry,
    render,
)
from observability.tracing import (
    Attr,
    EventName,
    SpanName,
    TracingSettings,
    extract_context,
    format_block_hashes,
    get_tracer,
    in_trace,
    inject_traceparent,
    lean_tracer,
    link_from_traceparent,
    links_from_traceparents,
    never_sampled,
    record_root_span,
    record_span,
    setup_tracing,
    shutdown_tracing,
    span_context_from_traceparent,
    tracer_if_on,
)

__all__ = [
    "CONTENT_TYPE",
    "Attr",
    "EventName",
    "GatewayMetrics",
    "LedgerMetrics",
    "LedgerSnapshot",
    "SpanName",
    "TracingSettings",
    "configure_logging",
    "extract_context",
    "format_block_hashes",
    "get_logger",
    "get_tracer",
    "in_trace",
    "inject_traceparent",
    "lean_tracer",
    "link_from_traceparent",
    "links_from_traceparents",
    "metrics_handler",
    "never_sampled",
    "new_registry",
    "record_root_span",
    "record_span",
    "render",
    "setup_tracing",
    "shutdown_tracing",
    "span_context_from_traceparent",
    "tracer_if_on",
]
