"""The ledger -> gateway direction: one reader task per gateway tails its outputs stream and
hands each `RequestOutput` to the queue of the request waiting for it; `TokenTracker` (pure)
turns those outputs, which may repeat or arrive out of order, into one gap-free token list.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from observability import get_logger
from services.transport import redis_streams
from services.transport.keys import GATEWAY_LEASE_S, OUTPUTS_TTL_S, REQUESTS_MAXLEN
from services.wire import codec
from services.wire.messages import GenerateRequest, OutputBatch, RequestOutput, TokenLogprobs

log = get_logger("gateway.output_reader")

SHUTDOWN = object()  # put in every waiting queue when the gateway stops
TERMINAL_REASONS = ("abort", "error")  # nothing follows these, wherever they sit


class TokenTracker:
    """A request's output tokens in order.

    `position` is the index of an output's first token: tokens at positions already held are
    dropped (a restarted ledger re-runs requests from scratch), and an output beyond the end is
    kept aside until the missing positions arrive, so what `accept` returns never has a gap.
    """

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []  # one per token, when the request asked
        self.prompt_logprobs: list[TokenLogprobs] | None = None
        self.final: RequestOutput | None = None  # the output that finished the request
        self.num_cached_tokens: int | None = None
        self.queued_s: float | None = None  # arrival to first admission, from the ledger
        self._early: dict[int, RequestOutput] = {}

    @property
    def finished(self) -> bool:
        return self.final is not None

    def accept(self, out: RequestOutput) -> list[int]:
        """The tokens this output makes contiguous (possibly none)."""
        if self.final is not None:
            return []
        if self.num_cached_tokens is None:
            self.num_cached_tokens = out.num_cached_tokens  # set at first admission
        if out.queued_s is not None and self.queued_s is None:
            self.queued_s = out.queued_s
        start = len(self.token_ids)
        if out.finished and out.finish_reason in TERMINAL_REASONS:
            self.final = out
            return []
        if out.position > start:
            self._early.setdefault(out.position, out)
            return []
        self._apply(out)
        while self._early and self.final is None:
            position = min(self._early)
            if position > len(self.token_ids):
                break
            self._apply(self._early.pop(position))
        return self.token_ids[start:]

    def _apply(self, out: RequestOutput) -> None:
        already = len(self.token_ids) - out.position
        self.token_ids.extend(out.new_token_ids[already:])
        self.logprobs.extend((out.logprobs or [])[already:])
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.final = out


LOST_BY_REDIS = "Redis restarted without its data and lost this request; retry it"


class OutputDispatcher:
    """Tails `{prefix}:outputs:{gateway_id}` with plain XREAD and routes outputs by req_id.

    It starts at the stream's last entry when the gateway starts (XREAD's "$", read once as a
    concrete id so that nothing appended between start-up and the first read is lost). Outputs
    for unknown requests (their client is gone) are dropped; entries that do not parse go to the
    dead-letter stream.

    Redis losing its data (a restart without persistence) is seen through a marker key this
    gateway keeps in the replica's slot, holding a random "incarnation" id: whoever finds it
    gone (a request being enqueued, or the once-a-second watch) sets a new one. Each request is
    enqueued in one pipeline with the marker's read, so it knows the incarnation that holds it;
    when the incarnation changes, exactly the requests written to the old one fail (503, retry)
    and those already written to the new one go on.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        stream: str,
        dead_letters: str,
        on_dead_letter: Callable[[str], None] = lambda stream: None,
        block_ms: int = 1000,
        marker: str | None = None,
        on_outage: Callable[[str], None] | None = None,
        watch_interval_s: float = 1.0,
        marker_ttl_s: float = GATEWAY_LEASE_S,
    ) -> None:
        self.redis = redis
        self.stream = stream
        self.dead_letters = dead_letters
        self.on_dead_letter = on_dead_letter
        self.block_ms = block_ms
        self.queues: dict[str, asyncio.Queue] = {}
        self._task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._last_id: bytes = b"0-0"
        # A key this gateway keeps in Redis: finding it gone means Redis lost its data, and
        # with it the requests not yet read and the outputs not yet delivered.
        self.marker = marker
        self.on_outage = on_outage
        # The marker's expiry: the ledger aborts this gateway's requests once it is gone.
        self.marker_ttl_s = marker_ttl_s
        self.watch_interval_s = min(watch_interval_s, marker_ttl_s / 3)
        self.data_losses = 0
        self.incarnation: bytes | None = None  # the marker's value: which Redis holds our data
        self._lost_incarnations: set[bytes] = set()
        self._written_to: dict[str, bytes] = {}  # req_id -> the incarnation its request is in

    def register(self, req_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[req_id] = queue
        return queue

    def unregister(self, req_id: str) -> None:
        self.queues.pop(req_id, None)
        self._written_to.pop(req_id, None)

    @property
    def marker_ttl_ms(self) -> int:
        return max(int(self.marker_ttl_s * 1000), 100)

    async def enqueue(self, stream: str, request: GenerateRequest) -> None:
        """XADD the request, reading the marker on the same connection first (one round trip):
        both run on one Redis, whose incarnation the request is then known to be in."""
        if self.marker is None:
            await redis_streams.append(self.redis, stream, request)
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.marker, uuid.uuid4().hex.encode(), nx=True, px=self.marker_ttl_ms)
        pipe.get(self.marker)
        pipe.xadd(
            stream, {redis_streams.FIELD: codec.encode(request)},
            maxlen=REQUESTS_MAXLEN, approximate=True,
        )  # fmt: skip
        _, incarnation, _ = await pipe.execute()
        self.observe(cast("bytes | None", incarnation), request.req_id)

    def observe(self, incarnation: bytes | None, req_id: str | None = None) -> None:
        """The marker's value, as a command just read it (`req_id`: the request written with
        that read). A new value means Redis lost its data since the last one: the requests
        written to the old one fail."""
        if incarnation is None:  # gone again between the SET and the GET: nothing learned
            return
        if incarnation in self._lost_incarnations:
            # Written to a Redis since lost (its reply overtaken by a newer one): lost too.
            if req_id is not None:
                self._fail([req_id])
            return
        if self.incarnation is not None and incarnation != self.incarnation:
            self._lost_incarnations.add(self.incarnation)
            lost = [r for r, seen in self._written_to.items() if seen != incarnation]
            self.data_losses += 1
            log.error("redis_data_lost", stream=self.stream, failed_requests=len(lost))
            self._fail(lost)
        self.incarnation = incarnation
        if req_id is not None and req_id in self.queues:
            self._written_to[req_id] = incarnation

    def broadcast(self, item: object) -> None:
        for queue in self.queues.values():
            queue.put_nowait(item)

    async def start(self) -> None:
        tail = await self.redis.xrevrange(self.stream, count=1)
        self._last_id = cast(bytes, tail[0][0]) if tail else b"0-0"
        self._task = asyncio.create_task(self._run(), name=f"outputs:{self.stream}")
        if self.marker is not None:
            await self._check_marker()
            self._watch_task = asyncio.create_task(self._watch(), name=f"watch:{self.marker}")

    async def stop(self) -> None:
        for task in (self._task, self._watch_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._watch_task = None

    async def _check_marker(self) -> None:
        """Read the marker (setting a new incarnation where it is gone) and renew its expiry."""
        assert self.marker is not None
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.marker, uuid.uuid4().hex.encode(), nx=True, px=self.marker_ttl_ms)
        pipe.pexpire(self.marker, self.marker_ttl_ms)
        pipe.get(self.marker)
        *_, incarnation = await pipe.execute()
        self.observe(cast("bytes | None", incarnation))

    async def _watch(self) -> None:
        # Finds a loss while no request is being enqueued (the requests waiting then fail).
        while True:
            await asyncio.sleep(self.watch_interval_s)
            try:
                await self._check_marker()
            except (RedisError, OSError):
                continue  # the reader's loop reports the outage

    def _fail(self, req_ids: list[str]) -> None:
        """End these waiting requests with an explicit error: Redis lost them (a 503)."""
        for req_id in req_ids:
            self._written_to.pop(req_id, None)
            queue = self.queues.get(req_id)
            if queue is not None:
                queue.put_nowait(
                    RequestOutput(
                        req_id, [], finished=True, finish_reason="error", error=LOST_BY_REDIS,
                        unavailable=True,
                    )
                )  # fmt: skip

    async def _run(self) -> None:
        refreshed = 0.0
        reconnect = redis_streams.Reconnect(f"outputs:{self.stream}", self.on_outage)
        while True:
            try:
                if time.monotonic() - refreshed > OUTPUTS_TTL_S / 10:
                    # The stream expires once no reader refreshes it (and the ledger stops
                    # writing): a restarted gateway's old stream does not stay behind.
                    await self.redis.expire(self.stream, OUTPUTS_TTL_S)
                    refreshed = time.monotonic()
                entries = await redis_streams.read_from(
                    self.redis, self.stream, self._last_id, block_ms=self.block_ms
                )
            except (RedisError, OSError) as exc:
                # Redis restarting, paused or unreachable: retried with backoff; requests it
                # lost are failed by the marker watch once it answers again.
                if redis_streams.is_unavailable(exc):
                    await reconnect.failed(exc)
                else:
                    log.warning("outputs_read_failed", stream=self.stream, error=str(exc))
                    await asyncio.sleep(1)
                continue
            reconnect.succeeded()
            for entry_id, fields in entries:
                self._last_id = entry_id
                await self._dispatch(redis_streams.Entry(self.stream, entry_id, fields))

    async def _dispatch(self, entry: redis_streams.Entry) -> None:
        try:
            msg = redis_streams.decode_entry(entry, OutputBatch)
        except codec.WireError as exc:
            self.on_dead_letter(self.stream)
            with contextlib.suppress(RedisError, OSError):
                await redis_streams.dead_letter(self.redis, self.dead_letters, entry, str(exc))
            return
        for out in msg.outputs:
            queue = self.queues.get(out.req_id)
            if queue is not None:
                queue.put_nowait(out)
