"""The request's GenAI span: OpenTelemetry's GenAI semantic conventions beside the HTTP server
span, named `{gen_ai.operation.name} {gen_ai.request.model}` (`text_completion m`, `chat m`).

It carries the request's parameters (gen_ai.request.*), the response's id, model and one finish
reason per choice, the usage, and vLLM 0.33's own attributes (gen_ai.request.id and .n, the older
gen_ai.usage.prompt_tokens/completion_tokens and the gen_ai.latency.* breakdown), so a dashboard
built for vLLM's `llm_request` span reads ours. The ledger's and the workers' spans are its
children: its traceparent is the one every ledger request of the response carries.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gateway.bodies import Usage
from gateway.protocol import Job
from observability import Attr

if TYPE_CHECKING:
    from opentelemetry.util.types import AttributeValue

    from gateway.inflight import Generation

PROVIDER = "kvledger"  # gen_ai.provider.name: who serves the model


def operation_name(kind: str) -> str:
    return "chat" if kind == "chat" else "text_completion"


def span_name(operation: str, model: str) -> str:
    return f"{operation} {model}"


def request_attributes(job: Job, operation: str, model: str) -> dict[str, AttributeValue]:
    """What the client asked for (a resolved job: max_tokens is filled in)."""
    attributes: dict[str, AttributeValue] = {
        Attr.GEN_AI_OPERATION_NAME: operation,
        Attr.GEN_AI_PROVIDER_NAME: PROVIDER,
        Attr.GEN_AI_REQUEST_MODEL: job.model or model,
        Attr.GEN_AI_REQUEST_TEMPERATURE: job.temperature,
        Attr.GEN_AI_REQUEST_TOP_P: job.top_p,
        Attr.GEN_AI_REQUEST_STREAM: job.stream,
        Attr.VLLM_REQUEST_N: job.n,
    }
    if job.max_tokens is not None:
        attributes[Attr.GEN_AI_REQUEST_MAX_TOKENS] = job.max_tokens
    if job.n != 1:  # the conventions set it only when it is not 1
        attributes[Attr.GEN_AI_REQUEST_CHOICE_COUNT] = job.n
    if job.top_k:
        attributes[Attr.GEN_AI_REQUEST_TOP_K] = job.top_k
    if job.seed is not None:
        attributes[Attr.GEN_AI_REQUEST_SEED] = job.seed
    return attributes


def response_attributes(
    gens: list[Generation], usage: Usage, model: str, arrival: float
) -> dict[str, AttributeValue]:
    """What came back: one finish reason per choice (in choice order), the usage, and vLLM's
    latency breakdown. `arrival` is time.monotonic() when the HTTP request came in."""
    attributes: dict[str, AttributeValue] = {
        Attr.GEN_AI_RESPONSE_MODEL: model,
        Attr.GEN_AI_INPUT_TOKENS: usage.prompt_tokens,
        Attr.GEN_AI_OUTPUT_TOKENS: usage.completion_tokens,
        Attr.GEN_AI_CACHE_READ_INPUT_TOKENS: usage.cached_tokens,
        Attr.VLLM_USAGE_PROMPT_TOKENS: usage.prompt_tokens,
        Attr.VLLM_USAGE_COMPLETION_TOKENS: usage.completion_tokens,
        Attr.VLLM_LATENCY_E2E: time.monotonic() - arrival,
    }
    if not gens:
        return attributes
    first = gens[0]
    attributes[Attr.GEN_AI_RESPONSE_ID] = first.response_id
    attributes[Attr.VLLM_REQUEST_ID] = first.response_id
    attributes[Attr.REQUEST_ID] = first.req_id
    if len(gens) > 1:
        attributes[Attr.REQUEST_IDS] = [gen.req_id for gen in gens]
    reasons = [gen.finish_reason for gen in gens if gen.finish_reason is not None]
    if reasons:
        attributes[Attr.GEN_AI_RESPONSE_FINISH_REASONS] = reasons
    first_tokens = [gen.first_token_s for gen in gens if gen.first_token_s is not None]
    if first_tokens:
        attributes[Attr.VLLM_LATENCY_TIME_TO_FIRST_TOKEN] = min(first_tokens)
    attributes.update(_breakdown(first, arrival))
    return attributes


def _breakdown(gen: Generation, arrival: float) -> dict[str, AttributeValue]:
    """vLLM's gen_ai.latency.time_in_queue / _in_model_prefill / _decode / _inference of one
    choice: the ledger's queue time (arrival to first admission) places its first scheduling on
    the gateway's clock; the first and last tokens are when the gateway received them."""
    queued_s, enqueued_at = gen.tracker.queued_s, gen.enqueued_at
    if queued_s is None or enqueued_at is None:
        return {}
    out: dict[str, AttributeValue] = {Attr.VLLM_LATENCY_TIME_IN_QUEUE: queued_s}
    scheduled_at = enqueued_at + queued_s
    if gen.first_token_s is not None:
        first_token_at = arrival + gen.first_token_s
        out[Attr.VLLM_LATENCY_TIME_IN_MODEL_PREFILL] = max(first_token_at - scheduled_at, 0.0)
        if gen.last_token_at is not None:
            out[Attr.VLLM_LATENCY_TIME_IN_MODEL_DECODE] = max(
                gen.last_token_at - first_token_at, 0.0
            )
            out[Attr.VLLM_LATENCY_TIME_IN_MODEL_INFERENCE] = max(
                gen.last_token_at - scheduled_at, 0.0
            )
    return out
