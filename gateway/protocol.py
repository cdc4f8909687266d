"""OpenAI request parsing and validation, pure: a JSON body in, a `Job` (token ids and sampling
settings) out, or an `ApiError` naming the offending field. Limits that only the live ledger
knows (context length, vocabulary) are checked afterwards by `resolve`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.fields import (
    CHAT_UNSUPPORTED,
    COMPLETION_UNSUPPORTED,
    INT64_MAX,
    INT64_MIN,
    UINT64_MAX,
    ApiError,
    bad_request,
    read_bool,
    read_cache_salt,
    read_include_usage,
    read_int,
    read_model,
    read_number,
    read_stop,
    read_token_ids,
    refuse_unsupported,
    short,
    type_name,
)
from services.messages import SamplingParams
from services.tokenizer import ChatTemplateError, Tokenizer

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class Limits:
    """What the serving ledger allows (or the gateway's config when no status names it)."""

    model_name: str
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class Job:
    """One validated generation request, ready to go on the wire once `resolve`d."""

    kind: str  # "completion" or "chat"
    prompt_token_ids: list[int]
    prompt_param: str  # the field a prompt-length error names: "prompt" or "messages"
    max_tokens: int | None  # None: whatever the context leaves (chat's default)
    max_tokens_param: str = "max_tokens"
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None
    priority: int = 0
    return_token_ids: bool = False
    model: str | None = None


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", None) from None
    except RecursionError:
        raise bad_request("the request body is not valid JSON: nested too deeply", None) from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None)
    return body


def _refuse_constant(name: str) -> None:
    # Python's json accepts NaN and Infinity; JSON does not, and neither may a sampling setting.
    raise bad_request(f"the request body is not valid JSON: {name} is not a JSON value", None)


def parse_completion(body: dict[str, Any], tokenizer: Tokenizer, default_max_tokens: int) -> Job:
    refuse_unsupported(body, COMPLETION_UNSUPPORTED)
    if "prompt" not in body:
        raise bad_request("'prompt' is required", "prompt")
    prompt_ids = _prompt_token_ids(body["prompt"], tokenizer)
    max_tokens = read_int(body, "max_tokens", lo=1)
    return _job(body, "completion", prompt_ids, "prompt", max_tokens or default_max_tokens)


def parse_chat(body: dict[str, Any], tokenizer: Tokenizer) -> Job:
    refuse_unsupported(body, CHAT_UNSUPPORTED)
    messages = _messages(body.get("messages"))
    try:
        prompt_ids = tokenizer.apply_chat_template(messages)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None
    # vLLM's rule: max_completion_tokens (the newer name) wins over max_tokens.
    param = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    job = _job(body, "chat", prompt_ids, "messages", read_int(body, param, lo=1))
    return dataclasses.replace(job, max_tokens_param=param)


def _job(
    body: dict[str, Any],
    kind: str,
    prompt_ids: list[int],
    prompt_param: str,
    max_tokens: int | None,
) -> Job:
    stream = read_bool(body, "stream")
    top_k = read_int(body, "top_k", lo=-1, hi=INT64_MAX)
    return Job(
        kind=kind,
        prompt_token_ids=prompt_ids,
        prompt_param=prompt_param,
        max_tokens=max_tokens,
        min_tokens=read_int(body, "min_tokens", lo=0) or 0,
        temperature=read_number(body, "temperature", 0.0, 2.0, default=1.0),
        top_p=read_number(body, "top_p", 0.0, 1.0, default=1.0, lo_open=True),
        top_k=0 if top_k in (None, -1) else top_k,
        seed=read_int(body, "seed", lo=INT64_MIN, hi=UINT64_MAX),
        stop=read_stop(body.get("stop")),
        stop_token_ids=read_token_ids(body.get("stop_token_ids"), "stop_token_ids"),
        ignore_eos=read_bool(body, "ignore_eos"),
        stream=stream,
        include_usage=read_include_usage(body.get("stream_options"), stream),
        cache_salt=read_cache_salt(body.get("cache_salt")),
        priority=read_int(body, "priority", lo=INT64_MIN, hi=INT64_MAX) or 0,
        return_token_ids=read_bool(body, "return_token_ids"),
        model=read_model(body.get("model")),
    )


def resolve(job: Job, limits: Limits) -> Job:
    """Check the job against the serving ledger's limits and fill chat's default max_tokens."""
    if job.model is not None and job.model != limits.model_name:
        raise ApiError(404, f"The model `{job.model}` does not exist.", "model")
    _check_vocab(job.prompt_token_ids, limits.vocab_size, job.prompt_param)
    _check_vocab(job.stop_token_ids, limits.vocab_size, "stop_token_ids")
    num_prompt = len(job.prompt_token_ids)
    if num_prompt >= limits.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, your "
            f"request has {num_prompt} input tokens, which leaves no room for output. Please "
            "reduce the length of the input.",
            job.prompt_param,
        )
    max_tokens = job.max_tokens if job.max_tokens is not None else limits.max_model_len - num_prompt
    if num_prompt + max_tokens > limits.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
            f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.",
            job.max_tokens_param,
        )
    if job.min_tokens > max_tokens:
        raise bad_request(
            f"'min_tokens' ({job.min_tokens}) must not exceed max_tokens ({max_tokens})",
            "min_tokens",
        )
    return dataclasses.replace(job, max_tokens=max_tokens)


def sampling_params(job: Job, eos_token_ids: Sequence[int]) -> SamplingParams:
    """The wire's sampling settings; the first EOS id stops the request, the others join stops."""
    stop_ids = list(job.stop_token_ids)
    eos = None
    if not job.ignore_eos and eos_token_ids:
        eos = eos_token_ids[0]
        stop_ids += [i for i in eos_token_ids[1:] if i not in stop_ids]
    assert job.max_tokens is not None, "resolve() the job first"
    return SamplingParams(
        temperature=job.temperature,
        top_p=job.top_p,
        top_k=job.top_k,
        seed=job.seed,
        max_tokens=job.max_tokens,
        min_tokens=job.min_tokens,
        stop_token_ids=stop_ids or None,
        eos_token_id=eos,
    )


# --- prompts ------------------------------------------------------------------------------------


def _prompt_token_ids(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one, as the OpenAI client sends it
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise bad_request(
            f"only one prompt per request is supported, got {len(prompt)}; send them separately",
            "prompt",
        )
    elif isinstance(prompt, list):
        ids = read_token_ids(prompt, "prompt")
    else:
        raise bad_request(
            f"'prompt' must be a string or a list of token ids, got {type_name(prompt)}", "prompt"
        )
    if not ids:
        raise bad_request("'prompt' must not be empty", "prompt")
    return ids


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", "messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise bad_request(f"'{where}' must be an object with 'role' and 'content'", where)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(
            f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {short(role)}",
            f"{where}.role",
        )
    out = {"role": role, "content": _content(message.get("content"), f"{where}.content")}
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _content(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or a list of text parts", where)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise bad_request(
                f"'{where}[{i}]': only text content parts are supported", f"{where}[{i}]"
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(f"'{where}[{i}].text' must be a string", f"{where}[{i}].text")
        texts.append(part["text"])
    return "\n".join(texts)


def _check_vocab(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((i for i in ids if i >= vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"token id {bad} in '{param}' is out of the vocabulary (ids 0..{vocab_size - 1})", param
        )
