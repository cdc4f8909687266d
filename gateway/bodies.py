"""OpenAI response bodies, pure: whole completions, server-sent-event chunks, usage and errors,
for both /v1/completions ("completion") and /v1/chat/completions ("chat").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Meta:
    """What every body of one response repeats."""

    kind: str  # "completion" or "chat"
    id: str
    created: int
    model: str


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.cached_tokens + other.cached_tokens,
        )

    def body(self) -> dict[str, Any]:
        return self.counts() | {"prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def counts(self) -> dict[str, int]:
        """The usage of a chunk under continuous_usage_stats: vLLM sends no details there."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's ErrorResponse: `code` is the HTTP status (an int, never null)."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def final_body(
    meta: Meta,
    text: str | None,
    finish_reason: str | None,
    stop_reason: str | int | None,
    usage: Usage,
    token_ids: tuple[list[int], list[int]] | None = None,
    role: str = "assistant",
    prompt_text: str | None = None,
    logprobs: dict[str, Any] | None = None,
    prompt_logprobs: list[Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A whole (non-streaming) response; `token_ids` is (prompt ids, generated ids) when asked.
    vLLM puts `prompt_logprobs` in the choice for completions, beside `choices` for chat."""
    if meta.kind == "chat":
        message: dict[str, Any] = {"role": role, "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": 0, "message": message}
    else:
        choice = {"index": 0, "text": text}
    choice.update(logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
    if token_ids is not None:
        choice["token_ids"] = token_ids[1]
    if prompt_logprobs is not None and meta.kind != "chat":
        choice["prompt_logprobs"] = prompt_logprobs
    body = _envelope(meta, streaming=False) | {"choices": [choice], "usage": usage.body()}
    if token_ids is not None:
        _put_prompt_token_ids(meta, body, choice, token_ids[0])
    if prompt_logprobs is not None and meta.kind == "chat":
        body["prompt_logprobs"] = prompt_logprobs
    if prompt_text is not None:
        body["prompt_text"] = prompt_text
    return body


def combined_body(bodies: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
    """One response of several choices (n, best_of, batch prompts), indexed in order."""
    body = dict(bodies[0])
    body["choices"] = [b["choices"][0] | {"index": i} for i, b in enumerate(bodies)]
    body["usage"] = usage.body()
    return body


def chunk_body(
    meta: Meta,
    text: str | None,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
    role: str | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One streamed piece of choice `index`; chat's first chunk carries the role. A chat delta
    holds the text ("" included; None: no content key) and any tool-call deltas."""
    if meta.kind == "chat":
        delta: dict[str, Any] = {"role": role} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": index, "delta": delta}
    else:
        choice = {"index": index, "text": text}
    choice.update(logprobs=logprobs, finish_reason=finish_reason)
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = _envelope(meta, streaming=True) | {"choices": [choice]}
    if prompt_token_ids is not None:
        _put_prompt_token_ids(meta, body, choice, prompt_token_ids)
    return body


def _put_prompt_token_ids(
    meta: Meta, body: dict[str, Any], choice: dict[str, Any], ids: list[int]
) -> None:
    # vLLM: in each choice for completions (prompts differ per choice), beside `choices` for chat.
    if meta.kind == "chat":
        body["prompt_token_ids"] = ids
    else:
        choice["prompt_token_ids"] = ids


def usage_chunk(meta: Meta, usage: Usage) -> dict[str, Any]:
    """The last chunk before [DONE] when stream_options.include_usage is set."""
    return _envelope(meta, streaming=True) | {"choices": [], "usage": usage.body()}


def sse(body: dict[str, Any]) -> bytes:
    return (
        b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    )


def _envelope(meta: Meta, streaming: bool) -> dict[str, Any]:
    if meta.kind == "chat":
        obj = "chat.completion.chunk" if streaming else "chat.completion"
    else:
        obj = "text_completion"
    return {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model}
