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
from services import transport, wire
from services.config import OUTPUTS_TTL_S
from services.messages import OutputBatch, RequestOutput, TokenLogprobs

log = get_logger("gateway.outputs")

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
    ) -> None:
        self.redis = redis
        self.stream = stream
        self.dead_letters = dead_letters
        self.on_dead_letter = on_dead_letter
        self.block_ms = block_ms
        self.queues: dict[str, asyncio.Queue] = {}
        self._task: asyncio.Task | None = None
        self._last_id: bytes = b"0-0"

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

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        backoff = 0.1
        refreshed = 0.0
        while True:
            try:
                if time.monotonic() - refreshed > OUTPUTS_TTL_S / 10:
                    # The stream expires once no reader refreshes it (and the ledger stops
                    # writing): a restarted gateway's old stream does not stay behind.
                    await self.redis.expire(self.stream, OUTPUTS_TTL_S)
                    refreshed = time.monotonic()
                entries = await transport.read_from(
                    self.redis, self.stream, self._last_id, block_ms=self.block_ms
                )
            except (RedisError, OSError) as exc:
                # Redis restarting or unreachable: waiting requests time out on their own.
                log.warning("outputs_read_failed", stream=self.stream, error=str(exc))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            for entry_id, fields in entries:
                self._last_id = entry_id
                await self._dispatch(transport.Entry(self.stream, entry_id, fields))

    async def _dispatch(self, entry: transport.Entry) -> None:
        try:
            msg = transport.decode_entry(entry, OutputBatch)
        except wire.WireError as exc:
            self.on_dead_letter(self.stream)
            with contextlib.suppress(RedisError, OSError):
                await transport.dead_letter(self.redis, self.dead_letters, entry, str(exc))
            return
        for out in msg.outputs:
            queue = self.queues.get(out.req_id)
            if queue is not None:
                queue.put_nowait(out)
