"""The gateway's shared state and its Redis side: ledger liveness (the status key), limits,
back-pressure (requests in flight), the request stream, and the output reader's lifetime.
One `Gateway` per aiohttp application, reached through `app[GATEWAY]`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis
from aiohttp import web
from opentelemetry.trace import Tracer
from redis.exceptions import RedisError

from gateway.fields import ApiError
from gateway.output_reader import SHUTDOWN, OutputDispatcher
from gateway.protocol import Limits
from gateway.router import routing_for
from gateway.shares import Shares
from gateway.tools import ConfigProblem, ToolSettings
from observability import GatewayMetrics, LedgerSnapshot, get_logger, lean_tracer, new_registry
from services.config import GatewayConfig
from services.environment import ConfigError
from services.startup import freeze_after_startup
from services.tokenization.tokenizer import Tokenizer
from services.transport import redis_streams
from services.wire.messages import AbortRequest, GenerateRequest, LedgerStatus

log = get_logger("gateway")

STALL_POLL_S = 1.0  # waiting requests share one status read a second
STATUS_MAX_AGE_S = 0.1  # coalesces status reads when many requests arrive at once
# /health and /ping answer from a status read this recently. The ledger rewrites the key about
# once a second, so such a read misses at most one of its writes; read afresh for every probe,
# a probe waited for a Redis round trip and three or four more loop turns (the read's task, the
# reply, the shield, the handler's resumption), each a wait for the CPU on a loaded host: during
# a burst that was most of its time (benchmarks/burst.py: max 76-225 ms against 15-75 ms).
PROBE_MAX_AGE_S = 1.0
LEDGER_POLL_S = 0.1
RETRY_AFTER_S = 1
# Admitted requests set up at once (tokenized, checked against the ledger, first sequences put
# on the stream); the others wait their turn, in order of arrival. Each setup is a few loop
# turns, so a burst set up all at once makes every turn as long as the burst is large; this
# many keep Redis busy and a turn short. vLLM's tokenizer batches hold 32 too.
SETUP_CONCURRENCY = 16


def default_gateway_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Gateway:
    def __init__(
        self, config: GatewayConfig, redis: aioredis.Redis, tokenizer: Tokenizer, tracer: Tracer
    ) -> None:
        self.config = config
        self.redis = redis
        self.tokenizer = tokenizer
        self.tracer = tracer = lean_tracer(tracer)
        self.gateway_id = config.gateway_id or default_gateway_id()
        self.started_at = time.time()
        self.default_model_name = config.model_name or tokenizer.name
        try:  # the tool flags against this tokenizer, once
            self.tool_settings = ToolSettings.of(
                config.tool_call_parser, config.enable_auto_tool_choice, tokenizer
            )
        except ConfigProblem as exc:
            raise ConfigError(str(exc)) from None
        self.registry = new_registry()
        self.metrics = GatewayMetrics(self.registry, self.default_model_name)
        # Which replica gets each request; its first replica's keys are the gateway's own.
        self.routing = routing_for(
            config, redis, self.gateway_id, self.registry, tracer, self.metrics.record_dead_letter,
            self.metrics.record_redis_outage, tokenizer,
        )  # fmt: skip
        self.upstreams = self.routing.upstreams  # the external replicas, when there are any
        self.streams = self.routing.primary
        self.outputs: OutputDispatcher = self.routing.outputs
        self.in_flight = 0  # sequences (one per choice or best_of candidate), not HTTP requests
        self.shares = Shares()  # the requests in flight, among which a fan-out's bound is shared
        self._setup_turns = asyncio.Semaphore(SETUP_CONCURRENCY)
        self.closing = False
        self._status: LedgerStatus | None = None
        self._status_read_at = -1e9
        self._status_reading: asyncio.Future[LedgerStatus | None] | None = None
        # Since when the last status reads found no ledger (or one without workers); None: fine.
        self.stalled_since: float | None = None
        self._aborts: set[asyncio.Task] = set()

    # --- ledger liveness ---------------------------------------------------------------------

    async def ledger_status(self, max_age_s: float = STATUS_MAX_AGE_S) -> LedgerStatus | None:
        """The ledger's status key, or None when it is absent (no ledger) or unreadable.
        Callers that find it older than `max_age_s` share one read: a read in flight is as
        fresh as any (its answer is being made now), and a burst of requests arriving at once
        would otherwise send one GET each, each taking a pooled connection (and growing the
        pool) that /health and the requests' own writes then wait for."""
        now = time.monotonic()
        if now - self._status_read_at <= max_age_s:
            return self._status
        if self._status_reading is None:
            read = asyncio.ensure_future(self._read_status(now))
            read.add_done_callback(self._status_read_done)
            self._status_reading = read
        # Shielded: one caller cancelled (its client left) does not cancel the others' read.
        return await asyncio.shield(self._status_reading)

    def _status_read_done(self, read: asyncio.Future[LedgerStatus | None]) -> None:
        self._status_reading = None
        if not read.cancelled():
            read.exception()  # retrieved: when every caller left, nobody else will

    async def _read_status(self, now: float) -> LedgerStatus | None:
        status = await self.routing.read_status()
        # One ledger's counters only mean something when there is one ledger.
        if status is not None and status.metrics and self.routing.one_ledger:
            self.metrics.mirror_ledger(LedgerSnapshot.from_dict(status.metrics))
        self._status, self._status_read_at = status, now
        if status is not None and status.num_workers > 0:
            self.stalled_since = None
        elif self.stalled_since is None:
            self.stalled_since = now
        return status

    async def check_progress(self, last_output_at: float) -> None:
        """Fail a waiting request that cannot progress: no ledger status key (it expires 5 s
        after the ledger's last write) or no workers for stall_timeout_s, and no output for as
        long. Only a lasting absence counts, so a ledger late under load is not declared dead."""
        try:
            status = await self.ledger_status(max_age_s=STALL_POLL_S)
        except RedisError as exc:
            log.warning("ledger_status_unreadable", error=str(exc))
            status = None
            if self.stalled_since is None:
                self.stalled_since = time.monotonic()
        if self.stalled_since is None:
            return
        stalled_s = time.monotonic() - max(self.stalled_since, last_output_at)
        if stalled_s < self.config.stall_timeout_s:
            return
        what = (
            "the ledger has had no worker" if status is not None else "no ledger has been running"
        )
        raise ApiError(
            503,
            f"{what} for {stalled_s:.0f}s (--stall-timeout {self.config.stall_timeout_s:g}s, "
            f"KVLEDGER_STALL_TIMEOUT); the request was aborted. "
            + self.unavailable_message(status),
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    async def wait_for_ledger(self) -> LedgerStatus:
        """The status of a live ledger with at least one worker, waiting up to ledger_wait_s
        for one (503 after: a request nobody can compute would only time out)."""
        deadline = time.monotonic() + self.config.ledger_wait_s
        while True:
            self._refuse_when_closing()
            status = await self.ledger_status()
            # Several replicas: every one must have spoken (or been silent past the out limit)
            # and one be routable, or a gateway just started would send everything to the
            # first replica that reported, or refuse what a moment's wait lets it serve.
            if status is not None and status.num_workers > 0 and self.routing.not_ready() is None:
                return status
            if time.monotonic() >= deadline:
                log.warning(
                    "ledger_unavailable", key=self.streams.ledger_status, status=bool(status)
                )
                raise ApiError(
                    503, self.unavailable_message(status, self.config.ledger_wait_s),
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )  # fmt: skip
            await asyncio.sleep(LEDGER_POLL_S)

    def unavailable_message(self, status: LedgerStatus | None, waited_s: float = 0.0) -> str:
        waited = f" (waited {waited_s:g}s)" if waited_s else ""
        routing = self.routing.not_ready()
        if status is not None and status.num_workers > 0 and routing is not None:
            return f"the gateway is not ready: {routing}{waited}."
        if status is not None:
            return (
                f"the ledger is running but has no worker to compute on{waited}. Start one with "
                f"`kvledger worker` on the same Redis and stream prefix ('{self.streams.prefix}')."
            )
        return (
            f"no ledger is running: the key '{self.streams.ledger_status}' is absent from "
            f"Redis{waited}. Start one with `kvledger ledger` on the same Redis and stream "
            f"prefix ('{self.streams.prefix}'), then retry."
        )

    def limits(self, status: LedgerStatus | None) -> Limits:
        """The serving ledger's limits are the truth; the config stands in without a ledger."""
        if status is None:
            return Limits(
                self.default_model_name, self.config.max_model_len, self.tokenizer.vocab_size
            )
        return Limits(
            self.config.model_name or status.model_name or self.default_model_name,
            status.max_model_len or self.config.max_model_len,
            status.vocab_size or self.tokenizer.vocab_size,
            status.scheduling_policy,
        )

    def settings(self) -> dict[str, Any]:
        """The gateway's active settings, for /health (the ledger's ride in its status)."""
        cfg = self.config
        return {
            "served_model_name": self.default_model_name,
            "model": cfg.model,
            "max_model_len": cfg.max_model_len,
            "max_queue": cfg.max_queue,
            "request_timeout_s": cfg.request_timeout_s,
            "default_max_tokens": cfg.default_max_tokens,
            "api_key_required": cfg.api_key is not None,
        }

    # --- back-pressure and the request stream -----------------------------------------------

    def refuse_when_full(self) -> None:
        """The cheap check before a request's body is read: 429 at once when no place is free
        (every request needs one), so a burst past max_queue costs no reading or tokenizing."""
        self._refuse_when_closing()
        self._refuse_past_max_queue(1)

    @asynccontextmanager
    async def admit(self, places: int = 1) -> AsyncIterator[None]:
        """Hold `places` of max_queue (one per sequence the request asks for: prompts x n, or
        x best_of) for the request's whole life; 429 when they are not free. A request that
        needs more places than max_queue holds was refused with a 400 before (count_sequences)."""
        self._refuse_when_closing()
        self._refuse_past_max_queue(places)
        self.in_flight += places
        self.shares.enter()
        try:
            yield
        finally:
            self.in_flight -= places
            self.shares.leave()

    @asynccontextmanager
    async def setting_up(self) -> AsyncIterator[Callable[[], None]]:
        """An admitted request's turn to be set up, one of SETUP_CONCURRENCY at a time; the
        callable it yields ends the turn early (once its first sequences are on the stream),
        leaving does otherwise.

        Why a bound: an asyncio loop runs, in each turn, every callback that became ready
        before it. A burst's admitted requests, set up together, each put a step (a body
        parsed, a tokenization's result, a status read, an XADD's reply, a pooled connection)
        into the same turns, so a turn lasts as long as the burst is large, and /health, which
        needs three or four turns, waited seconds. Bounded, a turn holds at most this many
        setups' steps whatever the burst, and the pool needs no more connections than that."""
        await self._setup_turns.acquire()
        held = True

        def done() -> None:
            nonlocal held
            if held:
                held = False
                self._setup_turns.release()

        try:
            yield done
        finally:
            done()

    def _refuse_past_max_queue(self, places: int) -> None:
        if self.in_flight + places <= self.config.max_queue:
            return
        asks = f"; this request needs {places}" if places > 1 else ""
        raise ApiError(
            429,
            f"this gateway already has {self.in_flight} sequences in flight (max_queue="
            f"{self.config.max_queue}){asks}; retry after {RETRY_AFTER_S}s",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    def _refuse_when_closing(self) -> None:
        if self.closing:
            raise ApiError(503, "the gateway is shutting down")

    async def enqueue(self, request: GenerateRequest, replica: str | None = None) -> None:
        """A request to the requests stream of `replica`, noting which Redis took it: if Redis
        loses its data afterwards, the request fails as lost (and none written after does)."""
        await self.routing.dispatcher(replica).enqueue(
            self.routing.requests_stream(replica), request
        )

    async def send(self, msg: Any, replica: str | None = None) -> None:
        """To the requests stream of `replica` (routing's choice; None: the first replica)."""
        await redis_streams.append(self.redis, self.routing.requests_stream(replica), msg)

    async def abort(self, req_id: str, reason: str, replica: str | None = None) -> None:
        """Tell the ledger to free the request's blocks; survives the caller being cancelled."""
        task = asyncio.create_task(self._send_abort(req_id, reason, replica))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)
        await asyncio.shield(task)

    async def _send_abort(self, req_id: str, reason: str, replica: str | None) -> None:
        try:
            await self.send(AbortRequest(req_id, reason), replica)
            log.info("request_aborted", req_id=req_id, reason=reason)
        except (RedisError, OSError) as exc:
            log.error("abort_not_sent", req_id=req_id, reason=reason, error=str(exc))

    # --- lifetime ----------------------------------------------------------------------------

    async def start(self) -> None:
        # Started before its Redis (a host's boot order, an operator's restart), the gateway
        # waits for it with backoff, one line when the wait begins and one when it ends, as
        # the ledger and the worker do; it listens once Redis answers.
        await redis_streams.Reconnect("startup", self.metrics.record_redis_outage).until_up(
            self.redis
        )
        try:
            await self.outputs.start()
            await self.routing.start()
        except RedisError as exc:
            raise RuntimeError(
                f"the gateway cannot reach Redis ({exc}); check --redis-url / KVLEDGER_REDIS_URL"
            ) from None
        log.info(
            "gateway_started",
            gateway_id=self.gateway_id,
            outputs=self.outputs.stream,
            gc_frozen=freeze_after_startup(),
        )

    def begin_shutdown(self) -> None:
        """Refuse new requests and end every waiting one (each aborts itself on the ledger)."""
        self.closing = True
        self.outputs.broadcast(SHUTDOWN)
        log.info("gateway_stopping", in_flight=self.in_flight)

    async def stop(self) -> None:
        self.closing = True
        await self.outputs.stop()
        await self.routing.stop()
        if self._aborts:
            await asyncio.wait(set(self._aborts), timeout=5)


GATEWAY = web.AppKey("gateway", Gateway)  # the application's one Gateway
