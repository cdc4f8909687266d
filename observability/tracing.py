"""Tracing: the one OpenTelemetry set-up every kvledger service uses, plus the helpers that carry
a W3C `traceparent` inside Redis stream messages. The span and attribute names below are a
contract: dashboards and the end-to-end trace test rely on them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    TraceFlags,
    Tracer,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

if TYPE_CHECKING:  # the SDK is imported only when tracing is on
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.sdk.trace.sampling import Sampler

log = logging.getLogger(__name__)

Attributes = Mapping[str, AttributeValue]


class SpanName:
    """kvledger's span names. The gateway's SERVER span follows HTTP semconv (`POST /v1/...`)
    and its GenAI span GenAI semconv (`{gen_ai.operation.name} {gen_ai.request.model}`)."""

    QUEUE = "kvledger.queue"  # enqueue -> admission (or abort): how long, and what held it back
    ADMIT = "kvledger.admit"  # each admission, and again on resume after a preemption
    PREEMPT = "kvledger.preempt"  # in the victim's trace, linked to its cause's kvledger.preempting
    PREEMPTING = "kvledger.preempting"  # in the trace of the request whose growth preempted others
    EVICT = "kvledger.evict"  # in the trace of the request whose allocations evicted (one a run)
    STEP = "kvledger.step"  # one per scheduler step on the worker, linked to its requests' work
    PREFILL = "kvledger.prefill"  # a prefill chunk a request computed in one step (on the worker)
    DECODE = "kvledger.decode"  # a run of decode steps of one request (on the worker)
    ROUTE = "kvledger.route"  # the gateway's choice of replica, with every replica's score


class EventName:
    """Span events: bounded, one per change rather than one per step."""

    QUEUE_HELD = "kvledger.queue.held"  # a run of checks that held a waiting request back
    STEP = "kvledger.step"  # one decode step, on kvledger.decode with --collect-detailed-traces


class Attr:
    """Attribute keys: OpenTelemetry GenAI and messaging conventions first, then kvledger's own."""

    GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
    GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
    GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
    GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
    GEN_AI_REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"  # OpenAI's n
    GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
    GEN_AI_RESPONSE_ID = "gen_ai.response.id"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"  # one per choice
    GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
    GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    GEN_AI_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
    # vLLM 0.33's own (vllm/tracing/utils.py SpanAttributes), so a dashboard built for vLLM's
    # llm_request span reads ours: the request id and n, its older usage names and latencies.
    VLLM_REQUEST_ID = "gen_ai.request.id"
    VLLM_REQUEST_N = "gen_ai.request.n"
    VLLM_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    VLLM_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    VLLM_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    VLLM_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    VLLM_LATENCY_E2E = "gen_ai.latency.e2e"
    VLLM_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    VLLM_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    VLLM_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"

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
    # loaded from the offloaded tiers instead of computed (the CPU tier, the shared tier via it)
    LOADED_TOKENS = "kvledger.loaded.tokens"
    LOADED_BYTES = "kvledger.loaded.bytes"
    LOADED_SHARED_BLOCKS = "kvledger.loaded.shared_blocks"  # promoted from the shared tier first
    LOADED_WAIT_S = "kvledger.loaded.wait_s"  # from its first copy out to its admission
    LOADED_FROM_REPLICAS = "kvledger.loaded.from_replicas"  # who wrote its shared-tier blocks
    RECOMPUTED_TOKENS = "kvledger.recomputed.tokens"  # prompt tokens no tier held: computed
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
    # Past the GPU prefix, the tokens loaded from the CPU tier and from the shared tier: the
    # chosen replica's, every replica's, and what those loads cost (in the cost unit).
    ROUTE_CPU_TOKENS = "kvledger.route.cpu_tokens"
    ROUTE_SHARED_TOKENS = "kvledger.route.shared_tokens"
    ROUTE_REPLICA_CPU_TOKENS = "kvledger.route.replica_cpu_tokens"
    ROUTE_REPLICA_SHARED_TOKENS = "kvledger.route.replica_shared_tokens"
    ROUTE_TIER_COSTS = "kvledger.route.tier_costs"
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
    REQUEST_IDS = "kvledger.request_ids"  # every ledger request of a response (n > 1)
    # a request's work on the worker: kvledger.prefill (one chunk) and kvledger.decode (a run)
    NUM_COMPUTED_TOKENS = "kvledger.num_computed_tokens"  # tokens computed in this chunk or run
    NUM_CACHED_TOKENS = "kvledger.num_cached_tokens"  # the prefix-cache hit it started from
    PREFILL_START = "kvledger.prefill.start"  # the position of the chunk's first token
    PREFILL_TOKENS = "kvledger.prefill.tokens"  # tokens to prefill in all (prompt + outputs)
    PREFILL_DONE = "kvledger.prefill.done"  # this chunk reached the last of them
    RECOMPUTE = "kvledger.recompute"  # recomputing after a preemption
    NUM_PREEMPTIONS = "kvledger.num_preemptions"
    NUM_STEPS = "kvledger.num_steps"
    FIRST_STEP_ID = "kvledger.first_step_id"
    LAST_STEP_ID = "kvledger.last_step_id"
    COMPUTE_S = "kvledger.compute_s"  # seconds of the steps it took part in, summed
    SEGMENT_END = "kvledger.segment.end"  # finished, preempted, idle, epoch or shutdown
    NUM_TRACED_REQUESTS = "kvledger.num_traced_requests"  # sampled requests a step computed
    # kvledger.queue: what held it back, check by check (a check: one scheduler step)
    QUEUE_AHEAD = "kvledger.queue.ahead"  # waiting requests ahead of it when it (re)entered
    QUEUE_CHECKS = "kvledger.queue.checks"  # steps it waited through
    QUEUE_REASON = "kvledger.queue.reason"  # at the last check (next_step: no check held it)
    QUEUE_REASONS = "kvledger.queue.reasons"  # every reason, in order of first appearance
    QUEUE_REASON_CHECKS = "kvledger.queue.reason_checks"  # checks per reason, same order
    QUEUE_OUTCOME = "kvledger.queue.outcome"  # admitted, or the finish reason (abort, error)
    HELD_BY_REQUEST_ID = "kvledger.queue.head_request_id"  # the head it waited behind
    # causes, both ways: kvledger.preempting names its victims; kvledger.admit its lost prefix
    PREEMPTED_REQUEST_IDS = "kvledger.preempted.request_ids"
    NUM_PREEMPTED = "kvledger.num_preempted"
    PREFIX_LOST_BLOCKS = "kvledger.prefix_lost.blocks"  # blocks past the hit it once had cached
    PREFIX_LOST_TOKENS = "kvledger.prefix_lost.tokens"
    PREFIX_LOST_EVICTED_BY = "kvledger.prefix_lost.evicted_by"  # the requests that evicted them


MAX_LINKS = 4096
_EXPORTERS = ("otlp", "console", "none")
SAMPLERS = (
    "parentbased_always_on",  # the default, as in every OpenTelemetry SDK
    "parentbased_always_off",
    "parentbased_traceidratio",
    "always_on",
    "always_off",
    "traceidratio",
)
_PROTOCOLS = ("http/protobuf", "grpc")
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_lock = threading.Lock()
_providers: dict[str, TracerProvider] = {}


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """Where spans go, which traces are kept, and how much detail. Off (no exporter) unless an
    endpoint or an exporter is named."""

    endpoint: str | None = None  # OTLP base URL, e.g. http://jaeger:4318 (/v1/traces appended)
    exporters: str | None = None  # comma-separated: otlp, console, none
    protocol: str = "http/protobuf"  # or grpc
    service_name: str | None = None  # replaces the service's own name when set
    # vLLM's --otlp-traces-endpoint (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT): the traces URL itself,
    # e.g. http://jaeger:4318/v1/traces; one without a path gets /v1/traces. Beats `endpoint`.
    traces_endpoint: str | None = None
    sampler: str | None = None  # OTEL_TRACES_SAMPLER (default parentbased_always_on)
    sampler_arg: str | None = None  # OTEL_TRACES_SAMPLER_ARG: the ratio of *traceidratio
    detailed: tuple[str, ...] = ()  # vLLM's --collect-detailed-traces: model, worker, all

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
            traces_endpoint=get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
            sampler=get("OTEL_TRACES_SAMPLER"),
            sampler_arg=get("OTEL_TRACES_SAMPLER_ARG"),
        )

    @property
    def detailed_traces(self) -> bool:
        return bool(self.detailed)


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
        provider = _new_provider(
            name, exporters, kvledger_sampler(settings.sampler, settings.sampler_arg)
        )
        _providers[name] = provider
        # OpenTelemetry accepts one global provider per process and warns on a second.
        if set_global and isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            trace.set_tracer_provider(provider)
    log.info(
        "tracing_on", extra={"service": name, "exporters": [type(e).__name__ for e in exporters]}
    )
    return provider


def get_tracer(service_name: str, instrumentation: str = "kvledger") -> Tracer:
    """The tracer of `service_name`'s provider (its spans lean: `observability.lean_spans`), or
    the global (no-op when off) tracer."""
    provider = _providers.get(_settings.service_name or service_name)
    if provider is None:
        return trace.get_tracer(instrumentation)
    return lean_tracer(provider.get_tracer(instrumentation, _version()))


_TracerT = TypeVar("_TracerT", bound="Tracer | None")


def lean_tracer(tracer: _TracerT) -> _TracerT:
    """An SDK tracer's spans made lean (`observability.lean_spans`: same spans, a fraction of the
    CPU); any other tracer, or None, as it is. The SDK is imported only if the tracer is its."""
    if tracer is None or not type(tracer).__module__.startswith("opentelemetry.sdk."):
        return tracer
    from observability.lean_spans import lean_tracer as make_lean

    return make_lean(tracer)


def detailed_traces() -> bool:
    """Whether --collect-detailed-traces asked for more detail (per-step events)."""
    return _settings.detailed_traces


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
    endpoint, raw = settings.traces_endpoint or settings.endpoint, settings.exporters
    names = ["otlp"] if raw is None and endpoint else _parse_exporter_names(raw)
    if "none" in names:
        return []
    if "otlp" in names and not endpoint:
        raise ValueError(
            "OTEL_TRACES_EXPORTER=otlp needs --otlp-traces-endpoint or OTEL_EXPORTER_OTLP_ENDPOINT, "
            "e.g. http://jaeger:4318; unset OTEL_TRACES_EXPORTER to leave tracing off"
        )
    exporters: list[SpanExporter] = []
    if "otlp" in names:
        exporters.append(
            _otlp_exporter(endpoint or "", settings.protocol, whole=bool(settings.traces_endpoint))
        )
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


def _otlp_exporter(endpoint: str, protocol: str, *, whole: bool = False) -> SpanExporter:
    """`whole`: the traces URL itself (--otlp-traces-endpoint), not a base URL."""
    if not endpoint.startswith(("http://", "https://")):
        name = "--otlp-traces-endpoint" if whole else "OTEL_EXPORTER_OTLP_ENDPOINT"
        raise ValueError(f"{name}={endpoint!r} must be a URL such as http://jaeger:4318")
    protocol = protocol.lower()
    if protocol == "http/protobuf":
        from observability.otlp_encoding import fast_otlp_http_exporter

        has_path = urlsplit(endpoint).path.strip("/") != ""
        url = endpoint if whole and has_path else otlp_traces_url(endpoint)
        return fast_otlp_http_exporter(url)
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


def kvledger_sampler(name: str | None = None, arg: str | None = None) -> Sampler:
    """OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG as the OpenTelemetry SDKs read them
    (default parentbased_always_on), plus one rule for batches: a root span that links to a
    sampled span is sampled (a worker's step in which a kept request's prefill chunk or decode
    run began), so that those links resolve both ways. Any other root, a step in which kept
    requests only went on decoding included, is kept by the ratio, its own trace id deciding.
    The gateway's root span is the one decision the ratio makes for a request; the ledger and
    the workers follow the traceparent's flag."""
    from opentelemetry.sdk.trace import sampling

    name = (name or "parentbased_always_on").strip().lower()
    if name not in SAMPLERS:
        raise ValueError(f"OTEL_TRACES_SAMPLER={name!r}: kvledger knows {', '.join(SAMPLERS)}")
    ratio = 1.0
    if name.endswith("traceidratio") and arg is not None:
        try:
            ratio = float(arg)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(
                f"OTEL_TRACES_SAMPLER_ARG={arg!r}: the sampling ratio is a number from 0 to 1"
            )
    root: Sampler = {
        "always_on": sampling.ALWAYS_ON,
        "always_off": sampling.ALWAYS_OFF,
        "traceidratio": sampling.TraceIdRatioBased(ratio),
    }[name.removeprefix("parentbased_")]
    base = sampling.ParentBased(root) if name.startswith("parentbased_") else root
    parent_based = name.startswith("parentbased_")
    return _keep_linked_roots(base, name.removeprefix("parentbased_"), ratio, parent_based)


def _keep_linked_roots(base: Sampler, root: str, ratio: float, parent_based: bool) -> Sampler:
    """`base` (the SDK's samplers, for their description) with the rule for batches, deciding
    as `base` would without building the SDK's result objects: `decide` is what
    observability.lean_spans asks, `should_sample` what the SDK's tracer asks."""
    from opentelemetry.sdk.trace import sampling

    limit = sampling.TraceIdRatioBased.TRACE_ID_LIMIT
    bound = sampling.TraceIdRatioBased.get_bound_for_rate(ratio)
    always = {"always_on": True, "always_off": False}.get(root)

    class KeepLinkedRoots(sampling.Sampler):
        def decide(
            self, parent: SpanContext | None, trace_id: int, attributes=None, links=None
        ) -> bool:
            """Sampled or dropped; `parent` is None for a root (or an invalid parent)."""
            if parent is None:
                if links and any(link.context.trace_flags.sampled for link in links):
                    return True
            elif parent_based:
                return parent.trace_flags.sampled
            if always is not None:
                return always
            return trace_id & limit < bound

        def should_sample(
            self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
            trace_state=None,
        ):  # fmt: skip
            parent = trace.get_current_span(parent_context).get_span_context()
            valid = parent is not None and parent.is_valid
            state = parent.trace_state if valid else None
            if self.decide(parent if valid else None, trace_id, attributes, links):
                return sampling.SamplingResult(
                    sampling.Decision.RECORD_AND_SAMPLE, attributes, state
                )
            return sampling.SamplingResult(sampling.Decision.DROP, None, state)

        def get_description(self) -> str:
            return f"KeepLinkedRoots{{{base.get_description()}}}"

    return KeepLinkedRoots()


def _new_provider(
    service_name: str, exporters: Sequence[SpanExporter], sampler: Sampler | None = None
) -> TracerProvider:
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
        resource=resource,
        sampler=sampler,
        span_limits=SpanLimits(max_links=MAX_LINKS),
        shutdown_on_exit=True,
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
    if span_or_context is None:
        span_or_context = trace.get_current_span()
    if isinstance(span_or_context, Span):
        span_or_context = span_or_context.get_span_context()
    if isinstance(span_or_context, SpanContext):  # written out: once per request and choice
        if not span_or_context.is_valid:
            return None
        return (
            f"00-{span_or_context.trace_id:032x}-{span_or_context.span_id:016x}-"
            f"{span_or_context.trace_flags:02x}"
        )
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=span_or_context)
    return carrier.get("traceparent")


def extract_context(traceparent: str | bytes | None) -> Context:
    """A parent Context from a traceparent string; anything unparsable gives an empty Context."""
    span_context = span_context_from_traceparent(traceparent)
    if span_context is None:
        return Context()
    return trace.set_span_in_context(NonRecordingSpan(span_context), Context())


def never_sampled(traceparent: str | bytes | None) -> bool:
    """True when a traceparent cannot name a sampled span (none, or the W3C form whose flags'
    sampled bit is clear), found without parsing it: what a role that records only sampled
    traces needs to know of the rest. False means: parse it (it may still be unsampled)."""
    if traceparent is None:
        return True
    return type(traceparent) is str and len(traceparent) == 55 and traceparent[54] not in _ODD_HEX


_ODD_HEX = frozenset("13579bdfBDF")


def span_context_from_traceparent(traceparent: str | bytes | None) -> SpanContext | None:
    """The remote SpanContext a traceparent names, or None for garbage; never raises."""
    if isinstance(traceparent, bytes):
        traceparent = traceparent.decode("ascii", errors="replace")
    if not isinstance(traceparent, str) or not traceparent:
        return None
    common = _TRACEPARENT.fullmatch(traceparent)  # the form every kvledger service writes
    if common is not None:
        trace_hex, span_hex, flags_hex = common.groups()
        span_context = SpanContext(
            int(trace_hex, 16), int(span_hex, 16), is_remote=True,
            trace_flags=TraceFlags(int(flags_hex, 16)),
        )  # fmt: skip
        return span_context if span_context.is_valid else None
    try:
        context = _PROPAGATOR.extract({"traceparent": traceparent.strip()}, context=Context())
    except Exception:  # a malformed message must never take down the consumer that reads it
        return None
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


@contextlib.contextmanager
def in_trace(parent: str | bytes | SpanContext | None) -> Iterator[None]:
    """Inside: the current span is the one a traceparent (or SpanContext) names, so log lines
    written here carry its trace id (the logging processor reads it). Nothing when it is None."""
    span_context = (
        parent if isinstance(parent, SpanContext) else span_context_from_traceparent(parent)
    )
    if span_context is None:
        yield
        return
    token = context_api.attach(trace.set_span_in_context(NonRecordingSpan(span_context), Context()))
    try:
        yield
    finally:
        context_api.detach(token)


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


def record_root_span(
    tracer: Tracer,
    name: str,
    *,
    kind: SpanKind,
    start_ns: int,
    end_ns: int,
    links: Sequence[Link],
    sampling_attributes: Attributes,
    attributes: Callable[[], Attributes],
) -> SpanContext | None:
    """A root span that happened (a worker's step), made and ended at once; its context when
    the sampler kept it, else None. The sampler reads `sampling_attributes`; `attributes()`
    (which include them) is built only for a span kept. A lean tracer hands it to the
    processors in one go (`LeanTracer.record_root`)."""
    record = getattr(tracer, "record_root", None)
    if record is not None:
        made, context = record(name, kind, start_ns, end_ns, links, sampling_attributes, attributes)
        if made:
            return context
    span = tracer.start_span(
        name, kind=kind, start_time=start_ns, links=links, attributes=sampling_attributes
    )
    if not span.is_recording():
        return None
    span.set_attributes(attributes())
    span.end(end_time=end_ns)
    return span.get_span_context()


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
