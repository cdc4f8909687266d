"""The ledger -> gateway direction: one reader task per gateway tails its outputs stream and
hands each `RequestOutput` to the queue of the request waiting for it; `TokenTracker` (pure)
turns those outputs, which may repeat or arrive out of order, into one gap-free token list.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from observability import get_logger
from services.transport import redis_streams
from services.transport.keys import OUTPUTS_TTL_S
from services.wire import codec
from services.wire.messages import OutputBatch, RequestOutput, TokenLogprobs

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


class OutputDispatcher:
    """Tails `{prefix}:outputs:{gateway_id}` with plain XREAD and routes outputs by req_id.

    It starts at the stream's last entry when the gateway starts (XREAD's "$", read once as a
    concrete id so that nothing appended between start-up and the first read is lost). Outputs
    for unknown requests (their client is gone) are dropped; entries that do not parse go to the
    dead-letter stream.
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
        self.watch_interval_s = watch_interval_s
        self.data_losses = 0

    def register(self, req_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[req_id] = queue
        return queue

    def unregister(self, req_id: str) -> None:
        self.queues.pop(req_id, None)

    def broadcast(self, item: object) -> None:
        for queue in self.queues.values():
            queue.put_nowait(item)

    async def start(self) -> None:
        tail = await self.redis.xrevrange(self.stream, count=1)
        self._last_id = cast(bytes, tail[0][0]) if tail else b"0-0"
        self._task = asyncio.create_task(self._run(), name=f"outputs:{self.stream}")
        if self.marker is not None:
            await self._marker_missing()
            self._watch_task = asyncio.create_task(self._watch(), name=f"watch:{self.marker}")

    async def stop(self) -> None:
        for task in (self._task, self._watch_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._watch_task = None

    async def _marker_missing(self) -> bool:
        """Set the marker (renewing its expiry); True when it was not there."""
        assert self.marker is not None
        ttl_s = max(60, int(self.watch_interval_s * 60))
        return await self.redis.set(self.marker, b"1", ex=ttl_s, get=True) is None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.watch_interval_s)
            try:
                lost = await self._marker_missing()
            except (RedisError, OSError):
                continue  # the reader's loop reports the outage
            if lost:
                self.fail_all("Redis restarted without its data and lost this request; retry it")

    def fail_all(self, error: str) -> None:
        """End every waiting request with an explicit error (it may have been lost)."""
        self.data_losses += 1
        log.error("redis_data_lost", stream=self.stream, failed_requests=len(self.queues))
        for req_id, queue in list(self.queues.items()):
            queue.put_nowait(
                RequestOutput(req_id, [], finished=True, finish_reason="error", error=error)
            )

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
