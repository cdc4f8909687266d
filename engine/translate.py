"""Between the wire and the core: requests in, step messages and outputs out.

Pure functions over `services.wire.messages` and the ledger core (no Redis): the service module does
the I/O, this module decides what the messages say.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ledger.hashing import BlockHasher
from ledger.request import Request, RequestStatus
from ledger.scheduler import SchedulerOutput
from services.transport.redis_streams import Entry
from services.wire.messages import (
    CachedRequestData,
    GenerateRequest,
    KVTransfer,
    KVTransfers,
    NewRequestData,
    RequestOutput,
    SamplingParams,
    SharedTransfer,
    StepMessage,
    StepResult,
    TokenLogprobs,
    normalized_temperature,
)


@dataclass(slots=True)
class Tracked:
    """What the shell keeps per request beside the core's Request (its `payload`)."""

    entry: Entry | None  # the requests-stream entry, acked when the request ends
    msg: GenerateRequest
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # of tokens not yet sent
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # by prompt position
    queued_s: float | None = None  # arrival to first admission, sent with the first tokens


def validate_request(msg: GenerateRequest, vocab_size: int, max_model_len: int) -> str | None:
    """Why the ledger cannot run this request (naming the field), or None."""
    s = msg.sampling
    if not msg.prompt_token_ids:
        return "field 'prompt_token_ids': empty prompt"
    bad = next((t for t in msg.prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"field 'prompt_token_ids': token id {bad} is outside the vocabulary (size {vocab_size})"
    if s.max_tokens < 1:
        return f"field 'sampling.max_tokens': must be at least 1, got {s.max_tokens}"
    if len(msg.prompt_token_ids) + s.max_tokens > max_model_len:
        return (
            f"field 'sampling.max_tokens': {len(msg.prompt_token_ids)} prompt tokens plus "
            f"{s.max_tokens} output tokens exceed max_model_len {max_model_len}"
        )
    if s.temperature < 0 or not 0 < s.top_p <= 1 or s.top_k < 0 or s.min_tokens < 0:
        return (
            "field 'sampling': temperature >= 0, 0 < top_p <= 1, top_k >= 0 and min_tokens >= 0 "
            "are required"
        )
    return _check_numbers(s)


MAX_ABS_LOGIT_BIAS = 100.0  # vLLM clamps a bias to [-100, 100]


def _check_numbers(s: SamplingParams) -> str | None:
    """Every float a worker computes with must be finite and in vLLM's range: one NaN or
    infinity would break the whole batch's sampling on every worker."""
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):  # fmt: skip
        value = getattr(s, name)
        if not math.isfinite(value):
            return f"field 'sampling.{name}': must be a finite number, got {value}"
    if not 0 <= s.min_p <= 1:
        return f"field 'sampling.min_p': must be in [0, 1], got {s.min_p}"
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(s, name) <= 2:
            return f"field 'sampling.{name}': must be in [-2, 2], got {getattr(s, name)}"
    if s.repetition_penalty <= 0:
        return f"field 'sampling.repetition_penalty': must be > 0, got {s.repetition_penalty}"
    for token, bias in (s.logit_bias or {}).items():
        if not math.isfinite(bias):
            return f"field 'sampling.logit_bias': token {token} has a bias of {bias}"
    return None


def normalize_sampling(s: SamplingParams) -> None:
    """vLLM's normalisation of a checked request's sampling settings, in place."""
    s.temperature = normalized_temperature(s.temperature)
    if s.logit_bias:
        s.logit_bias = {
            t: min(MAX_ABS_LOGIT_BIAS, max(-MAX_ABS_LOGIT_BIAS, b)) for t, b in s.logit_bias.items()
        }


def request_from_message(
    msg: GenerateRequest, entry: Entry | None, hasher: BlockHasher | None, block_size: int
) -> Request[Tracked]:
    s = msg.sampling
    normalize_sampling(s)
    return Request(
        msg.req_id,
        msg.prompt_token_ids,
        s.max_tokens,
        eos_token_id=s.eos_token_id,
        stop_token_ids=s.stop_token_ids or (),
        priority=msg.priority,
        arrival_time=msg.arrival_time,
        cache_salt=msg.cache_salt,
        block_hasher=hasher,
        block_size=block_size,
        skip_reading_prefix_cache=s.prompt_logprobs is not None,
        payload=Tracked(entry, msg),
    )


def file_logprobs(out: SchedulerOutput[Tracked], result: StepResult) -> None:
    """Keep a step's logprobs with their requests until their tokens go out (`request_output`).

    A prompt position computed twice (a request preempted in its prefill) keeps the later entry.
    """
    if not result.logprobs and not result.prompt_logprobs:
        return
    requests = {new.request.request_id: new.request for new in out.scheduled_new_reqs}
    requests.update((c.request.request_id, c.request) for c in out.scheduled_cached_reqs)
    for req_id, entry in (result.logprobs or {}).items():
        if req_id in requests:
            requests[req_id].payload.logprobs.append(entry)
    for req_id, chunk in (result.prompt_logprobs or {}).items():
        if req_id in requests:
            positions = requests[req_id].payload.prompt_logprobs
            for offset, entry in enumerate(chunk.positions):
                positions[chunk.start + offset] = entry


def request_output(
    request: Request[Tracked],
    new_token_ids: Sequence[int],
    finish_reason: str | None = None,
    error: str | None = None,
) -> RequestOutput:
    """What a gateway hears about a request: its new tokens (with their logprobs, and the
    prompt's with the first token, when asked) and, at the end, why it ended."""
    tracked = request.payload
    count = len(new_token_ids)
    position = len(request.all_token_ids) - request.num_prompt_tokens - count
    logprobs = prompt_logprobs = None
    sampling = tracked.msg.sampling
    if count and sampling.logprobs is not None:
        logprobs, tracked.logprobs = tracked.logprobs[:count], tracked.logprobs[count:]
    if count and position == 0 and sampling.prompt_logprobs is not None:
        prompt_logprobs = [tracked.prompt_logprobs[p] for p in sorted(tracked.prompt_logprobs)]
    num_cached_tokens = request.num_cached_tokens
    queued_s = tracked.queued_s if count and position == 0 else None
    # Positional: one per request per step, and keywords cost a third of the call.
    return RequestOutput(
        request.request_id,
        new_token_ids,
        position,
        finish_reason is not None,
        finish_reason,
        request.stop_reason,
        request.num_prompt_tokens,
        num_cached_tokens if num_cached_tokens > 0 else 0,
        request.num_preemptions,
        error,
        logprobs,
        prompt_logprobs,
        False,  # unavailable: only a request the ledger gives up on (failure_output)
        queued_s,
    )


def rejection(msg: GenerateRequest, problem: str) -> RequestOutput:
    return RequestOutput(
        req_id=msg.req_id,
        new_token_ids=[],
        finished=True,
        finish_reason="error",
        error=problem,
        num_prompt_tokens=len(msg.prompt_token_ids),
    )


def failure_output(
    request: Request[Tracked], error: str, unavailable: bool = False
) -> RequestOutput:
    """The final output of a request the ledger gave up on (finished as FINISHED_ERROR): its
    client gets `error` (a 503 to retry when `unavailable`: the service could not serve it
    now)."""
    return RequestOutput(
        req_id=request.request_id,
        new_token_ids=[],
        position=request.num_output_tokens,
        finished=True,
        finish_reason=RequestStatus.finish_reason(request.status),  # FINISHED_ERROR: "error"
        error=error,
        num_prompt_tokens=request.num_prompt_tokens,
        num_preemptions=request.num_preemptions,
        unavailable=unavailable,
    )


def build_step_message(
    out: SchedulerOutput[Tracked],
    epoch: str,
    block_size: int,
    num_cpu_chunks: int = 0,
    shared_namespace: str = "",
) -> StepMessage:
    """The wire form of one scheduler step; each request's payload is its `Tracked`."""

    def traceparent(request: Request[Tracked]) -> str | None:
        return request.payload.msg.traceparent

    return StepMessage(
        step_id=out.step_id,
        epoch=epoch,
        new_reqs=[
            NewRequestData(
                req_id=new.request.request_id,
                token_ids=new.token_ids,
                num_prompt_tokens=new.request.num_prompt_tokens,
                block_ids=new.block_ids,
                num_computed_tokens=new.num_computed_tokens,
                sampling=new.request.payload.msg.sampling,
                traceparent=traceparent(new.request),
                num_preemptions=new.request.num_preemptions,
            )
            for new in out.scheduled_new_reqs
        ],
        cached_reqs=[
            CachedRequestData(
                req_id=c.request.request_id,
                new_token_ids=c.new_token_ids,
                new_block_ids=c.new_block_ids,
                num_computed_tokens=c.num_computed_tokens,
            )
            for c in out.scheduled_cached_reqs
        ],
        num_scheduled_tokens=out.num_scheduled_tokens,
        finished_req_ids=sorted(out.finished_req_ids),
        preempted_req_ids=out.preempted_req_ids,
        block_size=block_size,
        sent_at=time.time(),
        kv_transfers=kv_transfers(out, num_cpu_chunks, shared_namespace)
        if out.has_transfers
        else None,
    )


def kv_transfers(
    out: SchedulerOutput[Tracked], num_cpu_chunks: int, shared_namespace: str = ""
) -> KVTransfers:
    """The CPU and shared tiers' copies of a step. Only this step's stores can need a flush: a
    worker runs every copy of a step before it answers, so the stores of earlier steps are done
    already."""
    meta = out.kv_transfers
    assert meta is not None
    transfers = KVTransfers(
        num_cpu_chunks=num_cpu_chunks,
        loads=[KVTransfer(job_id, job.src, job.dst) for job_id, job in meta.load_jobs.items()],
        stores=[KVTransfer(job_id, job.src, job.dst) for job_id, job in meta.store_jobs.items()],
        flush=sorted(job_id for job_id in meta.jobs_to_flush if job_id in meta.store_jobs),
    )
    shared = meta.shared
    if shared:
        transfers.promotions = [
            SharedTransfer(job.job_id, job.chunk_ids, job.keys) for job in shared.promotions
        ]
        transfers.cascades = [
            SharedTransfer(job.job_id, job.chunk_ids, job.keys) for job in shared.cascades
        ]
        transfers.shared_deletes = list(shared.deletes)
        transfers.shared_namespace = shared_namespace
    return transfers
