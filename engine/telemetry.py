"""What the ledger tells people about each step: spans in every request's trace, and metrics.

Each admission, preemption and eviction the scheduler reports becomes a span in the trace of the
request it concerns (`kvledger.queue`, `kvledger.admit`, `kvledger.preempt`, `kvledger.evict`);
an eviction links to the traces of the requests that had stored the evicted blocks, which is how
a reader learns who lost their cached prefix to whom.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Iterator

from opentelemetry import context as otel_context

from ledger.hashing import to_event_hash
from ledger.kv_cache_manager import KVCacheManager, PrefixCacheStats
from ledger.scheduler import Scheduler, SchedulerOutput
from ledger.step_costs import StepCostEstimator
from observability import (
    Attr,
    LedgerMetrics,
    SpanName,
    extract_context,
    format_block_hashes,
    get_logger,
    links_from_traceparents,
    record_span,
)

MAX_REMEMBERED_TRACES = 200_000

log = get_logger("kvledger.ledger")


class LedgerTelemetry:
    def __init__(
        self, tracer, metrics: LedgerMetrics | None, costs: StepCostEstimator | None = None
    ) -> None:
        self.tracer = tracer
        self.metrics = metrics
        self.costs = costs  # the queue waits feed the step costs published for routers
        # req_id -> the prefix its router expected here, until its first admission.
        self.expected_hits: dict[str, int] = {}
        # req_id -> traceparent, kept after a request ends: evictions link back to it.
        self.traceparents: OrderedDict[str, str | None] = OrderedDict()
        # req_id -> wall-clock ns since it (re)entered the waiting queue.
        self.waiting_since: dict[str, int] = {}
        self._stats_seen = PrefixCacheStats()
        self._evicted_blocks = 0

    def request_added(
        self,
        request_id: str,
        traceparent: str | None,
        arrival_time: float,
        expected_cached_tokens: int | None = None,
    ) -> None:
        self.traceparents[request_id] = traceparent
        if len(self.traceparents) > MAX_REMEMBERED_TRACES:
            self.traceparents.popitem(last=False)
        self.waiting_since[request_id] = int(arrival_time * 1e9)
        if expected_cached_tokens is not None:
            self.expected_hits[request_id] = expected_cached_tokens

    def request_finished(self, request_id: str) -> None:
        self.waiting_since.pop(request_id, None)
        self.expected_hits.pop(request_id, None)

    def on_schedule(self, out: SchedulerOutput, manager: KVCacheManager) -> None:
        now = time.time_ns()
        for admission in out.admissions:
            rid = admission.request_id
            since = self.waiting_since.pop(rid, now)
            with self._in_request(rid):
                log.debug(
                    "request_admitted",
                    req_id=rid,
                    resumed=admission.resumed,
                    prefix_hit_tokens=admission.num_hit_tokens,
                    blocks_allocated=admission.num_new_blocks,
                )
            if not admission.resumed:
                self._admitted(rid, admission.num_hit_tokens, max(now - since, 0) / 1e9)
            if self.tracer is None:
                continue
            ctx = extract_context(self.traceparents.get(rid))
            record_span(
                self.tracer,
                SpanName.QUEUE,
                start_ns=since,
                end_ns=now,
                context=ctx,
                attributes={Attr.REQUEST_ID: rid, Attr.RESUMED: admission.resumed},
            )
            record_span(
                self.tracer,
                SpanName.ADMIT,
                start_ns=now,
                end_ns=now,
                context=ctx,
                attributes={
                    Attr.REQUEST_ID: rid,
                    Attr.RESUMED: admission.resumed,
                    Attr.PREFIX_HIT_TOKENS: admission.num_hit_tokens,
                    Attr.PREFIX_HIT_BLOCKS: admission.num_hit_blocks,
                    Attr.BLOCKS_ALLOCATED: admission.num_new_blocks,
                    Attr.FREE_BLOCKS_AFTER: admission.num_free_blocks_after,
                    Attr.WATERMARK_APPLIED: admission.watermark_applied,
                },
            )
        for preemption in out.preemptions:
            self.waiting_since[preemption.request_id] = now
            with self._in_request(preemption.request_id):
                # vLLM warns on every preemption too: it is the first sign of a pool too small.
                log.warning(
                    "request_preempted",
                    req_id=preemption.request_id,
                    reason=preemption.reason,
                    caused_by=preemption.caused_by,
                    blocks_freed=preemption.num_blocks_freed,
                )
            if self.tracer is not None:
                record_span(
                    self.tracer,
                    SpanName.PREEMPT,
                    start_ns=now,
                    end_ns=now,
                    context=extract_context(self.traceparents.get(preemption.request_id)),
                    attributes={
                        Attr.REQUEST_ID: preemption.request_id,
                        Attr.PREEMPT_REASON: preemption.reason,
                        Attr.BLOCKS_FREED: preemption.num_blocks_freed,
                        Attr.CAUSED_BY_REQUEST_ID: preemption.caused_by,
                    },
                )
        for rid, evictions in out.evictions.items():
            self._evicted_blocks += len(evictions)
            if self.tracer is None:
                continue
            owners: dict[str, int] = {}
            for eviction in evictions:
                if eviction.stored_by is not None:
                    owners[eviction.stored_by] = owners.get(eviction.stored_by, 0) + 1
            links = links_from_traceparents(
                (
                    self.traceparents.get(owner),
                    {Attr.REQUEST_ID: owner, Attr.NUM_EVICTED_BLOCKS: count},
                )
                for owner, count in owners.items()
            )
            record_span(
                self.tracer,
                SpanName.EVICT,
                start_ns=now,
                end_ns=now,
                context=extract_context(self.traceparents.get(rid)),
                links=links,
                attributes={
                    Attr.REQUEST_ID: rid,
                    Attr.NUM_EVICTED_BLOCKS: len(evictions),
                    Attr.EVICTED_BLOCK_HASHES: format_block_hashes(
                        to_event_hash(e.block_hash) for e in evictions
                    ),
                    Attr.EVICTED_FROM_REQUEST_IDS: sorted(owners),
                },
            )
        if self.metrics is not None:
            if out.preemptions:
                self.metrics.record_preemptions(len(out.preemptions))
            evicted = sum(len(e) for e in out.evictions.values())
            if evicted:
                self.metrics.record_evictions(evicted)

    def _admitted(self, request_id: str, hit_tokens: int, waited_s: float) -> None:
        """A request's first admission: its queue wait, and the prefix it found against the
        one its router expected (a shortfall: the router counted blocks evicted meanwhile)."""
        if self.costs is not None:
            self.costs.observe_queue_wait(waited_s)
        expected = self.expected_hits.pop(request_id, None)
        if self.metrics is None:
            return
        self.metrics.record_queue_time(waited_s)
        if expected is not None:
            self.metrics.record_routed_hits(expected_tokens=expected, found_tokens=hit_tokens)

    @contextlib.contextmanager
    def _in_request(self, request_id: str) -> Iterator[None]:
        """Log lines written here carry the request's trace id (the logging processor reads it)."""
        token = otel_context.attach(extract_context(self.traceparents.get(request_id)))
        try:
            yield
        finally:
            otel_context.detach(token)

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
