"""One accepted request from enqueue to its last piece of text: it goes on the request stream,
its outputs are deduplicated, detokenized and checked for stop strings, and whenever it ends
before the ledger finished it (stop string, timeout, disconnect, shutdown) the ledger is told.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING

from gateway.bodies import Usage
from gateway.fields import ApiError
from gateway.output_reader import SHUTDOWN, TokenTracker
from gateway.protocol import Job, sampling_params
from gateway.stops import StopMatcher
from observability import get_logger, inject_traceparent
from services.tokenization.tokenizer import IncrementalDetokenizer
from services.wire.messages import GenerateRequest, RequestOutput, TokenLogprobs

if TYPE_CHECKING:
    from gateway.router import Route
    from gateway.state import Gateway

log = get_logger("gateway.inflight")

RETRY_AFTER_S = 1  # what a 503 for a request the service could not serve now asks
DISCONNECT_POLL_S = 0.5  # how soon a vanished client is noticed without handler cancellation


LEDGER_FIELD_PREFIX = "field '"  # the ledger's refusals name the field first
WORKER_FAILED_PREFIX = "the worker failed on this request"


class GenerationError(ApiError):
    """Ends an accepted request; `abort_reason` is what the ledger is told (None: it knows)."""

    def __init__(
        self,
        status: int,
        message: str,
        abort_reason: str | None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(status, message, headers=headers)
        self.abort_reason = abort_reason


class ClientGone(ConnectionResetError):
    pass


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, when asked


class Generation:
    """`async with Generation(...) as gen: async for delta in gen.deltas(): ...`"""

    def __init__(
        self,
        gw: Gateway,
        job: Job,
        client_gone: Callable[[], bool],
        arrival: float,
        response_id: str | None = None,  # shared by the choices of one response
    ) -> None:
        self.gw = gw
        self.job = job
        self.client_gone = client_gone
        self.arrival = arrival  # time.monotonic() when the HTTP request came in
        prefix = "chatcmpl-" if job.kind == "chat" else "cmpl-"
        unique = uuid.uuid4().hex
        # The client's request_id names the response (as vLLM); the ledger's id stays unique
        # even when a client reuses one.
        self.response_id = response_id or prefix + (job.request_id or unique)
        self.req_id = (
            prefix + unique if job.request_id is None else f"{self.response_id}-{unique[:8]}"
        )
        self.sampling = sampling_params(job, gw.tokenizer.eos_token_ids)
        self.tracker = TokenTracker()
        self.detokenizer = IncrementalDetokenizer(
            gw.tokenizer, job.prompt_token_ids, skip_special_tokens=job.skip_special_tokens
        )
        self.stops = StopMatcher(job.stop, include_stop_str=job.include_stop_str_in_output)
        self.first_token_s: float | None = None
        self.enqueued_at: float | None = None  # time.monotonic() when it went on the stream
        self.last_token_at: float | None = None  # time.monotonic() of its last token
        self.finish_reason: str | None = None
        self.ended_by: BaseException | None = None  # an error the handler caught and answered
        self._enqueued = False
        self._aborted = False  # the ledger was told to stop it
        self._queue: asyncio.Queue | None = None
        self.replica: str | None = None  # routing's choice, on entry
        self.route: Route | None = None  # decided before entry (with external replicas)
        # A fan-out puts its generations on the ledger a few at a time (gateway.fanout): one
        # not entered yet waits here before its deltas; `refused` is why it never will be.
        self.entered = asyncio.Event()
        self.refused: BaseException | None = None
        self.on_started: Callable[[], None] | None = None  # once: its first output, or its end
        self.on_ended: Callable[[], None] | None = None  # once: its last output, or its exit

    async def __aenter__(self) -> Generation:
        # 503 here when every replica is out; pending there until __aexit__ releases it.
        route = self.route or self.gw.routing.route(self.job, self.req_id)
        self.replica = route.replica
        # Register before enqueueing: the first output may come back before XADD returns.
        self._queue = self.gw.outputs.register(self.req_id)
        if self.gw.closing:  # the shutdown broadcast may have gone out before registration
            self._queue.put_nowait(SHUTDOWN)
        request = GenerateRequest(
            req_id=self.req_id,
            gateway_id=self.gw.gateway_id,
            prompt_token_ids=self.job.prompt_token_ids,
            sampling=self.sampling,
            arrival_time=time.time(),
            priority=self.job.priority,
            cache_salt=self.job.cache_salt,
            traceparent=inject_traceparent(),
            expected_cached_tokens=route.expected_cached_tokens,
        )
        # Set first: an XADD cut short (cancelled, or its reply lost) may still have landed.
        self._enqueued = True
        self.enqueued_at = time.monotonic()
        try:
            await self.gw.enqueue(request, self.replica)
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, None)
            raise
        self.entered.set()
        log.info(
            "request_enqueued", req_id=self.req_id, kind=self.job.kind,
            prompt_tokens=len(self.job.prompt_token_ids), max_tokens=self.sampling.max_tokens,
            stream=self.job.stream, request_id=self.job.request_id, user=self.job.user,
            session_id=self.job.session_id,
        )  # fmt: skip
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.gw.outputs.unregister(self.req_id)
        self.gw.routing.release(self.req_id)
        self._started()
        self._ended()
        if not self._enqueued:
            return
        exc = exc or self.ended_by
        if exc is not None:
            reason = _abort_reason(exc)
        else:  # deltas() only returns early on a stop string
            reason = "stop_string" if self.stops.matched is not None else "gateway_error"
        await self._abort(reason)
        self.finish_reason = self.finish_reason or (
            "error" if reason == "gateway_error" else "abort"
        )
        self.gw.metrics.record_request_finished(
            e2e_seconds=time.monotonic() - self.arrival,
            prompt_tokens=len(self.job.prompt_token_ids),
            generation_tokens=len(self.tracker.token_ids),
            finished_reason=self.finish_reason,
        )
        log.info(
            "request_finished", req_id=self.req_id, finish_reason=self.finish_reason,
            completion_tokens=len(self.tracker.token_ids), ttft_s=self.first_token_s,
            e2e_s=round(time.monotonic() - self.arrival, 6),
        )  # fmt: skip

    def refuse(self, exc: BaseException) -> None:
        """This generation will never be enqueued (its fan-out failed): its deltas raise `exc`."""
        self.refused = exc
        self.entered.set()

    async def _abort(self, reason: str) -> None:
        if not self.tracker.finished and not self._aborted:
            self._aborted = True
            await self.gw.abort(self.req_id, reason, self.replica)

    def _started(self) -> None:
        callback, self.on_started = self.on_started, None
        if callback is not None:
            callback()

    def _ended(self) -> None:
        callback, self.on_ended = self.on_ended, None
        if callback is not None:
            callback()

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text as it becomes safe to show; the last delta carries the finish reason."""
        await self.entered.wait()
        if self.refused is not None:
            raise self.refused
        while True:
            start = len(self.tracker.token_ids)
            new_ids = self.tracker.accept(await self._next_output())
            self._started()
            logprobs = self._logprobs(start)
            if new_ids:
                self.last_token_at = time.monotonic()
                if self.first_token_s is None:
                    self.first_token_s = self.last_token_at - self.arrival
                    self.gw.metrics.record_first_token(self.first_token_s)
            final = self.tracker.final
            if final is not None and final.finish_reason == "error":
                self.finish_reason = "error"
                raise ledger_failure(final.error or "no detail given", final.unavailable)
            check = len(self.tracker.token_ids) > self.job.min_tokens
            text = self.stops.push(self._text(new_ids), final=final is not None, check=check)
            if self.stops.matched is not None:
                self.finish_reason = "stop"
                # Told now, not when the response ends: a fan-out's other sequences may run on
                # long after this one, and this one would hold its place in the batch meanwhile.
                await self._abort("stop_string")
                self._ended()
                yield Delta(text, new_ids, "stop", logprobs)
                return
            if final is not None:
                self.finish_reason = final.finish_reason or "stop"
                self._ended()
                yield Delta(text, new_ids, self.finish_reason, logprobs)
                return
            if text or new_ids:
                yield Delta(text, new_ids, logprobs=logprobs)

    def _logprobs(self, start: int) -> list[TokenLogprobs]:
        """The new tokens' logprobs; a ledger that dropped them fails the request loudly."""
        tracker, sampling = self.tracker, self.sampling
        wanted = sampling.logprobs is not None
        if (wanted and len(tracker.token_ids) != len(tracker.logprobs)) or (
            sampling.prompt_logprobs is not None
            and tracker.token_ids
            and tracker.prompt_logprobs is None
        ):
            self.finish_reason = "error"
            raise GenerationError(
                500, "the ledger returned tokens without the logprobs the request asked for",
                "gateway_error",
            )  # fmt: skip
        return tracker.logprobs[start:] if wanted else []

    def _text(self, new_ids: list[int]) -> str:
        final = self.tracker.final
        stop_id = None
        if final is not None and final.finish_reason == "stop":
            stop_id = final.stop_token_id
            if stop_id is None:
                stop_id = self.sampling.eos_token_id
        # As vLLM: the token that stopped the request (EOS or a stop token) counts as output but
        # shows no text, unless include_stop_str_in_output asks for it.
        hidden = stop_id is not None and not self.job.include_stop_str_in_output
        ids = new_ids[:-1] if hidden and new_ids and new_ids[-1] == stop_id else new_ids
        text = self.detokenizer.push(ids) if ids else ""
        return text + self.detokenizer.flush() if final is not None else text

    async def _next_output(self) -> RequestOutput:
        assert self._queue is not None, "use Generation as an async context manager"
        loop = asyncio.get_running_loop()
        timeout_s = self.gw.config.request_timeout_s
        deadline = loop.time() + timeout_s
        waiting_since = time.monotonic()
        while (remaining := deadline - loop.time()) > 0:
            if self.client_gone():
                raise ClientGone("the client disconnected")
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation.
                async with asyncio.timeout(min(remaining, DISCONNECT_POLL_S)):
                    item = await self._queue.get()
            except TimeoutError:
                try:
                    await self.gw.check_progress(waiting_since)
                except ApiError as exc:
                    raise GenerationError(exc.status, exc.message, "stalled") from None
                continue
            if item is SHUTDOWN:
                raise GenerationError(
                    503, "the gateway is shutting down; the request was aborted",
                    "gateway_shutdown",
                )  # fmt: skip
            return item
        raise GenerationError(
            504, f"no output from the ledger for {timeout_s:g}s; the request was aborted",
            "timeout",
        )  # fmt: skip

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's stop_reason: the stop string or stop token id (None for EOS and others)."""
        if self.stops.matched is not None:
            return self.stops.matched
        final = self.tracker.final
        if final is None or final.stop_token_id == self.sampling.eos_token_id:
            return None
        return final.stop_token_id

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=len(self.job.prompt_token_ids),
            completion_tokens=len(self.tracker.token_ids),
            cached_tokens=self.tracker.num_cached_tokens or 0,
        )


def _abort_reason(exc: BaseException) -> str:
    if isinstance(exc, GenerationError):
        return exc.abort_reason or "ledger_error"
    if isinstance(exc, asyncio.CancelledError | ConnectionError):
        return "client_disconnected"
    return "gateway_error"


def ledger_failure(detail: str, unavailable: bool = False) -> GenerationError:
    """The ledger's explicit error for one request: the request's own fault (a field the
    ledger refused, or settings a worker could not sample with) is a 400; what the service
    could not do now (no live worker, Redis lost the request) a 503 with Retry-After; the
    rest a 500."""
    message = f"the ledger failed the request: {detail}"
    if unavailable:
        return GenerationError(503, message, None, headers={"Retry-After": str(RETRY_AFTER_S)})
    if detail.startswith(LEDGER_FIELD_PREFIX) or detail.startswith(WORKER_FAILED_PREFIX):
        return GenerationError(400, message, None)
    return GenerationError(500, message, None)
