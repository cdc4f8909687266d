"""What the ledger tells people about each step: spans in every request's trace, and metrics.

Each admission, preemption and eviction the scheduler reports becomes a span in the trace of the
request it concerns, and cause and effect link both ways:

- `kvledger.queue` (enqueue -> admission, or abort) and `kvledger.admit` (the prefix hit, blocks
  allocated; when the request misses blocks its prefix had, how many tokens it lost and a link to
  the `kvledger.evict` that took them);
- `kvledger.preempt` in the victim's trace links to `kvledger.preempting` in the trace of the
  request whose growth forced it, which names (and links to) every request it preempted;
- `kvledger.evict`: one span per run of a request's allocations (from its admission until it is
  preempted or ends) with counts and a link to every request whose cached blocks it took.

The ledger keeps a bounded memory of which block hashes it evicted for whom (`MAX_EVICTED`), so
a later miss can name its cause. Only sampled requests (the traceparent's flag, decided once at
the gateway) cost spans; the rest cost a dictionary look-up per admission and preemption, and a
tuple per block their allocations evict (what a sampled request's lost prefix may point to).
A traceparent is parsed only where its context is used (a sampled request's spans, a log line).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from itertools import islice

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanContext
from opentelemetry.util.types import AttributeValue

from engine.translate import Tracked
from ledger.block import BlockHash
from ledger.hashing import to_event_hash
from ledger.kv_cache_manager import KVCacheManager, PrefixCacheStats
from ledger.offloading.shared import TieringManager
from ledger.request import Request
from ledger.scheduler import Admission, Preemption, Scheduler, SchedulerOutput
from ledger.step_costs import StepCostEstimator
from observability import (
    Attr,
    EventName,
    LedgerMetrics,
    SpanName,
    format_block_hashes,
    get_logger,
    in_trace,
    lean_tracer,
    never_sampled,
    record_span,
    span_context_from_traceparent,
)

MAX_REMEMBERED_TRACES = 200_000  # request ids whose trace later spans may still link to
MAX_EVICTED = 65_536  # evicted block hashes remembered, with who evicted them for whom
MAX_EVICT_LINKS = 64  # links of one kvledger.evict span (the owners with the most blocks)
MAX_EVICTED_HASHES = 1024  # hashes listed on one kvledger.evict span
MAX_HOLDS = 65_536  # runs of held steps remembered (a wait longer than that is cut short)
MAX_QUEUE_EVENTS = 16  # kvledger.queue.held events on one queue span (the attributes count all)

log = get_logger("kvledger.ledger")
_stdlib_log = logging.getLogger("kvledger.ledger")  # its level, read before a debug line


@dataclass(slots=True)
class _Wait:
    """A request in the waiting queue, since it (re)entered it."""

    since_ns: int
    resumed: bool
    first_step: int  # the first scheduler step that could have admitted it
    priority: int = 0
    ahead: int | None = None  # waiting requests ahead of it then (sampled traces only)


@dataclass(slots=True)
class _Hold:
    """A run of steps whose admissions stopped at the same head of `waiting`, for one reason."""

    first_step: int
    last_step: int
    first_ns: int
    head: str
    head_priority: int
    reason: str


@dataclass(slots=True)
class _EvictRun:
    """The evictions of one request's allocations from its admission on: one span, ended when
    the request is preempted or ends (start: the first eviction, end: the last)."""

    span: Span  # a sampled request's (the others' evictions are only remembered)
    first_ns: int
    last_ns: int = 0
    num_blocks: int = 0
    owners: dict[str, int] = field(default_factory=dict)
    hashes: list[BlockHash] = field(default_factory=list)

    @property
    def context(self) -> SpanContext:
        return self.span.get_span_context()


# Who evicted a cached block, and the kvledger.evict span saying so (None: not sampled).
_Evicted = tuple[str, SpanContext | None]


def _sampled(traceparent: str | None) -> SpanContext | None:
    """The span a traceparent names when its trace is sampled, else None (an unsampled one is
    told by its flags without parsing it)."""
    if never_sampled(traceparent):
        return None
    span_context = span_context_from_traceparent(traceparent)
    return span_context if span_context is not None and span_context.trace_flags.sampled else None


class LedgerTelemetry:
    def __init__(
        self,
        tracer,
        metrics: LedgerMetrics | None,
        scheduler: Scheduler[Tracked] | None = None,
        costs: StepCostEstimator | None = None,
    ) -> None:
        self.tracer = lean_tracer(tracer)
        self.metrics = metrics
        self.costs = costs  # the queue waits feed the step costs published for routers
        self.scheduler = scheduler
        self.block_size = scheduler.block_size if scheduler is not None else 16
        # req_id -> the traceparent its trace continues from (sampled or not; parsed only where
        # used), kept after the request ends: later preemptions and evictions link back to it.
        self.contexts: OrderedDict[str, str | None] = OrderedDict()
        self.parents: OrderedDict[str, Context] = (
            OrderedDict()
        )  # of sampled requests, until they end
        self.waits: dict[str, _Wait] = {}  # requests in the waiting queue
        self.evict_runs: dict[str, _EvictRun] = {}
        self.evicted: OrderedDict[BlockHash, _Evicted] = OrderedDict()
        self.holds: deque[_Hold] = deque(maxlen=MAX_HOLDS)
        self.priority_policy = scheduler is not None and scheduler.config.policy == "priority"
        self._stats_seen = PrefixCacheStats()
        self._tier_seen = PrefixCacheStats()
        self._tier_blocks_seen = (0, 0)
        self._stores_skipped_seen = 0
        # A CPU-tier chunk's bytes: one block of every worker (the engine sets it once sized).
        self.tier_bytes_per_block = 0
        self._shared_blocks_seen = (
            0,
            0,
        )  # shared-tier blocks (promoted, cascaded) counted        # req_id -> when its first load or promotion went out (sampled requests' admissions).
        self.loads_since: dict[str, int] = {}
        self._prompt_computed_seen = 0
        self._evicted_blocks = 0

    # ------------------------------------------------------------------ requests in and out

    def request_added(self, request: Request[Tracked]) -> None:
        """A request entered the waiting queue (after `Scheduler.add_request`)."""
        request_id = request.request_id
        traceparent = request.payload.msg.traceparent
        self.contexts[request_id] = traceparent
        if len(self.contexts) > MAX_REMEMBERED_TRACES:
            self.contexts.popitem(last=False)
        self.waits[request_id] = self._wait(
            request, int(request.arrival_time * 1e9), resumed=False, traceparent=traceparent
        )

    def _wait(
        self,
        request: Request[Tracked],
        since_ns: int,
        *,
        resumed: bool,
        traceparent: str | None,
        first_step: int | None = None,
    ) -> _Wait:
        scheduler = self.scheduler
        step_id = scheduler.step_id if scheduler is not None else 0
        wait = _Wait(
            since_ns, resumed, step_id + 1 if first_step is None else first_step, request.priority
        )
        if self.tracer is not None and scheduler is not None and _sampled(traceparent) is not None:
            wait.ahead = scheduler.waiting.num_ahead(request)
        return wait

    def request_finished(self, request_id: str, outcome: str | None = None) -> None:
        """The request ended (`outcome`: its finish reason): a request still waiting gets its
        queue span now, so a request aborted in the queue still shows how long it waited."""
        now = time.time_ns()
        self._end_evict_run(request_id)
        wait = self.waits.pop(request_id, None)
        if wait is not None and self.tracer is not None:
            parent = self._parent(request_id)
            if parent is not None:
                last_step = self.scheduler.step_id if self.scheduler is not None else 0
                self._queue_span(request_id, wait, parent, now, last_step, outcome or "ended")
        self.parents.pop(request_id, None)

    def close(self) -> None:
        """The ledger stops: end the spans still open."""
        for request_id in list(self.evict_runs):
            self._end_evict_run(request_id)

    # ------------------------------------------------------------------ one step

    def on_schedule(
        self, out: SchedulerOutput[Tracked], manager: KVCacheManager, now: int | None = None
    ) -> None:
        """The step's admissions, preemptions, evictions and hold; `now`: when it was
        scheduled (wall-clock ns), before the workers started on it."""
        now = time.time_ns() if now is None else now
        if out.kv_transfers is not None and self.tracer is not None:
            self._loads_started(out, now)
        if out.evictions:
            self._evictions(out, now)
        if out.admissions:
            requests = {new.request.request_id: new.request for new in out.scheduled_new_reqs}
            for admission in out.admissions:
                self._admitted(admission, requests.get(admission.request_id), now, out.step_id)
        if out.preemptions:
            self._preemptions(out, now)
        if out.waiting_held is not None and self.tracer is not None:
            self._record_hold(
                out.step_id, out.waiting_held.request_id, out.waiting_held.reason, now
            )
        if self.metrics is not None and out.preemptions:
            self.metrics.record_preemptions(len(out.preemptions))

    def _loads_started(self, out: SchedulerOutput[Tracked], now: int) -> None:
        """When each request's first copy toward its admission went out (a promotion from the
        shared tier, or the CPU tier's load): its admit span says how long the loads took."""
        meta = out.kv_transfers
        assert meta is not None
        started = self.loads_since
        for job in meta.load_jobs.values():
            started.setdefault(job.req_id, now)
        if meta.shared:
            for promotion in meta.shared.promotions:
                if promotion.context is not None:
                    started.setdefault(promotion.context.req_id, now)
        while len(started) > MAX_REMEMBERED_TRACES:  # requests aborted while loading
            del started[next(iter(started))]

    def _admitted(
        self, admission: Admission, request: Request[Tracked] | None, now: int, step_id: int
    ) -> None:
        rid = admission.request_id
        wait = self.waits.pop(rid, None)
        loads_since = self.loads_since.pop(rid, None)
        since = wait.since_ns if wait is not None else now
        if _stdlib_log.isEnabledFor(logging.DEBUG):
            with self.in_request(rid):
                log.debug(
                    "request_admitted",
                    req_id=rid,
                    resumed=admission.resumed,
                    prefix_hit_tokens=admission.num_hit_tokens,
                    blocks_allocated=admission.num_new_blocks,
                )
        if not admission.resumed:
            queued_s = max(now - since, 0) / 1e9
            expected = None
            if request is not None:
                request.payload.queued_s = queued_s  # the gateway's gen_ai.latency.time_in_queue
                expected = request.payload.msg.expected_cached_tokens
            if self.costs is not None:
                self.costs.observe_queue_wait(queued_s)
            if self.metrics is not None:
                self.metrics.record_queue_time(queued_s)
                if expected is not None:  # the router expected this prefix here: did it find it?
                    # Its GPU hit and what the CPU tier loaded: routers count both, as vLLM
                    # counts a loaded block as cached.
                    self.metrics.record_routed_hits(
                        expected_tokens=expected,
                        found_tokens=admission.num_hit_tokens + admission.num_loaded_tokens,
                    )
        if self.tracer is None:
            return
        parent = self._parent(rid)
        if parent is None:
            return
        if wait is not None:
            self._queue_span(rid, wait, parent, now, step_id - 1, "admitted")
        attributes: dict[str, AttributeValue] = {
            Attr.REQUEST_ID: rid,
            Attr.RESUMED: admission.resumed,
            Attr.PREFIX_HIT_TOKENS: admission.num_hit_tokens,
            Attr.PREFIX_HIT_BLOCKS: admission.num_hit_blocks,
            Attr.BLOCKS_ALLOCATED: admission.num_new_blocks,
            Attr.FREE_BLOCKS_AFTER: admission.num_free_blocks_after,
            Attr.WATERMARK_APPLIED: admission.watermark_applied,
        }
        if admission.num_loaded_tokens:
            attributes[Attr.LOADED_TOKENS] = admission.num_loaded_tokens
            if loads_since is not None:
                attributes[Attr.LOADED_WAIT_S] = round(max(now - loads_since, 0) / 1e9, 6)
            blocks = admission.num_loaded_tokens // self.block_size
            attributes[Attr.LOADED_BYTES] = blocks * self.tier_bytes_per_block
            attributes[Attr.LOADED_SHARED_BLOCKS] = admission.num_shared_blocks
            if admission.shared_from:
                attributes[Attr.LOADED_FROM_REPLICAS] = list(admission.shared_from)
        if request is not None and not admission.resumed:
            hit = admission.num_hit_tokens + admission.num_loaded_tokens
            attributes[Attr.RECOMPUTED_TOKENS] = max(request.num_prompt_tokens - hit, 0)
        links: list[Link] = []
        if request is not None:
            num_lost, evictors = self._prefix_lost(request, admission.num_hit_blocks)
            if num_lost:
                attributes[Attr.PREFIX_LOST_BLOCKS] = num_lost
                attributes[Attr.PREFIX_LOST_TOKENS] = num_lost * self.block_size
                attributes[Attr.PREFIX_LOST_EVICTED_BY] = sorted(evictors)
                for by, (span_context, count) in evictors.items():
                    if span_context is not None:
                        links.append(
                            Link(
                                span_context, {Attr.REQUEST_ID: by, Attr.PREFIX_LOST_BLOCKS: count}
                            )
                        )
        record_span(
            self.tracer, SpanName.ADMIT, start_ns=now, end_ns=now, context=parent,
            attributes=attributes, links=links,
        )  # fmt: skip

    def _prefix_lost(
        self, request: Request[Tracked], num_hit_blocks: int
    ) -> tuple[int, dict[str, tuple[SpanContext | None, int]]]:
        """How many blocks past its prefix hit the request would have hit had they not been
        evicted (consecutive, as a hit is), and who evicted them (the eviction's span, and how
        many each)."""
        evicted = self.evicted
        if not evicted or request.skip_reading_prefix_cache or not request.block_hashes:
            return 0, {}
        limit = (request.num_tokens - 1) // self.block_size  # the last token is never a hit
        num_lost = 0
        evictors: dict[str, tuple[SpanContext | None, int]] = {}
        for block_hash in islice(request.block_hashes, num_hit_blocks, limit):
            record = evicted.get(block_hash)
            if record is None:
                break
            num_lost += 1
            by, span_context = record
            _, count = evictors.get(by, (span_context, 0))
            evictors[by] = (span_context, count + 1)
        return num_lost, evictors

    def _preemptions(self, out: SchedulerOutput[Tracked], now: int) -> None:
        preemptions = out.preemptions
        by_cause: dict[str, list[Preemption]] = {}
        scheduler = self.scheduler
        for preemption in preemptions:
            victim = preemption.request_id
            request = scheduler.requests.get(victim) if scheduler is not None else None
            if request is not None:
                # Preempted in this step, a request is already checked in it; preempted
                # between steps (a lost worker), from the next one.
                first = out.step_id + (preemption.reason != "kv_cache_full")
                self.waits[victim] = self._wait(
                    request, now, resumed=True, traceparent=self.contexts.get(victim),
                    first_step=first,
                )  # fmt: skip
            self._end_evict_run(victim)
            with self.in_request(victim):
                # vLLM warns on every preemption too: it is the first sign of a pool too small.
                log.warning(
                    "request_preempted",
                    req_id=victim,
                    reason=preemption.reason,
                    caused_by=preemption.caused_by,
                    blocks_freed=preemption.num_blocks_freed,
                )
            if preemption.caused_by != victim:
                by_cause.setdefault(preemption.caused_by, []).append(preemption)
        if self.tracer is None:
            return
        causes: dict[str, Span] = {}
        for cause, caused in by_cause.items():
            parent = self._parent(cause)
            if parent is not None:
                causes[cause] = self.tracer.start_span(
                    SpanName.PREEMPTING,
                    context=parent,
                    start_time=now,
                    attributes={
                        Attr.REQUEST_ID: cause,
                        Attr.PREEMPTED_REQUEST_IDS: [p.request_id for p in caused],
                        Attr.NUM_PREEMPTED: len(caused),
                        Attr.BLOCKS_FREED: sum(p.num_blocks_freed for p in caused),
                    },
                )
        for preemption in preemptions:
            victim, cause = preemption.request_id, preemption.caused_by
            parent = self._parent(victim)
            if parent is None:
                continue
            cause_span = causes.get(cause)
            links = []
            if cause_span is not None:
                links.append(Link(cause_span.get_span_context(), {Attr.REQUEST_ID: cause}))
            span = record_span(
                self.tracer,
                SpanName.PREEMPT,
                start_ns=now,
                end_ns=now,
                context=parent,
                links=links,
                attributes={
                    Attr.REQUEST_ID: victim,
                    Attr.PREEMPT_REASON: preemption.reason,
                    Attr.BLOCKS_FREED: preemption.num_blocks_freed,
                    Attr.CAUSED_BY_REQUEST_ID: cause,
                },
            )
            if cause_span is not None:
                cause_span.add_link(span.get_span_context(), {Attr.REQUEST_ID: victim})
        for span in causes.values():
            span.end(end_time=now)

    # ------------------------------------------------------------------ waiting

    def _record_hold(self, step_id: int, head: str, reason: str, now: int) -> None:
        holds = self.holds
        last = holds[-1] if holds else None
        if (
            last is not None
            and last.head == head
            and last.reason == reason
            and last.last_step == step_id - 1
        ):
            last.last_step = step_id
            return
        request = self.scheduler.requests.get(head) if self.scheduler is not None else None
        priority = request.priority if request is not None else 0
        holds.append(_Hold(step_id, step_id, now, head, priority, reason))

    def _queue_span(
        self, request_id: str, wait: _Wait, parent: Context, now: int, last_step: int, outcome: str
    ) -> None:
        """kvledger.queue from (re)entering the queue to `now`: what held it back at each check
        in steps first_step..last_step, as runs (an event each) and counts per reason."""
        runs: list[list] = []  # [label, checks, first_ns, head]
        for hold in reversed(self.holds):  # newest first; stop at the wait's first step
            if hold.last_step < wait.first_step:
                break
            first, last = max(hold.first_step, wait.first_step), min(hold.last_step, last_step)
            if last < first:
                continue
            if hold.head == request_id:
                label = hold.reason
            elif self.priority_policy and hold.head_priority < wait.priority:
                label = "priority"
            else:
                label = "queue"
            if runs and runs[-1][0] == label:
                runs[-1][1] += last - first + 1
                runs[-1][2] = hold.first_ns
            else:
                runs.append([label, last - first + 1, hold.first_ns, hold.head])
        runs.reverse()
        checks: dict[str, int] = {}
        for label, count, _, _ in runs:
            checks[label] = checks.get(label, 0) + count
        attributes: dict[str, AttributeValue] = {
            Attr.REQUEST_ID: request_id,
            Attr.RESUMED: wait.resumed,
            Attr.QUEUE_OUTCOME: outcome,
            Attr.QUEUE_CHECKS: sum(checks.values()),
            Attr.QUEUE_REASONS: list(checks),
            Attr.QUEUE_REASON_CHECKS: list(checks.values()),
        }
        # No check held it: it waited only for the engine's next step (the steps in flight).
        attributes[Attr.QUEUE_REASON] = runs[-1][0] if runs else "next_step"
        if wait.ahead is not None:
            attributes[Attr.QUEUE_AHEAD] = wait.ahead
        span = self.tracer.start_span(
            SpanName.QUEUE, context=parent, start_time=wait.since_ns, attributes=attributes
        )
        for label, count, first_ns, head in runs[:MAX_QUEUE_EVENTS]:
            event: dict[str, AttributeValue] = {Attr.QUEUE_REASON: label, Attr.QUEUE_CHECKS: count}
            if head != request_id:
                event[Attr.HELD_BY_REQUEST_ID] = head
            span.add_event(EventName.QUEUE_HELD, event, timestamp=max(first_ns, wait.since_ns))
        span.end(end_time=max(now, wait.since_ns))

    # ------------------------------------------------------------------ evictions

    def _evictions(self, out: SchedulerOutput[Tracked], now: int) -> None:
        for rid, evictions in out.evictions.items():
            self._evicted_blocks += len(evictions)
            if self.metrics is not None:
                self.metrics.record_evictions(len(evictions))
            if self.tracer is None:
                continue
            remembered = self.evicted
            run = self.evict_runs.get(rid)
            if run is None:
                parent = self._parent(rid)
                if parent is None:  # not sampled: only remembered, for a later lost prefix
                    record: _Evicted = (rid, None)
                    for eviction in evictions:
                        remembered.pop(eviction.block_hash, None)
                        remembered[eviction.block_hash] = record
                    while len(remembered) > MAX_EVICTED:
                        remembered.popitem(last=False)
                    continue
                span = self.tracer.start_span(
                    SpanName.EVICT, context=parent, start_time=now,
                    attributes={Attr.REQUEST_ID: rid},
                )  # fmt: skip
                run = self.evict_runs[rid] = _EvictRun(span, first_ns=now)
            run.last_ns = now
            run.num_blocks += len(evictions)
            record = (rid, run.context)
            owners = run.owners
            for eviction in evictions:
                block_hash = eviction.block_hash
                remembered.pop(block_hash, None)
                remembered[block_hash] = record
                if eviction.stored_by is not None:
                    owners[eviction.stored_by] = owners.get(eviction.stored_by, 0) + 1
                if len(run.hashes) < MAX_EVICTED_HASHES:
                    run.hashes.append(block_hash)
            while len(remembered) > MAX_EVICTED:
                remembered.popitem(last=False)

    def _end_evict_run(self, request_id: str) -> None:
        run = self.evict_runs.pop(request_id, None)
        if run is None:
            return
        span = run.span
        span.set_attributes(
            {
                Attr.NUM_EVICTED_BLOCKS: run.num_blocks,
                Attr.EVICTED_BLOCK_HASHES: format_block_hashes(
                    to_event_hash(h) for h in run.hashes
                ),
                Attr.EVICTED_FROM_REQUEST_IDS: sorted(run.owners),
            }
        )
        top = sorted(run.owners.items(), key=lambda item: -item[1])[:MAX_EVICT_LINKS]
        for owner, count in top:
            owner_context = _sampled(self.contexts.get(owner))
            if owner_context is not None:
                span.add_link(
                    owner_context, {Attr.REQUEST_ID: owner, Attr.NUM_EVICTED_BLOCKS: count}
                )
        span.end(end_time=run.last_ns)

    # ------------------------------------------------------------------ contexts

    def _parent(self, request_id: str) -> Context | None:
        """The context a span of this request starts in, None when its trace is not sampled
        (made once per request: its queue, admission and evictions start there)."""
        parent = self.parents.get(request_id)
        if parent is not None:
            return parent
        span_context = _sampled(self.contexts.get(request_id))
        if span_context is None:
            return None
        parent = trace.set_span_in_context(trace.NonRecordingSpan(span_context), Context())
        self.parents[request_id] = parent
        if len(self.parents) > MAX_REMEMBERED_TRACES:
            self.parents.popitem(last=False)
        return parent

    def in_request(self, request_id: str) -> contextlib.AbstractContextManager[None]:
        """Log lines written inside carry the request's trace id."""
        return in_trace(self.contexts.get(request_id))

    # ------------------------------------------------------------------ metrics

    def update_metrics(self, scheduler: Scheduler, manager: KVCacheManager) -> None:
        if self.metrics is None:
            return
        self.metrics.set_scheduler_state(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=manager.usage,
        )
        stats, seen = manager.prefix_cache_stats, self._stats_seen
        if stats.queries != seen.queries or stats.hits != seen.hits:
            self.metrics.record_prefix_cache(
                queried_tokens=stats.queries - seen.queries, hit_tokens=stats.hits - seen.hits
            )
            seen.queries, seen.hits = stats.queries, stats.hits
        computed = scheduler.num_prompt_tokens_computed
        if computed != self._prompt_computed_seen:
            self.metrics.record_prompt_tokens_computed(computed - self._prompt_computed_seen)
            self._prompt_computed_seen = computed
        if scheduler.connector is not None:
            self._update_tier_metrics(scheduler)

    def _update_tier_metrics(self, scheduler: Scheduler) -> None:
        assert self.metrics is not None
        stats, seen = scheduler.connector_prefix_cache_stats, self._tier_seen
        if stats.queries != seen.queries or stats.hits != seen.hits:
            self.metrics.record_external_prefix_cache(
                queried_tokens=stats.queries - seen.queries, hit_tokens=stats.hits - seen.hits
            )
            seen.queries, seen.hits = stats.queries, stats.hits
        loaded, stored = scheduler.num_loaded_blocks, scheduler.num_stored_blocks
        if (loaded, stored) != self._tier_blocks_seen:
            seen_loaded, seen_stored = self._tier_blocks_seen
            self.metrics.record_cpu_tier(
                loaded_blocks=loaded - seen_loaded,
                stored_blocks=stored - seen_stored,
                bytes_per_block=self.tier_bytes_per_block,
            )
            self._tier_blocks_seen = (loaded, stored)
        connector = scheduler.connector
        assert connector is not None
        tier = connector.manager
        if isinstance(tier, TieringManager):
            tier = tier.primary  # the CPU tier's own figures; the shared tier's below
        self.metrics.set_cpu_tier_state(
            held_blocks=tier.num_allocated - len(tier.free_list), usage=tier.usage()
        )
        if tier.stores_skipped != self._stores_skipped_seen:
            self.metrics.record_stores_skipped(tier.stores_skipped - self._stores_skipped_seen)
            self._stores_skipped_seen = tier.stores_skipped
        tiering = connector.manager
        if isinstance(tiering, TieringManager):
            shared = tiering.stats
            read, written = self._shared_blocks_seen
            if (shared.promotions, shared.cascades) != (read, written):
                self.metrics.record_shared_tier_bytes(
                    (shared.promotions - read) * self.tier_bytes_per_block,
                    (shared.cascades - written) * self.tier_bytes_per_block,
                )
                self._shared_blocks_seen = (shared.promotions, shared.cascades)
            self.metrics.record_shared_tier(
                {
                    "promoted_blocks": shared.promotions,
                    "promotion_failures": shared.promotion_failures,
                    "cascaded_blocks": shared.cascades,
                    "cascade_failures": shared.cascade_failures,
                    "evicted_blocks": shared.evictions,
                    "unreachable_blocks": shared.unreachable,
                }
            )
