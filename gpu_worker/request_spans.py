"""The worker's spans: each step's `kvledger.step` (the worker's view: a trace of its own, a
consumer of the steps stream) and, in every request's own trace, the work it took part in:

- `kvledger.prefill`: one per prefill chunk, with the tokens computed, the prefix-cache hit it
  started from, and `kvledger.recompute` when it recomputes after a preemption;
- `kvledger.decode`: one per run of decode steps (from its first decode step until it finishes,
  is preempted, or the worker idles), with counts: steps, tokens, compute seconds; one event per
  step only with --collect-detailed-traces. Never a span per token.

Links go both ways: a prefill span links to its step and the step to it; a decode run links to
its first and last steps and its first step to it (with --collect-detailed-traces every step
links to every request in it: a link per request per step, the costliest part of a trace).
Only sampled requests (the traceparent's flag, decided once at the gateway) get spans and links,
so a trace left out costs a dictionary look-up per step. A step in which a sampled request's
prefill chunk or decode run began links to it, and is kept (`kvledger_sampler`'s rule for
batches), so every link resolves both ways; any other step is a root like any other, kept by the
sampling ratio (all of them at 1.0). A span of work links only to steps that were kept. Open
decode spans are ended by `close_all` (idle, new epoch, shutdown), so none is lost.
"""

from __future__ import annotations

from itertools import compress
from operator import attrgetter

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Tracer
from opentelemetry.util.types import AttributeValue

from observability import (
    Attr,
    EventName,
    SpanName,
    lean_tracer,
    never_sampled,
    record_root_span,
    span_context_from_traceparent,
)
from services.wire.messages import CachedRequestData, NewRequestData, StepMessage

_REQ_ID = attrgetter("req_id")


class _StepRef:
    """One step (its id, its end, and its span once that exists: made after the requests'
    work in the step is counted): a decode run points at its first and its latest step."""

    __slots__ = ("context", "end_ns", "step_id")

    def __init__(self, step_id: int, end_ns: int) -> None:
        self.step_id = step_id
        self.end_ns = end_ns
        self.context: SpanContext | None = None


class _Decode:
    __slots__ = ("compute_ns", "first_step", "last", "num_steps", "num_tokens", "span")

    def __init__(self, span: Span, step: _StepRef) -> None:
        self.span = span
        self.first_step = step.step_id
        self.last = step  # the latest step it took part in
        self.num_steps = self.num_tokens = self.compute_ns = 0


class _Request:
    """What the worker's spans need of one request it holds."""

    __slots__ = ("decode", "num_cached", "num_preemptions", "parent", "prefill_until", "req_id")

    def __init__(
        self, req_id: str, parent: Context, prefill_until: int, num_cached: int, preemptions: int
    ) -> None:
        self.req_id = req_id
        self.parent = parent  # the request's trace (the gateway's GenAI span), sampled
        self.prefill_until = prefill_until  # positions below it are prefill (or recompute)
        self.num_cached = num_cached
        self.num_preemptions = preemptions
        self.decode: _Decode | None = None


class RequestSpans:
    """Spans for the steps one worker runs. `requests=False` (a tensor-parallel rank other than
    0, whose work rank 0 already shows) keeps only the step spans."""

    def __init__(
        self,
        tracer: Tracer,
        worker_id: str,
        steps_stream: str,
        *,
        requests: bool = True,
        detailed: bool = False,
    ) -> None:
        self.tracer = lean_tracer(tracer)
        self.worker_id = worker_id
        self.steps_stream = steps_stream
        self.trace_requests = requests
        self.detailed = detailed
        self.epoch: str | None = None
        self.requests: dict[str, _Request] = {}  # sampled requests the worker holds

    # ------------------------------------------------------------------ one step

    def step(self, step: StepMessage, start_ns: int, end_ns: int, error: str | None = None) -> None:
        if step.epoch != self.epoch:
            self.close_all("epoch")  # the workers dropped every request
            self.epoch = step.epoch
        requests = self.requests
        if requests:
            for req_id in step.finished_req_ids:
                self._forget(req_id, "finished")
            for req_id in step.preempted_req_ids:
                self._forget(req_id, "preempted")
        if self.trace_requests:
            for new in step.new_reqs:
                self._forget(new.req_id, "resumed")
                if never_sampled(new.traceparent):
                    continue
                span_context = span_context_from_traceparent(new.traceparent)
                if span_context is not None and span_context.trace_flags.sampled:
                    parent = trace.set_span_in_context(
                        trace.NonRecordingSpan(span_context), Context()
                    )
                    requests[new.req_id] = _Request(
                        new.req_id, parent, len(new.token_ids), new.num_computed_tokens,
                        new.num_preemptions,
                    )  # fmt: skip
        scheduled = step.num_scheduled_tokens
        step_ref = _StepRef(step.step_id, end_ns)
        prefills: list[Span] = []
        started: list[_Decode] = []  # decode runs that began in this step
        decodes: list[_Request] = []  # with --collect-detailed-traces: every decoding request
        links: list[Link] = []
        num_traced = 0
        if requests:
            # Per step and traced request only counters move: this loop runs for every request
            # of every step, so the spans' ends are computed once, when a run ends.
            detailed = self.detailed
            step_ns = end_ns - start_ns
            work: list[NewRequestData | CachedRequestData] = [*step.new_reqs, *step.cached_reqs]
            # The traced ones, picked in C (a step of a ratio's batch holds few of them)
            for data in compress(work, map(requests.__contains__, map(_REQ_ID, work))):
                req_id = data.req_id
                request = requests[req_id]
                num_tokens = scheduled.get(req_id, 0)
                num_traced += 1
                position = data.num_computed_tokens
                if position < request.prefill_until:
                    span = self._prefill_span(request, step, position, num_tokens, start_ns)
                    prefills.append(span)
                    links.append(Link(span.get_span_context(), {Attr.REQUEST_ID: req_id}))
                    if request.decode is not None:  # a chunk after decoding: not expected
                        self._end_decode(request, "prefill")
                    continue
                decode = request.decode
                if decode is None:
                    decode = request.decode = _Decode(
                        self.tracer.start_span(
                            SpanName.DECODE,
                            context=request.parent,
                            start_time=start_ns,
                            attributes={Attr.REQUEST_ID: req_id},
                        ),
                        step_ref,
                    )
                    started.append(decode)
                    links.append(Link(decode.span.get_span_context(), {Attr.REQUEST_ID: req_id}))
                elif detailed:
                    links.append(Link(decode.span.get_span_context(), {Attr.REQUEST_ID: req_id}))
                decode.num_steps += 1
                decode.num_tokens += num_tokens
                decode.compute_ns += step_ns
                decode.last = step_ref
                if detailed:
                    decodes.append(request)
        step_context = self._step_span(step, start_ns, end_ns, links, num_traced, error)
        step_ref.context = step_context
        for span in prefills:
            if step_context is not None:
                span.add_link(step_context)
            if error is not None:
                span.set_attribute(Attr.ERROR_TYPE, error.split(":")[0])
            span.end(end_time=end_ns)
        if step_context is not None:
            for run in started:  # a decode run links to its first step (and, ended, its last)
                run.span.add_link(step_context)
        for request in decodes:
            assert request.decode is not None
            request.decode.span.add_event(
                EventName.STEP,
                {
                    Attr.STEP_ID: step.step_id,
                    Attr.BATCH_SIZE: len(scheduled),
                    Attr.NUM_TOKENS: scheduled.get(request.req_id, 0),
                    Attr.COMPUTE_S: (end_ns - start_ns) / 1e9,
                },
                timestamp=start_ns,
            )

    def _prefill_span(
        self, request: _Request, step: StepMessage, position: int, num_tokens: int, start_ns: int
    ) -> Span:
        return self.tracer.start_span(
            SpanName.PREFILL,
            context=request.parent,
            start_time=start_ns,
            attributes={
                Attr.REQUEST_ID: request.req_id,
                Attr.STEP_ID: step.step_id,
                Attr.BATCH_SIZE: len(step.num_scheduled_tokens),
                Attr.PREFILL_START: position,
                Attr.NUM_COMPUTED_TOKENS: num_tokens,
                Attr.NUM_CACHED_TOKENS: request.num_cached,
                Attr.PREFILL_TOKENS: request.prefill_until,
                Attr.PREFILL_DONE: position + num_tokens >= request.prefill_until,
                Attr.RECOMPUTE: request.num_preemptions > 0,
                Attr.NUM_PREEMPTIONS: request.num_preemptions,
            },
        )

    def _step_span(
        self,
        step: StepMessage,
        start_ns: int,
        end_ns: int,
        links: list[Link],
        num_traced: int,
        error: str | None,
    ) -> SpanContext | None:
        """The step's span, made and ended at once; its context when kept (kvledger_sampler
        keeps a step that links to sampled work, the ratio decides the others); its attributes
        are built only for a step kept."""

        def attributes() -> dict[str, AttributeValue]:
            scheduled = step.num_scheduled_tokens
            num_tokens = sum(scheduled.values())
            # a running request computing one token decodes (counted in C: this runs each step)
            decode_tokens = [*map(scheduled.get, map(_REQ_ID, step.cached_reqs))].count(1)
            attributes: dict[str, AttributeValue] = {
                Attr.STEP_ID: step.step_id,
                Attr.WORKER_ID: self.worker_id,
                Attr.BATCH_SIZE: len(scheduled),
                Attr.NUM_TOKENS: num_tokens,
                Attr.NUM_DECODE_TOKENS: decode_tokens,
                Attr.NUM_PREFILL_TOKENS: num_tokens - decode_tokens,
                Attr.MESSAGING_SYSTEM: "redis",
                Attr.MESSAGING_OPERATION_TYPE: "process",
                Attr.MESSAGING_DESTINATION_NAME: self.steps_stream,
                Attr.MESSAGING_BATCH_MESSAGE_COUNT: len(scheduled),
                Attr.NUM_TRACED_REQUESTS: num_traced,
            }
            if error is not None:
                attributes[Attr.ERROR_TYPE] = error.split(":")[0]
            return attributes

        return record_root_span(
            self.tracer, SpanName.STEP, kind=SpanKind.CONSUMER, start_ns=start_ns, end_ns=end_ns,
            links=links, sampling_attributes={Attr.NUM_TRACED_REQUESTS: num_traced},
            attributes=attributes,
        )  # fmt: skip

    # ------------------------------------------------------------------ ends

    def _forget(self, req_id: str, why: str) -> None:
        request = self.requests.pop(req_id, None)
        if request is not None and request.decode is not None:
            self._end_decode(request, why)

    def _end_decode(self, request: _Request, why: str) -> None:
        decode = request.decode
        assert decode is not None
        request.decode = None
        span = decode.span
        span.set_attributes(
            {
                Attr.NUM_STEPS: decode.num_steps,
                Attr.NUM_COMPUTED_TOKENS: decode.num_tokens,
                Attr.FIRST_STEP_ID: decode.first_step,
                Attr.LAST_STEP_ID: decode.last.step_id,
                Attr.COMPUTE_S: decode.compute_ns / 1e9,
                Attr.SEGMENT_END: why,
                Attr.NUM_PREEMPTIONS: request.num_preemptions,
            }
        )
        last = decode.last.context
        if last is not None and decode.last.step_id != decode.first_step:
            span.add_link(last)
        span.end(end_time=decode.last.end_ns)

    def idle(self) -> None:
        """No step came for a while: end the decode runs (a request that comes back starts a
        new one), so their spans are exported now rather than when the next step comes."""
        for request in self.requests.values():
            if request.decode is not None:
                self._end_decode(request, "idle")

    def close_all(self, why: str) -> None:
        """End every open span and forget every request (a new epoch, the worker stopping)."""
        for request in self.requests.values():
            if request.decode is not None:
                self._end_decode(request, why)
        self.requests.clear()
