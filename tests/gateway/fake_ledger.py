"""A stand-in for the ledger service in gateway tests: it reads the real requests stream, keeps a
real `LedgerStatus` key, and answers each GenerateRequest with real RequestOutputs as a `Script`
says (tokens, chunking, finish, errors, delays, repeats). A double for the other service only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from services.tokenization.tokenizer import ByteTokenizer
from services.transport import redis_streams
from services.transport.keys import StreamNames
from services.wire import codec
from services.wire.messages import (
    AbortRequest,
    GenerateRequest,
    LedgerStatus,
    OutputBatch,
    RequestOutput,
    RoutingCosts,
    SharedTierStatus,
    TokenLogprobs,
)

EOS = ByteTokenizer.EOS_ID
TEXT = "Hello from the fake ledger! "
STATUS_TTL_MS = 2000


@dataclass
class Script:
    """How the fake ledger answers every request."""

    text: str = TEXT  # generated as bytes (the byte tokenizer's ids), cycled up to max_tokens
    eos_after: int | None = None  # emit EOS after this many text tokens: finish "stop"
    chunk: int = 1  # tokens per RequestOutput
    delay_s: float = 0.0  # before each output
    error: str | None = None  # finish "error" with this message after `error_after` tokens
    error_after: int = 0
    duplicate: bool = False  # every output is sent twice
    rerun_after: int | None = None  # after this many tokens start over at position 0 (a restart)
    swap_pairs: bool = False  # outputs 1, 0, 3, 2, ...: each pair arrives with a gap first
    silent: bool = False  # never answer
    cached_tokens: int = 0
    queued_s: float | None = None  # sent with the first tokens, as the ledger does
    vary_by_seed: bool = False  # start the text at offset seed, so that samples differ
    ids: list[int] | None = None  # exactly these token ids (then `eos`) instead of the text
    eos: int = EOS  # the EOS id of `ids` (a checkpoint tokenizer's)


def generated_ids(req: GenerateRequest, script: Script) -> tuple[list[int], str, int | None]:
    """The whole output of a request: token ids, finish reason, stop token id."""
    limit = req.sampling.max_tokens
    if script.ids is not None:
        if len(script.ids) < limit:
            return [*script.ids, script.eos], "stop", script.eos
        return script.ids[:limit], "length", None
    text = script.text.encode()
    start = (req.sampling.seed or 0) if script.vary_by_seed else 0
    if script.eos_after is not None and script.eos_after < limit:
        ids = [text[(start + i) % len(text)] for i in range(script.eos_after)]
        return [*ids, EOS], "stop", EOS
    return [text[(start + i) % len(text)] for i in range(limit)], "length", None


def outputs_for(req: GenerateRequest, script: Script) -> list[RequestOutput]:
    """The RequestOutputs the fake ledger appends for `req`, in order."""
    if script.error is not None:
        ids = generated_ids(req, script)[0][: script.error_after]
        outs = _chunked(req, ids, script, finish=None)
        return [*outs, _output(req, [], len(ids), script, "error", error=script.error)]
    ids, reason, stop_id = generated_ids(req, script)
    outs = _chunked(req, ids, script, finish=(reason, stop_id))
    if script.rerun_after is not None:
        cut = [o for o in outs if o.position < script.rerun_after]
        outs = [*cut, *outs]
    if script.swap_pairs:
        outs = [o for pair in zip(outs[1::2], outs[0::2], strict=False) for o in pair] + (
            [outs[-1]] if len(outs) % 2 else []
        )
    if script.duplicate:
        outs = [o for out in outs for o in (out, out)]
    return outs


def _chunked(
    req: GenerateRequest, ids: list[int], script: Script, finish: tuple[str, int | None] | None
) -> list[RequestOutput]:
    starts = range(0, len(ids), script.chunk)
    outs = [_output(req, ids[i : i + script.chunk], i, script) for i in starts]
    if finish is not None and outs:
        outs[-1].finished, outs[-1].finish_reason = True, finish[0]
        outs[-1].stop_token_id = finish[1]
    return outs


def fake_logprobs(token_id: int, position: int, k: int, seed: int | None = None) -> TokenLogprobs:
    """A made-up entry in the worker's layout: the chosen token, then k others (rank 1 first).
    Samples of different seeds differ: seed % 7 lowers every chosen logprob by 0.01 each."""
    chosen = -0.25 * (position % 4 + 1) - 0.01 * ((seed or 0) % 7)
    top = [t for t in range(65, 65 + k + 1) if t != token_id][:k]
    return TokenLogprobs(
        token_ids=[token_id, *top],
        logprobs=[chosen, *(-0.1 * (i + 1) for i in range(len(top)))],
        rank=position % 4 + 2,
    )


def _output(
    req: GenerateRequest, ids: list[int], position: int, script: Script,
    finish_reason: str | None = None, error: str | None = None,
) -> RequestOutput:  # fmt: skip
    s = req.sampling
    logprobs = prompt_logprobs = None
    if ids and s.logprobs is not None:
        logprobs = [fake_logprobs(t, position + i, s.logprobs, s.seed) for i, t in enumerate(ids)]
    if ids and position == 0 and s.prompt_logprobs is not None:
        prompt = req.prompt_token_ids
        prompt_logprobs = [fake_logprobs(t, p, s.prompt_logprobs) for p, t in enumerate(prompt)][1:]
    return RequestOutput(
        req_id=req.req_id,
        new_token_ids=ids,
        position=position,
        finished=finish_reason is not None,
        finish_reason=finish_reason,
        num_prompt_tokens=len(req.prompt_token_ids),
        num_cached_tokens=script.cached_tokens,
        error=error,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        queued_s=script.queued_s if ids and position == 0 else None,
    )


@dataclass
class FakeLedger:
    redis_url: str
    prefix: str
    script: Script = field(default_factory=Script)
    model_name: str = "fake-model"
    max_model_len: int = 64
    vocab_size: int = 258
    num_workers: int = 1
    scheduling_policy: str = "fcfs"
    max_num_seqs: int = 0  # in its status: 0 says nothing of its batch
    costs: RoutingCosts | None = None
    num_cpu_blocks: int = 0
    shared_tier: str | None = None
    metrics: dict[str, float] | None = None
    replica: str = "default"
    requests: list[GenerateRequest] = field(default_factory=list)
    aborts: list[AbortRequest] = field(default_factory=list)
    peak_answering: int = 0  # the most requests it was answering at once (neither done nor aborted)

    async def __aenter__(self) -> FakeLedger:
        self.streams = StreamNames(self.prefix, self.replica)
        # Every answer is its own task: they wait for a connection rather than fail past a cap.
        self.redis = redis_streams.connect_pooled(self.redis_url, 64, 30.0)
        self._answers: dict[str, asyncio.Task] = {}
        await self._write_status()
        self._tasks = [asyncio.create_task(self._heartbeat()), asyncio.create_task(self._serve())]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in [*self._tasks, *self._answers.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._answers.values(), return_exceptions=True)
        await self.redis.delete(self.streams.ledger_status)
        await self.redis.aclose()

    def status(self) -> LedgerStatus:
        now = time.time()
        return LedgerStatus(
            epoch="fake-epoch", started_at=now, updated_at=now, model_name=self.model_name,
            max_model_len=self.max_model_len, vocab_size=self.vocab_size, block_size=16,
            num_gpu_blocks=100, capacity_line="KV cache size: 1600 tokens", hash_algo="sha256",
            num_workers=self.num_workers, num_running=len(self._answers), metrics=self.metrics,
            scheduling_policy=self.scheduling_policy, max_num_seqs=self.max_num_seqs,
            costs=self.costs, num_cpu_blocks=self.num_cpu_blocks,
            shared_tier=SharedTierStatus(self.shared_tier, "dir", "REMOTE")
            if self.shared_tier is not None
            else None,
        )  # fmt: skip

    async def _write_status(self) -> None:
        await self.redis.set(
            self.streams.ledger_status, codec.encode(self.status()), px=STATUS_TTL_MS
        )

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            await self._write_status()

    async def _serve(self) -> None:
        last_id: bytes | str = "0-0"
        while True:
            for entry_id, fields in await redis_streams.read_from(
                self.redis, self.streams.requests, last_id, block_ms=200
            ):
                last_id = entry_id
                self._handle(codec.decode(fields[redis_streams.FIELD]))

    def _handle(self, msg: object) -> None:
        if isinstance(msg, AbortRequest):
            self.aborts.append(msg)
            task = self._answers.pop(msg.req_id, None)
            if task is not None:
                task.cancel()
        elif isinstance(msg, GenerateRequest):
            self.requests.append(msg)
            if not self.script.silent:
                self._answers[msg.req_id] = asyncio.create_task(self._answer(msg))
                self.peak_answering = max(self.peak_answering, len(self._answers))

    async def _answer(self, req: GenerateRequest) -> None:
        stream = self.streams.outputs(req.gateway_id)
        for out in outputs_for(req, self.script):
            if self.script.delay_s:
                await asyncio.sleep(self.script.delay_s)
            await redis_streams.append(self.redis, stream, OutputBatch(outputs=[out]))
        self._answers.pop(req.req_id, None)

    async def wait_for_requests(
        self, count: int = 1, timeout: float = 5.0
    ) -> list[GenerateRequest]:
        await _until(lambda: len(self.requests) >= count, timeout, f"{count} request(s)")
        return self.requests

    async def wait_for_abort(self, req_id: str, timeout: float = 5.0) -> AbortRequest:
        await _until(lambda: any(a.req_id == req_id for a in self.aborts), timeout, "an abort")
        return next(a for a in self.aborts if a.req_id == req_id)


async def _until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"the fake ledger saw no {what} within {timeout}s")
        await asyncio.sleep(0.01)


async def request_stream(redis: aioredis.Redis, prefix: str) -> list[object]:
    """Every message on the real requests stream, decoded, oldest first."""
    entries = await redis.xrange(StreamNames(prefix).requests)
    return [codec.decode(fields[redis_streams.FIELD]) for _, fields in entries]
