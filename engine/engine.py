"""The engine: the ledger core (scheduler, KV cache manager, block pool) behind Redis Streams.

One engine loop owns every piece of ledger state and is the only task that changes it: it takes
new requests and aborts from the intake queue, schedules a step, appends it for the workers,
waits for their sampled tokens, applies them, streams outputs to the gateways and publishes the
KV events. Other tasks only read streams and keys (requests, results, worker heartbeats) and
hand what they read to the engine loop.

An `Engine` is built whole, once the workers have reported and the pool is sized
(`engine.process` waits for the lease and the workers first).
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import time
import uuid

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from engine.event_stream import KVEventStream
from engine.intake import RequestIntake
from engine.leadership import Leadership
from engine.outputs import GatewayOutputs
from engine.quarantine import Quarantine
from engine.shared_tier import SharedTierShell
from engine.step_results import StepResults
from engine.telemetry import LedgerTelemetry
from engine.tiers import build_connector, shared_tier_shell
from engine.translate import (
    Tracked,
    build_step_message,
    failure_output,
    file_logprobs,
    rejection,
    request_from_message,
    request_output,
    validate_request,
)
from engine.workers import (
    PoolPlan,
    group_view,
    membership_changes,
    plan_cpu_tier,
    tier_load_costs,
)
from engine.zmq_events import ZmqEventPublisher
from ledger.events import MEDIUM_CPU, AllBlocksCleared
from ledger.hashing import BlockHasher
from ledger.kv_cache_manager import KVCacheManager
from ledger.offloading.shared import TieringManager
from ledger.request import Request, RequestStatus
from ledger.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from ledger.step_costs import EVICTION_INTERVAL_S, StepCostEstimator, eviction_horizon
from observability import LedgerMetrics, get_logger, in_trace, new_registry
from services.config import LedgerConfig
from services.startup import freeze_after_startup
from services.transport import redis_streams, registry
from services.transport.keys import STEPS_MAXLEN
from services.wire.codec import WireError, encode, kind_of
from services.wire.messages import (
    TIER_SHARED,
    AbortRequest,
    EvictionHead,
    GenerateRequest,
    LedgerStatus,
    RequestOutput,
    RoutingCosts,
    StepResult,
    WorkerHello,
)

log = get_logger("kvledger.ledger")
# A gateway's marker absent this long is a dead gateway, not a Redis that lost its data (the
# gateway renews the marker every second and re-makes it after a loss).
GATEWAY_MISSING_GRACE_S = 3.0


class Engine:
    """The step loop over a sized pool: `run` until `stopping` is set, a background reader
    crashes (re-raised), or a successor takes the lease (`LeadershipLost`)."""

    def __init__(
        self,
        config: LedgerConfig,
        r: aioredis.Redis,
        leadership: Leadership,
        plan: PoolPlan,
        workers: dict[str, WorkerHello],
        stopping: asyncio.Event,
        tracer=None,
    ) -> None:
        self.cfg = config
        self.r = r
        self.streams = config.streams
        self.leadership = leadership
        self.stopping = stopping
        self.ledger_id = uuid.uuid4().hex[:12]
        self.generation = 0  # bumped whenever the workers' KV data is lost
        self.started_at = time.time()
        self.crashed: BaseException | None = None
        # The workers' KV data can no longer be trusted (a worker lost or joined, Redis lost
        # with steps in flight): the reason, until the loop starts a new epoch for it.
        self.epoch_invalidated: str | None = None
        self.workers = workers
        self.no_worker_since: float | None = None  # monotonic time the last worker was lost
        # Gateways whose marker key the status loop saw (they hold running requests), and the
        # requests of those whose marker then went away, for the engine loop to abort.
        self.gateways_seen: set[str] = set()
        self.gateways_missing: dict[str, float] = {}  # gateway -> since when its marker is absent
        self.gone_gateways: dict[str, list[str]] = {}
        self.num_gpu_blocks, self.vocab_size = plan.num_gpu_blocks, plan.vocab_size
        self.model_name, self.capacity = plan.model_name, plan.capacity_line

        self.manager = KVCacheManager(
            plan.num_gpu_blocks,
            config.block_size,
            config.max_model_len,
            enable_caching=config.enable_prefix_caching,
            enable_kv_cache_events=True,
            watermark=config.watermark,
            record_evictions=True,
        )
        # The CPU tier (--kv-offloading-size / --kv-transfer-config): off unless configured.
        self.num_cpu_chunks, connector, tier_line = 0, None, None
        self.hasher = BlockHasher(config.hash_algo) if config.enable_prefix_caching else None
        self.shared: SharedTierShell | None = None
        if config.offloading is not None:
            self.num_cpu_chunks, tier_line = plan_cpu_tier(
                config.offloading, plan, config.block_size
            )
            connector = build_connector(
                config.offloading, self.num_cpu_chunks, config.block_size,
                shared=config.kv_shared_tier, locality=config.kv_shared_tier_locality,
                replica=config.replica, bytes_per_block=plan.bytes_per_block,
            )  # fmt: skip
            if isinstance(connector.manager, TieringManager):
                self.shared = shared_tier_shell(
                    config, r, connector.manager, self.hasher, workers, leadership
                )
        self.scheduler: Scheduler[Tracked] = Scheduler(
            SchedulerConfig(
                max_model_len=config.max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                policy=config.policy,
                async_scheduling=config.async_scheduling,
            ),
            self.manager,
            connector,
        )
        # What loads from the tiers beyond the workers' CPU one cost, measured from their
        # backends (tier -> seconds per block), for the status: the shared tier's, at start-up.
        self.measured_load_s: dict[str, float] = {}
        self.metrics = LedgerMetrics(new_registry(), self.model_name)
        # What this replica's steps cost, measured from their timings, for routers (the status).
        self.step_costs = StepCostEstimator()
        self._last_step_done = 0.0  # monotonic: when the last step's results were applied
        self._eviction_written = -1e9  # monotonic: the eviction head's last write
        self._eviction_step = -1  # the scheduler step it was written after
        self.telemetry = LedgerTelemetry(tracer, self.metrics, self.scheduler, self.step_costs)
        self.telemetry.tier_bytes_per_block = plan.bytes_per_block * plan.world_size
        self._tier_removed_seen = 0  # CPU-tier blocks published as removed, counted
        self.depth = 2 if config.async_scheduling else 1  # steps in flight at once
        self.in_flight: collections.deque[tuple[SchedulerOutput[Tracked], float]] = (
            collections.deque()
        )

        self.intake = RequestIntake(r, self.streams, leadership, self._count_outage)
        self.step_results = StepResults(
            r,
            self.streams.results,
            lambda: self.epoch,
            self._dead_letter,
            self._results_outage,
            leader_token=lambda: self.leadership.token,
        )
        self.quarantine = Quarantine(config.max_request_failures)
        # Every write a gateway, a router or a successor reads is fenced (Leadership.write).
        self.outputs = GatewayOutputs(leadership, self.streams)
        self.events = KVEventStream(
            r, self.streams, max_bytes=int(config.kv_events_max_mb * 1e6), snapshot_interval_s=config.snapshot_interval_s,
            block_size=config.block_size, hash_algo=config.hash_algo, writer=leadership,
        )  # fmt: skip
        # vLLM's ZMQ publisher beside the stream (--kv-events-config), fenced by the lease.
        zmq_config = config.kv_events_config
        self.zmq = (
            ZmqEventPublisher(
                zmq_config, fence=leadership, on_drop=self.metrics.record_kv_events_zmq_dropped
            )
            if zmq_config is not None and zmq_config.zmq
            else None
        )
        log.info(
            "kv_cache_capacity",
            line=self.capacity,
            num_gpu_blocks=plan.num_gpu_blocks,
            block_size=config.block_size,
            workers=sorted(workers),
            profile=plan.profile,
        )
        if tier_line is not None:
            log.info("cpu_tier_capacity", line=tier_line, num_cpu_chunks=self.num_cpu_chunks)
        if self.shared is not None:
            log.info(
                "shared_tier", namespace=self.shared.namespace, backend=self.shared.spec.backend,
                max_bytes=self.shared.max_bytes, binds=self.shared.fields,
            )  # fmt: skip

    @property
    def epoch(self) -> str:
        return f"{self.ledger_id}.{self.generation}"

    # ------------------------------------------------------------------ start and stop

    async def run(self, ready: asyncio.Event) -> None:
        # The ledger may start before its Redis (or while it restarts): each start-up step waits
        # for it with the loops' backoff, logging the outage once, instead of crashing.
        startup = redis_streams.Reconnect("startup", self._count_outage)
        await startup.call(self._prepare_streams)
        history = await startup.call(self._resume_events)
        if self.zmq is not None:
            self.zmq.start(history)
            self.events.on_published = self.zmq.publish
        await startup.call(lambda: self._new_generation("ledger start"))
        log.info("gc_frozen", objects=freeze_after_startup())
        # One ledger serves a group: requests a previous ledger read under another consumer name
        # and never finished become ours, so the reader's first pass over our pending entries
        # hands them out once, with our own unfinished ones.
        await startup.call(lambda: self.intake.reader.claim_stale(min_idle_ms=0))
        if self.shared is not None:
            self.shared.start()
        tasks = [
            asyncio.create_task(self.intake.read_forever(), name="intake"),
            asyncio.create_task(self.step_results.read_forever(), name="results"),
            asyncio.create_task(self._status_loop(), name="status"),
        ]
        for task in tasks:
            task.add_done_callback(self.background_done)
        ready.set()
        try:
            await self._engine_loop()
            if self.crashed is not None:
                raise self.crashed
        finally:
            self.telemetry.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                if self.leadership.held():  # a deposed leader leaves the keys to its successor
                    await self._write_snapshot()
                    await self.leadership.write(
                        ("DEL", self.streams.ledger_status), ("DEL", self.streams.ledger_eviction)
                    )
            finally:
                if self.shared is not None:
                    await self.shared.stop()
                if self.zmq is not None:  # sends what is queued, then frees the endpoints
                    await asyncio.to_thread(self.zmq.close)

    async def _resume_events(self) -> list[tuple[int, bytes]]:
        """The events' sequence goes on from the stream's last entry; with a ZMQ replay socket,
        the last buffer_steps batches (an earlier leader's) are kept for replay."""
        zmq_config = self.cfg.kv_events_config
        keep = (
            zmq_config.buffer_steps
            if self.zmq is not None and zmq_config is not None and zmq_config.replay_endpoint
            else 0
        )
        return await self.events.resume(keep)

    async def _prepare_streams(self) -> None:
        await self.intake.reader.ensure_groups("0")
        # Results from before this start belong to a previous epoch: skip them. Results need
        # no consumer group: only this ledger reads them, and a lost one fails its step anyway.
        await self.leadership.write(("DEL", self.streams.results))

    def background_done(self, task: asyncio.Task) -> None:
        """A background task ended (a reader, the lease renewal). One that died would leave the
        engine waiting forever: stop loudly instead, so that the process exits and its
        supervisor restarts it."""
        if not task.cancelled() and task.exception() is not None:
            log.error("background_task_crashed", task=task.get_name(), error=repr(task.exception()))
            self.crashed = task.exception()
            self.stopping.set()
            self.step_results.arrived.set()
            self.intake.wake()

    async def _new_generation(self, reason: str) -> None:
        """Start over on the workers' side: a new epoch, and AllBlocksCleared for subscribers."""
        self.generation += 1
        self.scheduler.take_events()
        await self._publish_events([AllBlocksCleared()])
        await self._write_snapshot()
        log.info("epoch_started", epoch=self.epoch, reason=reason)

    # ------------------------------------------------------------------ the engine loop

    async def _engine_loop(self) -> None:
        """The step loop, carried through Redis outages: what was in flight when the connection
        broke may be lost (steps, results, the workers' registrations), so once Redis answers
        again every request is recomputed in a new epoch, as after a lost worker."""
        reconnect = redis_streams.Reconnect("engine", self._count_outage)
        while not self.stopping.is_set():
            try:
                await self._step_loop()
                return
            except (RedisError, OSError) as exc:
                await reconnect.failed(exc)  # anything but an outage propagates
                await reconnect.until_up(self.r)
                await self.leadership.renew()  # the outage may have outlasted the lease
                self.epoch_invalidated = "Redis connection lost"

    async def _step_loop(self) -> None:
        """Schedule, run, update. With async scheduling two steps are in flight: the ledger
        schedules and dispatches step N+1 while the workers compute step N, so the round trips
        through Redis overlap the compute instead of adding to it."""
        while not self.stopping.is_set():
            await self._between_steps()  # leadership, new requests, a new epoch, no workers
            if not self.in_flight and not self._can_schedule():
                await self._idle()
                continue
            if len(self.in_flight) < self.depth and self._can_schedule():
                out = self.scheduler.schedule()
                scheduled_ns = time.time_ns()  # the spans' time: before the workers start
                await self._dispatch(out)  # the workers run it
                await self._while_workers_compute(out, scheduled_ns)
                if _runs(out) and len(self.in_flight) < self.depth:
                    continue  # fill the pipeline before waiting
            if not self.in_flight:
                await self.intake.wait(0.05)
                continue
            out, started = self.in_flight.popleft()
            result = await self._await_results(out)
            if result is None:
                await self._step_failed(out)
                continue
            self._update(out, result, started)
        await self._flush_outputs()

    def _can_schedule(self) -> bool:
        return bool(self.workers) and self.scheduler.has_requests()

    async def _between_steps(self) -> None:
        await self.leadership.ensure()
        await self._drain_intake()
        if self.shared is not None:
            self.shared.apply()  # what the catalog says changed, before the next lookups
        if self.gone_gateways:
            await self._abort_for_gone_gateways()
        if self.epoch_invalidated is not None:
            self.in_flight.clear()  # their results belong to the old epoch
            await self._flush_outputs()
            await self._workers_changed(self.epoch_invalidated)
        if not self.in_flight and not self.workers:
            await self._fail_without_workers()

    async def _idle(self) -> None:
        # Async scheduling caches a finished request's last blocks as its tokens come back:
        # publish them now rather than with the next request's first step.
        if self.shared is not None:
            await self.shared.write()  # its evictions are events too
        await self._publish_events(self.scheduler.take_events())
        await self._flush_outputs()
        self.telemetry.update_metrics(self.scheduler, self.manager)
        await self._write_eviction_head()
        await self.intake.wait(0.5 if self.workers else 0.2)

    async def _dispatch(self, out: SchedulerOutput[Tracked]) -> None:
        if not _runs(out):
            return
        step = build_step_message(
            out, self.epoch, self.cfg.block_size, self.num_cpu_chunks,
            self.shared.namespace if self.shared is not None else "",
        )  # fmt: skip
        step.leader_token = self.leadership.token
        # A leader paused past its lease and deposed stops here: renewed first if its deadline
        # passed, and fenced in Redis by the write itself.
        await self.leadership.ensure()
        await self.leadership.append_fenced(
            self.streams.steps(self.cfg.group), redis_streams.FIELD, encode(step), STEPS_MAXLEN
        )
        self.in_flight.append((out, time.monotonic()))

    async def _while_workers_compute(
        self, out: SchedulerOutput[Tracked], scheduled_ns: int
    ) -> None:
        """Spans, KV events, the last step's tokens, metrics and the eviction head, while the
        workers compute."""
        self.telemetry.on_schedule(out, self.manager, scheduled_ns)
        await self._publish_events(self.scheduler.take_events())
        await self._flush_outputs()
        self.telemetry.update_metrics(self.scheduler, self.manager)
        await self._write_eviction_head()
        if self.shared is not None:
            await self.shared.write()

    def _update(self, out: SchedulerOutput[Tracked], result: StepResult, started: float) -> None:
        file_logprobs(out, result)
        self.outputs.hold(
            self.scheduler.update_from_output(
                out,
                result.sampled_token_ids,
                result.transfers_done or (),
                result.shared_failed,
                result.shared_unreachable,
            )
        )
        now = time.monotonic()
        self.metrics.record_step(now - started)
        if result.transfer_seconds:  # the CPU tier's copies, as the workers timed them
            load_s, store_s = result.transfer_seconds[:2]
            self.metrics.record_tier_transfer_time(load_s=load_s, store_s=store_s)
        if result.shared_seconds:  # the shared tier's, likewise
            self.metrics.record_shared_tier_time(*result.shared_seconds[:2])
        if out.is_empty:
            return  # the CPU tier's copies alone: no step cost to learn from
        # The time this step held the pipeline: from its dispatch, or from the previous step's
        # end when it was dispatched while that one ran (async scheduling overlaps two).
        occupied = now - max(started, self._last_step_done)
        self._last_step_done = now
        scheduled = out.num_scheduled_tokens.values()
        decode_seqs = list(scheduled).count(1)  # a one-token chunk costs as a decode step
        self.step_costs.observe_step(sum(scheduled) - decode_seqs, decode_seqs, occupied)

    async def _step_failed(self, out: SchedulerOutput[Tracked]) -> None:
        self.in_flight.clear()
        await self._fail_culprits(out)
        await self._workers_changed("a step failed on a worker")

    async def _await_results(self, out: SchedulerOutput[Tracked]) -> StepResult | None:
        return await self.step_results.wait(
            out, dict(self.workers), self.cfg.step_timeout_s,
            give_up=lambda: self.epoch_invalidated is not None or self.stopping.is_set(),
        )  # fmt: skip

    def _count_outage(self, loop: str) -> None:
        self.metrics.record_redis_outage(loop)

    def _results_outage(self, loop: str) -> None:
        """The results reader lost Redis: a step or a result in flight may be lost with it (a
        restarted Redis, even one that kept its data, dropped the replies on the wire). The
        engine stops waiting and recomputes in a new epoch once Redis answers, rather than
        waiting out step_timeout_s for a result that may never come."""
        self._count_outage(loop)
        self.epoch_invalidated = "Redis connection lost by the results reader"

    async def _fail_culprits(self, out: SchedulerOutput[Tracked]) -> None:
        """After a worker reported a failed step: fail the requests it named, or those that
        took part in too many failed steps, with an error to their clients."""
        failure = self.step_results.take_failure()
        doomed, reason = self.quarantine.judge(out.num_scheduled_tokens, failure)
        if doomed:
            self.metrics.record_failed_requests(reason, len(doomed))
        for req_id, error in doomed.items():
            for request in self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ERROR):
                with self.telemetry.in_request(req_id):
                    log.error("request_failed", req_id=req_id, reason=reason, error=error)
                # The reason clients read comes from the status: FINISHED_ERROR is "error".
                finish_reason = RequestStatus.finish_reason(request.status)
                await self._finish_tracking(
                    request, request_output(request, [], finish_reason, error)
                )

    async def _workers_changed(self, reason: str) -> None:
        """The workers' KV data can no longer be trusted: recompute everything from scratch."""
        await self.leadership.ensure()  # the step failed because a successor took the workers over
        self.epoch_invalidated = None
        preemptions = self.scheduler.preempt_all(reason="worker_lost")
        out: SchedulerOutput[Tracked] = SchedulerOutput(
            step_id=self.scheduler.step_id, preemptions=preemptions
        )
        self.telemetry.on_schedule(out, self.manager)
        # The workers' CPU tier goes with their KV data: forgotten, and published as such.
        await self._publish_events(
            self.scheduler.take_events() + self.scheduler.forget_tier(), forgotten=True
        )
        self.manager.reset_prefix_cache()
        before = {(w, hello.started_at) for w, hello in self.workers.items()}
        self.workers = await registry.live_workers(self.r, self.cfg.streams, self.cfg.group)
        self.workers = group_view(
            {w: h for w, h in self.workers.items() if h.num_gpu_blocks >= self.num_gpu_blocks}
        )
        if {(w, hello.started_at) for w, hello in self.workers.items()} != before:
            # Other workers, other speed: routers read these costs (a restarted worker measured
            # by its cold first steps would be priced out of every request that could correct it).
            self.step_costs.restart(skip_steps=self.depth)
        if self.workers:
            self.no_worker_since = None
        log.warning(
            "workers_changed",
            reason=reason,
            preempted=len(preemptions),
            workers=sorted(self.workers),
        )
        await self._new_generation(reason)

    async def _fail_without_workers(self) -> None:
        """No live worker for --no-worker-timeout-s: the requests held cannot progress, so each
        fails with an error now rather than at its gateway's timeout. A worker that registers
        again in time (a supervised restart) finds them waiting and recomputes them."""
        timeout = self.cfg.no_worker_timeout_s
        now = time.monotonic()
        if self.no_worker_since is None:
            self.no_worker_since = now
        if timeout <= 0 or now - self.no_worker_since < timeout or not self.scheduler.requests:
            return
        error = (
            f"no worker of group {self.cfg.group!r} has been alive for "
            f"{now - self.no_worker_since:.0f}s (--no-worker-timeout-s {timeout:g}): "
            "the request cannot be scheduled"
        )
        held = list(self.scheduler.requests)
        log.error("requests_failed_without_workers", requests=len(held), error=error)
        for request in self.scheduler.finish_requests(held, RequestStatus.FINISHED_ERROR):
            # Not the request's fault, and a worker that comes back serves it: a 503 to retry.
            await self._finish_tracking(request, failure_output(request, error, unavailable=True))

    # ------------------------------------------------------------------ requests in

    async def _drain_intake(self) -> None:
        for entry in self.intake.drain():
            try:
                msg = redis_streams.decode_entry(entry)
            except WireError as exc:
                await self._dead_letter(entry, str(exc))
                continue
            if isinstance(msg, GenerateRequest):
                await self._add_request(entry, msg)
            elif isinstance(msg, AbortRequest):
                await self._abort(msg)
                await self.intake.ack([entry])
            else:
                await self._dead_letter(
                    entry, f"field 'kind': {kind_of(msg)!r} does not belong on the requests stream"
                )

    async def _add_request(self, entry: redis_streams.Entry, msg: GenerateRequest) -> None:
        problem = validate_request(msg, self.vocab_size, self.cfg.max_model_len)
        if problem is None and msg.req_id in self.scheduler.requests:
            problem = f"req_id {msg.req_id!r} is already running"
        if problem is None:
            if msg.sampling.seed is None:
                # Every worker of the group must draw the same tokens (each keeps its own copy),
                # and a recomputed request then draws what it drew before the preemption.
                msg.sampling.seed = secrets.randbits(63)
            request = request_from_message(msg, entry, self.hasher, self.cfg.block_size)
            try:
                self.scheduler.add_request(request)
            except ValueError as exc:
                problem = str(exc)
        if problem is not None:
            with in_trace(msg.traceparent):
                log.warning("request_rejected", req_id=msg.req_id, error=problem)
            await self.outputs.send(msg.gateway_id, rejection(msg, problem))
            await self.intake.ack([entry])
            return
        self.telemetry.request_added(request)

    async def _abort_for_gone_gateways(self) -> None:
        """A gateway that died cannot abort its requests, and nobody reads their tokens: once
        its marker key is gone (--gateway-lease-s after its last renewal) they are aborted."""
        gone, self.gone_gateways = self.gone_gateways, {}
        for gateway_id, req_ids in gone.items():
            aborted = self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
            log.warning(
                "gateway_gone", gateway_id=gateway_id, aborted=len(aborted),
                marker=self.streams.gateway_marker(gateway_id),
            )  # fmt: skip
            for request in aborted:
                log.info("request_aborted", req_id=request.request_id, reason="gateway_gone")
                await self._finish_tracking(request, request_output(request, [], "abort"))

    async def _abort(self, msg: AbortRequest) -> None:
        for request in self.scheduler.finish_requests([msg.req_id], RequestStatus.FINISHED_ABORTED):
            with self.telemetry.in_request(msg.req_id):
                log.info("request_aborted", req_id=msg.req_id, reason=msg.reason)
            await self._finish_tracking(request, request_output(request, [], "abort"))

    # ------------------------------------------------------------------ outputs

    async def _flush_outputs(self) -> None:
        """Stream the last step's tokens to their gateways (held back to overlap the next step)."""
        if not self.outputs.unsent:
            return
        await self.leadership.ensure()  # a deposed leader's tokens would race its successor's
        for update in await self.outputs.flush():
            if update.finished:
                await self._finish_tracking(update.request, None)

    async def _finish_tracking(
        self, request: Request[Tracked], final: RequestOutput | None
    ) -> None:
        tracked = request.payload
        self.quarantine.forget(request.request_id)
        self.telemetry.request_finished(
            request.request_id, final.finish_reason if final is not None else None
        )
        if final is not None:
            await self._flush_outputs()  # a final output must not overtake tokens held back
            await self.outputs.send(tracked.msg.gateway_id, final)
        if tracked.entry is not None:
            await self.intake.ack([tracked.entry])

    async def _dead_letter(self, entry: redis_streams.Entry, error: str) -> None:
        await self.leadership.ensure()  # a deposed ledger leaves its entries to the successor
        await redis_streams.dead_letter(self.r, self.streams.dead_letters, entry, error)
        if entry.stream == self.streams.requests:  # results are read without a group: no ack
            await self.intake.ack([entry])
        self.metrics.record_dead_letter(entry.stream)

    # ------------------------------------------------------------------ KV events

    async def _publish_events(self, events: list, *, forgotten: bool = False) -> None:
        """Publish the events; the CPU tier's removals are its evictions, unless the tier is
        being `forgotten` (its workers lost it)."""
        await self.leadership.ensure()  # KV events and snapshots belong to the leader's block pool
        published = await self.events.publish(events, self.manager.block_pool, self.epoch)
        if published:
            self.metrics.record_kv_events(published)
            removed = self.events.tier_removed.get(MEDIUM_CPU, 0)
            if removed != self._tier_removed_seen:
                if not forgotten:
                    self.metrics.record_cpu_tier_evictions(removed - self._tier_removed_seen)
                self._tier_removed_seen = removed

    async def _write_snapshot(self) -> None:
        await self.events.write_snapshot(self.manager.block_pool, self.epoch)

    # ------------------------------------------------------------------ background readers

    async def _status_loop(self) -> None:
        reconnect = redis_streams.Reconnect("status", self._count_outage)
        while True:
            try:
                await self._check_workers_and_status()
            except (RedisError, OSError) as exc:
                # Steps and results may be lost with the connection: the engine stops waiting
                # for this step and starts a new epoch once Redis answers.
                self.epoch_invalidated = "Redis connection lost by the status loop"
                await reconnect.failed(exc)
                continue
            reconnect.succeeded()
            await asyncio.sleep(min(1.0, self.cfg.worker_ttl_s / 3))

    async def _check_workers_and_status(self) -> None:
        live = group_view(await registry.live_workers(self.r, self.cfg.streams, self.cfg.group))
        lost, joined = membership_changes(self.workers, live, self.num_gpu_blocks)
        if (lost or joined) and self.epoch_invalidated is None:
            # A fresh worker holds none of the cached data, a lost one took its share.
            log.warning("workers_changing", lost=lost, joined=joined)
            self.epoch_invalidated = "worker membership changed"
        await self._check_gateways()
        self.intake.wake()
        await self._write_status()

    async def _check_gateways(self) -> None:
        """Is the marker of every gateway with requests here still there? One whose marker this
        ledger saw and that is now gone has died (or Redis lost its data, which that gateway
        notices too and fails its requests): hand its requests to the engine loop to abort. A
        gateway never seen (one that writes requests without a marker) is left alone."""
        by_gateway: dict[str, list[str]] = {}
        for req_id, request in self.scheduler.requests.items():
            by_gateway.setdefault(request.payload.msg.gateway_id, []).append(req_id)
        names = list(by_gateway)
        present: list[int] = []
        if names:
            async with self.r.pipeline(transaction=False) as pipe:
                for gateway_id in names:
                    pipe.exists(self.streams.gateway_marker(gateway_id))
                present = await pipe.execute()
        seen = set()
        now = time.monotonic()
        missing = {g: t for g, t in self.gateways_missing.items() if g in by_gateway}
        for gateway_id, there in zip(names, present, strict=True):
            if there:
                seen.add(gateway_id)
                missing.pop(gateway_id, None)
            elif gateway_id in self.gateways_seen or gateway_id in missing:
                # Gone only once absent past the grace: a live gateway renews its marker every
                # second, and re-makes it when Redis lost its data (then it fails the requests
                # written to the lost Redis itself, with a 503; aborting them here would end
                # them as if their client had left, with the text so far).
                since = missing.setdefault(gateway_id, now)
                if now - since >= GATEWAY_MISSING_GRACE_S:
                    self.gone_gateways[gateway_id] = by_gateway[gateway_id]
                    del missing[gateway_id]
        # A marker outlives its gateway by the lease, so a gateway that dies just after it
        # sent a request is still seen here first.
        self.gateways_seen = seen
        self.gateways_missing = missing

    def attention_backends(self) -> dict[str, str]:
        """worker id -> the attention backend it chose at start-up (from its hello)."""
        return {w: h.attention_backend for w, h in sorted(self.workers.items())}

    async def _write_status(self) -> None:
        if not self.leadership.held():
            return  # the status key is the leader's
        if self.shared is not None:
            await self.shared.refresh_size()
            self.metrics.set_shared_tier_size(*self.shared.size)
        self.metrics.set_workers(
            {w: (h.device, h.attention_backend) for w, h in self.workers.items()}
        )
        # Fenced: a ledger paused between the check above and this write must not overwrite
        # its successor's status (the key gateways and routers read).
        await self.leadership.write(
            ("SET", self.streams.ledger_status, encode(self.status()), "PX", 5000)
        )

    def status(self) -> LedgerStatus:
        """What the gateways and routers read of this ledger (the status key, with a TTL)."""
        cfg = self.cfg
        return LedgerStatus(
            epoch=self.epoch,
            started_at=self.started_at,
            updated_at=time.time(),
            model_name=self.model_name,
            max_model_len=cfg.max_model_len,
            vocab_size=self.vocab_size,
            block_size=cfg.block_size,
            num_gpu_blocks=self.num_gpu_blocks,
            capacity_line=self.capacity,
            hash_algo=cfg.hash_algo,
            num_workers=len(self.workers),
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            metrics=self.metrics.snapshot().to_dict(),
            attention_backends=self.attention_backends(),
            scheduling_policy=cfg.policy,
            async_scheduling=cfg.async_scheduling,
            enable_prefix_caching=cfg.enable_prefix_caching,
            costs=self.routing_costs(),
            max_num_seqs=cfg.max_num_seqs,
            num_cpu_blocks=self.num_cpu_chunks,
            shared_tier=self.shared.status() if self.shared is not None else None,
        )

    def routing_costs(self) -> RoutingCosts:
        """What routers trade a cached prefix against, for the status: O(requests)."""
        measured = self.step_costs.estimate()
        return RoutingCosts(
            prefill_tokens_per_s=measured.prefill_tokens_per_s,
            step_s_per_seq=measured.step_s_per_seq,
            step_base_s=measured.step_base_s,
            queue_wait_s=measured.queue_wait_s,
            queued_prefill_tokens=self.scheduler.queued_prefill_tokens(_expected_hits),
            max_num_batched_tokens=self.cfg.max_num_batched_tokens,
            steps=measured.steps,
            load_s_per_block=self.load_costs() or None,
        )

    def load_costs(self) -> dict[str, float]:
        """Seconds to load one block from each tier this replica has, as its workers measured
        them at start-up (the slowest's: a step waits for every worker's copies); the shared
        tier's only while this ledger uses one. `measured_load_s` overrides."""
        costs = tier_load_costs(self.workers.values()) if self.num_cpu_chunks else {}
        if self.shared is None:
            costs.pop(TIER_SHARED, None)
        costs.update(self.measured_load_s)
        return costs

    def eviction_head(self) -> EvictionHead:
        """The cached blocks the next allocations evict, for routers: O(requests + horizon)."""
        cfg = self.cfg
        queued = self.scheduler.queued_prefill_tokens(_expected_hits)
        horizon = eviction_horizon(queued, cfg.max_num_batched_tokens, cfg.block_size)
        positions, hashes, walked = self.manager.block_pool.eviction_head(horizon)
        return EvictionHead(
            epoch=self.epoch, updated_at=time.time(), positions=positions, hashes=hashes,
            horizon=walked, queued_prefill_tokens=queued,
        )  # fmt: skip

    async def _write_eviction_head(self) -> None:
        """A few times a second, from the engine loop (which owns the pool): under load the
        front of the free queue turns over faster than the status's once a second."""
        now = time.monotonic()
        if now - self._eviction_written < EVICTION_INTERVAL_S or not self.cfg.enable_prefix_caching:
            return
        if not self.leadership.held():
            return  # the key is the leader's
        if self.scheduler.step_id == self._eviction_step and now - self._eviction_written < 2.0:
            return  # no step since: the free queue is as written (rewritten before it expires)
        self._eviction_written, self._eviction_step = now, self.scheduler.step_id
        await self.leadership.write(
            ("SET", self.streams.ledger_eviction, encode(self.eviction_head()), "PX", 5000)
        )


def _runs(out: SchedulerOutput[Tracked]) -> bool:
    """Whether the workers have something to do in a step: tokens, or the CPU tier's copies."""
    return not out.is_empty or out.has_transfers


def _expected_hits(request: Request[Tracked]) -> int:
    """The prefix the router expected the request to find here (0: no router said)."""
    return request.payload.msg.expected_cached_tokens or 0
