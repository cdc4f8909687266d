"""Spans without the SDK's per-span machinery, for the services' hot paths.

The SDK's Span costs ~35-55 µs to start and end, several times what kvledger's spans carry: a
lock, containers that re-validate every attribute and link on the way in and take a lock per
item on the way out (which the OTLP encoder pays again), the sampler's result objects, the
SDK's self-metrics. `lean_tracer(tracer)` wraps an SDK tracer so that its spans keep their data
in plain dicts and lists until they end, and then hand the provider's span processors the same
`ReadableSpan` an SDK span would: the same sampling decision (kvledger's samplers answer
`decide` without result objects; any other sampler is asked as the SDK asks it), ids, flags,
trace state, limits, attribute cleaning, events, links and status.

Wherever it could not be exact it is not used: a tracer that is not the SDK's, a span processor
that watches spans start or end (the batch and simple processors do not), the SDK's internal
metrics switched on. Then the SDK's own tracer serves, unchanged.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from time import time_ns
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import trace as trace_api
from opentelemetry.attributes import BoundedAttributes, _clean_attribute_value
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.util import BoundedList
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

log = logging.getLogger(__name__)

_PLAIN = (type(None), bool, int, float, bytes)  # values the SDK stores as they are
_FLAGS = {
    (sampled, random): TraceFlags(
        (TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
        | (TraceFlags.RANDOM_TRACE_ID if random else 0)
    )
    for sampled in (False, True)
    for random in (False, True)
}
# Processors whose on_start and _on_ending do nothing: a lean span may skip calling them.
_QUIET_PROCESSORS = (SpanProcessor, BatchSpanProcessor, SimpleSpanProcessor)
_QUIET_ON_START = {cls.on_start for cls in _QUIET_PROCESSORS}
_QUIET_ON_ENDING = {cls._on_ending for cls in _QUIET_PROCESSORS}
_UNSET_STATUS = Status(StatusCode.UNSET)


def lean_tracer(tracer: Any) -> Any:
    """`tracer` as a LeanTracer when it is the SDK's, else `tracer` itself (no-op tracers,
    tracers already lean, others). None stays None."""
    if isinstance(tracer, LeanTracer) or not isinstance(tracer, sdk_trace.Tracer):
        return tracer
    if os.environ.get("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "").strip().lower() == "true":
        return tracer  # the SDK counts its spans then: let it
    required = ("sampler", "span_processor", "id_generator", "resource", "_span_limits")
    if not all(hasattr(tracer, name) for name in required):
        return tracer  # an SDK whose internals moved
    return LeanTracer(tracer)


class LeanTracer(trace_api.Tracer):
    """An SDK tracer's spans, made lean (see the module's docstring)."""

    def __init__(self, sdk: sdk_trace.Tracer) -> None:
        self.sdk = sdk
        self.resource = sdk.resource
        self.scope = getattr(sdk, "_instrumentation_scope", None)
        self.info = getattr(sdk, "instrumentation_info", None)
        self.sampler = sdk.sampler
        self.decide = getattr(sdk.sampler, "decide", None)  # kvledger's samplers
        self.ids = sdk.id_generator
        self.limits = sdk._span_limits
        self.processor = sdk.span_processor
        self._checked: object = None
        self._quiet = False

    def _lean_ok(self) -> bool:
        """Whether every processor of the provider ignores spans starting and ending (checked
        again whenever a processor is added)."""
        processors = getattr(self.processor, "_span_processors", None)
        if processors is not self._checked:
            self._checked = processors
            self._quiet = (
                type(self.processor) is sdk_trace.SynchronousMultiSpanProcessor
                and processors is not None
                and all(
                    type(p).on_start in _QUIET_ON_START and type(p)._on_ending in _QUIET_ON_ENDING
                    for p in processors
                )
            )
        enabled = getattr(self.sdk, "_is_enabled", None)
        return self._quiet and (enabled is None or enabled())

    def start_span(
        self,
        name: str,
        context: context_api.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[Link] | None = (),
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace_api.Span:
        return self._start(
            name, context, kind, attributes, links, start_time, record_exception,
            set_status_on_exception,
        )[0]  # fmt: skip

    def _start(
        self,
        name: str,
        context: context_api.Context | None,
        kind: SpanKind,
        attributes: Mapping[str, Any] | None,
        links: Sequence[Link] | None,
        start_time: int | None,
        record_exception: bool,
        set_status_on_exception: bool,
    ) -> tuple[trace_api.Span, bool]:
        """The span, and whether it is the parent's own non-recording span (see below)."""
        if not self._lean_ok():
            return self.sdk.start_span(
                name, context, kind, attributes, links, start_time, record_exception,
                set_status_on_exception,
            ), False  # fmt: skip
        parent_span = trace_api.get_current_span(context)
        parent: SpanContext | None = parent_span.get_span_context()
        if parent is None or not parent.is_valid:
            parent = None
            trace_id = self.ids.generate_trace_id()
            random = self.ids.is_trace_id_random()
        else:
            trace_id = parent.trace_id
            random = parent.trace_flags.random_trace_id
        trace_state = parent.trace_state if parent is not None else None
        if self.decide is not None:
            sampled = recording = self.decide(parent, trace_id, attributes, links)
            flags = _FLAGS[sampled, random]
            if (
                not sampled
                and parent is not None
                and parent.trace_flags == flags
                and type(parent_span) is NonRecordingSpan
            ):
                # A child of a trace left out, left out as well: nothing will ever see an id of
                # its own (kvledger's samplers decide its descendants by the same flag and
                # trace id), so it is its parent's non-recording span.
                return parent_span, True
        else:  # as the SDK asks any sampler
            result = self.sampler.should_sample(context, trace_id, name, kind, attributes, links)
            sampled, recording = result.decision.is_sampled(), result.decision.is_recording()
            attributes, trace_state = result.attributes, result.trace_state
            flags = _FLAGS[sampled, random]
        span_context = SpanContext(
            trace_id, self.ids.generate_span_id(), is_remote=False, trace_flags=flags,
            trace_state=trace_state,
        )  # fmt: skip
        if not recording:
            return NonRecordingSpan(span_context), False
        return LeanSpan(
            self, name, span_context, parent, kind, attributes, links,
            start_time if start_time is not None else time_ns(),
            record_exception, set_status_on_exception,
        ), False  # fmt: skip

    def record_root(
        self,
        name: str,
        kind: SpanKind,
        start_ns: int,
        end_ns: int,
        links: Sequence[Link],
        sampling_attributes: Mapping[str, Any],
        attributes: Callable[[], Mapping[str, Any]],
    ) -> tuple[bool, SpanContext | None]:
        """A root span made and ended at once, straight to the processors (a worker's step):
        (whether it was made here, its context when kept). The sampler reads
        `sampling_attributes`; `attributes()` (which include them) is built only for a span
        kept. Not made here (False) where kvledger's sampler is not the provider's, or a
        processor watches spans start: then the caller makes it as any span."""
        if self.decide is None or not self._lean_ok():
            return False, None
        trace_id = self.ids.generate_trace_id()
        if not self.decide(None, trace_id, sampling_attributes, links):
            return True, None
        context = SpanContext(
            trace_id, self.ids.generate_span_id(), is_remote=False,
            trace_flags=_FLAGS[True, self.ids.is_trace_id_random()],
        )  # fmt: skip
        span = LeanSpan(
            self, name, context, None, kind, attributes(), links, start_ns, False, False
        )
        span.end(end_ns)
        return True, context

    def start_as_current_span(  # type: ignore[override]
        self,
        name: str,
        context: context_api.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[Link] | None = (),
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> _CurrentSpan:
        """As the SDK's (the span current inside, ended on exit, an exception recorded and the
        status set as `trace.use_span` does), in one object instead of two generators."""
        span, is_parent = self._start(
            name, context, kind, attributes, links, start_time, record_exception,
            set_status_on_exception,
        )  # fmt: skip
        # The parent's own span is current already (when no other context was given)
        current = is_parent and context is None
        return _CurrentSpan(span, end_on_exit, record_exception, set_status_on_exception, current)


class _CurrentSpan:
    __slots__ = (
        "current",
        "end_on_exit",
        "record_exception",
        "set_status_on_exception",
        "span",
        "token",
    )

    def __init__(
        self,
        span: trace_api.Span,
        end_on_exit: bool,
        record_exception: bool,
        set_status_on_exception: bool,
        current: bool = False,
    ) -> None:
        self.span = span
        self.current = current  # current already: nothing to attach
        self.end_on_exit = end_on_exit
        self.record_exception = record_exception
        self.set_status_on_exception = set_status_on_exception
        self.token: object = None

    def __enter__(self) -> trace_api.Span:
        if not self.current:
            self.token = context_api.attach(trace_api.set_span_in_context(self.span))
        return self.span

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        span = self.span
        try:
            if not self.current:
                context_api.detach(self.token)  # type: ignore[arg-type]
            # As use_span: exceptions, not every BaseException (GeneratorExit is no error).
            if isinstance(exc, Exception) and span.is_recording():
                if self.record_exception:
                    span.record_exception(exc)
                if self.set_status_on_exception:
                    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        finally:
            if self.end_on_exit:
                span.end()


class LeanSpan(trace_api.Span):
    """A recording span whose data stay in plain containers until it ends."""

    __slots__ = (
        "_attributes",
        "_context",
        "_end",
        "_events",
        "_links",
        "_name",
        "_parent",
        "_start",
        "_status",
        "_tracer",
        "kind",
        "record_exceptions",
        "set_status_on_exception",
    )

    def __init__(
        self,
        tracer: LeanTracer,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: Mapping[str, Any] | None,
        links: Sequence[Link] | None,
        start_ns: int,
        record_exception: bool,
        set_status_on_exception: bool,
    ) -> None:
        self._tracer = tracer
        self._name = name
        self._context = context
        self._parent = parent
        self.kind = kind
        self._start = start_ns
        self._end: int | None = None
        self._status = _UNSET_STATUS
        self.record_exceptions = record_exception
        self.set_status_on_exception = set_status_on_exception
        self._attributes: dict[str, Any] = {}
        if attributes:
            _set_items(self._attributes, attributes, tracer.limits.max_span_attribute_length)
        self._events: list[Event] = []
        self._links: list[Link] = []
        if links:
            for link in links:
                if link:
                    self._add_link(link.context, link.attributes)

    # ------------------------------------------------------------------ the Span API

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._end is None

    def set_attribute(self, key: str, value: Any) -> None:
        if self._end is not None:
            log.warning("Setting attribute on ended span.")
            return
        _set_items(self._attributes, {key: value}, self._tracer.limits.max_span_attribute_length)

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self._end is not None:
            log.warning("Setting attribute on ended span.")
            return
        _set_items(self._attributes, attributes, self._tracer.limits.max_span_attribute_length)

    def add_event(
        self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None
    ) -> None:
        if self._end is not None:
            log.warning("Tried calling _add_event on an ended span.")
            return
        self._events.append(Event(name, self._cleaned(attributes, "event"), timestamp))

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        if self._end is not None:
            log.warning("Tried calling _add_link on an ended span.")
            return
        self._add_link(context, attributes)

    def _add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None) -> None:
        if context is None or not (context.is_valid or attributes or context.trace_state):
            return  # the SDK keeps no link to nothing
        self._links.append(Link(context, self._cleaned(attributes, "link")))

    def update_name(self, name: str) -> None:
        if self._end is not None:
            log.warning("Tried calling update_name on an ended span.")
            return
        self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self._end is not None:
            log.warning("Tried calling set_status on an ended span.")
            return
        if self._status.status_code is StatusCode.OK:
            return  # OK is final
        if isinstance(status, Status):
            if status.status_code is StatusCode.UNSET:
                return
            if description is not None:
                log.warning(
                    "Description %s ignored. Use either `Status` or `(StatusCode, Description)`",
                    description,
                )
            self._status = status
        elif isinstance(status, StatusCode) and status is not StatusCode.UNSET:
            self._status = Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        module = type(exception).__module__
        qualname = type(exception).__qualname__
        recorded: dict[str, Any] = {
            "exception.type": f"{module}.{qualname}"
            if module and module != "builtins"
            else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            recorded.update(attributes)
        self.add_event("exception", recorded, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._end is not None:
            log.warning("Calling end() on an ended span.")
            return
        self._end = end_time if end_time is not None else time_ns()
        tracer = self._tracer
        limits = tracer.limits
        tracer.processor.on_end(
            ReadableSpan(
                name=self._name,
                context=self._context,
                parent=self._parent,
                resource=tracer.resource,
                attributes=_bounded_attributes(self._attributes, limits.max_span_attributes),
                events=_bounded(self._events, limits.max_events),
                links=_bounded(self._links, limits.max_links),
                kind=self.kind,
                instrumentation_info=tracer.info,
                status=self._status,
                start_time=self._start,
                end_time=self._end,
                instrumentation_scope=tracer.scope,
            )
        )

    def _cleaned(self, attributes: Mapping[str, Any] | None, of: str) -> Mapping[str, Any]:
        limits = self._tracer.limits
        if of == "event":
            maxlen = limits.max_event_attributes
        else:
            maxlen = limits.max_link_attributes
        cleaned: dict[str, Any] = {}
        if attributes:
            _set_items(cleaned, attributes, limits.max_attribute_length)
        return _bounded_attributes(cleaned, maxlen)

    def __repr__(self) -> str:
        return f'LeanSpan(name="{self._name}", context={self._context})'


def _set_items(target: dict[str, Any], attributes: Mapping[str, Any], max_len: int | None) -> None:
    """As the SDK's BoundedAttributes stores them: values cleaned (sequences become tuples,
    strings cut to max_len, other types turned into strings), a key set again moves to the end,
    empty or non-string keys dropped. The count limit applies when the span ends."""
    for key, value in attributes.items():
        if type(key) is not str or not key:
            log.warning("invalid key `%s`. must be non-empty string. Dropping key.", key)
            continue
        if not isinstance(value, _PLAIN) and not (type(value) is str and max_len is None):
            value = _clean_attribute_value(value, max_len)
        target.pop(key, None)
        target[key] = value


def _bounded_attributes(attributes: dict[str, Any], maxlen: int | None) -> Mapping[str, Any]:
    """The newest `maxlen` attributes, counting the dropped ones as the SDK does (only built
    when some were dropped: no span of kvledger's comes near the limit)."""
    if maxlen is None or len(attributes) <= maxlen:
        return attributes
    kept = dict(list(attributes.items())[len(attributes) - maxlen :]) if maxlen else {}
    bounded = BoundedAttributes(maxlen, kept, immutable=True)
    bounded.dropped = len(attributes) - maxlen
    return bounded


def _bounded(items: list, maxlen: int | None) -> Sequence:
    if maxlen is None or len(items) <= maxlen:
        return items
    return BoundedList.from_seq(maxlen, items)  # the newest maxlen, the rest counted dropped
