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

from gateway.chat import RESPONSE_ROLE, read_chat_prompt
from gateway.fields import (
    INT64_MAX,
    INT64_MIN,
    bad_request,
    read_bool,
    read_cache_salt,
    read_int,
    read_model,
    read_number,
    read_stop,
    read_str,
    read_stream_options,
    read_token_ids,
    unknown_model,
)
from gateway.logits_fields import LogitsFields, read_logits_fields
from gateway.logprobs import LogprobFields, read_chat_logprobs, read_completion_logprobs
from gateway.prompts import check_num_sequences, read_best_of, read_n, read_prompts
from gateway.structured import read_structured
from gateway.support import CHAT_FIELDS, COMPLETION_FIELDS, STREAM_OPTIONS_FIELDS, check_fields
from gateway.tools import ToolRequest, ToolSettings, read_tools, tool_constraint
from services.tokenization.tokenizer import ChatTemplateError, Tokenizer
from services.wire.messages import (
    SamplingParams,
    StructuredOutput,
    is_greedy,
    normalized_temperature,
)


@dataclass(frozen=True, slots=True)
class Limits:
    """What the serving ledger allows (or the gateway's config when no status names it)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    scheduling_policy: str = "fcfs"


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
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    stream_interval: int = 1
    cache_salt: str | None = None
    priority: int = 0
    return_token_ids: bool = False
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    echo_text: str | None = None  # shown before the output (echo); None: no echo
    echo_only: bool = False  # completions' echo with max_tokens 0: the prompt alone is answered
    role: str = RESPONSE_ROLE  # chat: the answer's role
    prompt_text: str | None = None  # chat's return_prompt_text: the rendered prompt
    request_id: str | None = None  # the client's id (response id cmpl-<request_id>)
    user: str | None = None  # recorded only, as vLLM
    session_id: str | None = None  # recorded only, as vLLM
    logits: LogitsFields = field(default_factory=LogitsFields)  # penalties, bias, masks
    logprobs: LogprobFields = field(default_factory=LogprobFields)
    n: int = 1  # choices returned per prompt
    best_of: int | None = None  # completions: samples drawn per prompt, the best n returned
    prompt_index: int = 0  # which prompt of a batch (completions)
    structured: StructuredOutput | None = None  # response_format / structured_outputs, compiled
    tools: ToolRequest | None = None  # chat's tools and tool_choice
    cap_max_tokens: bool = False  # a max_tokens past the context is capped (Responses), not refused


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", None) from None
    except RecursionError:
        raise bad_request("the request body is not valid JSON: nested too deeply", None) from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None)
    where = _unencodable(body, "")
    if where is not None:
        # A JSON escape such as "\ud800" decodes to a lone surrogate, which no tokenizer encodes.
        raise bad_request(
            f"'{where}' holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape); "
            "text must be valid Unicode",
            where or None,
        )
    return body


def _unencodable(value: Any, where: str) -> str | None:
    """The path of the first string (key or value) that UTF-8 cannot encode, or None."""
    stack = [(value, where)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                return where
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                name = f"{where}.{key}" if where else str(key)
                try:
                    key.encode()
                except UnicodeEncodeError:
                    return where or "body"
                stack.append((item, name))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]") for i, item in reversed(list(enumerate(value))))
    return None


def _refuse_constant(name: str) -> None:
    # Python's json accepts NaN and Infinity; JSON does not, and neither may a sampling setting.
    raise bad_request(f"the request body is not valid JSON: {name} is not a JSON value", None)


def parse_completion(
    body: dict[str, Any], tokenizer: Tokenizer, default_max_tokens: int
) -> list[Job]:
    """One job per prompt of the batch (a string or token ids, or a list of either)."""
    check_fields(body, COMPLETION_FIELDS)
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("'prompt' is required", "prompt")
    add_special = read_bool(body, "add_special_tokens", default=True)
    prompts = read_prompts(body["prompt"], tokenizer, add_special)
    echo = read_bool(body, "echo")
    max_tokens = read_int(body, "max_tokens", lo=0)
    # Prompt scoring: echo with max_tokens 0 answers the prompt alone (with its logprobs). As
    # vLLM, the ledger samples one token, which the answer leaves out of text and logprobs.
    echo_only = echo and max_tokens == 0
    if max_tokens == 0 and not echo:
        raise bad_request(
            "'max_tokens' must be >= 1, got 0 (0 is for scoring a prompt: with 'echo': true)",
            "max_tokens",
        )
    if echo_only or max_tokens is None:
        max_tokens = 1 if echo_only else default_max_tokens
    job = job_from_body(body, "completion", prompts[0][0], "prompt", max_tokens, tokenizer)
    best_of = read_best_of(body, job.n, job.stream)
    check_num_sequences(len(prompts), job.n, best_of)
    job = dataclasses.replace(
        job,
        logprobs=read_completion_logprobs(body, echo, job.stream),
        best_of=best_of,
        echo_only=echo_only,
    )
    # vLLM echoes no text when it returns token ids: the prompt_token_ids say it.
    return [
        dataclasses.replace(
            job,
            prompt_token_ids=ids,
            echo_text=("" if job.return_token_ids else text) if echo else None,
            prompt_index=i,
        )
        for i, (ids, text) in enumerate(prompts)
    ]


def parse_chat(
    body: dict[str, Any], tokenizer: Tokenizer, tool_settings: ToolSettings | None = None
) -> Job:
    check_fields(body, CHAT_FIELDS)
    settings = tool_settings or ToolSettings()
    tools = read_tools(body, settings)
    chat = read_chat_prompt(body, tools.tools if tools is not None else None)
    try:
        prompt_ids = tokenizer.apply_chat_template(chat.messages, chat.options)
        prompt_text = (
            tokenizer.render_chat(chat.messages, chat.options)
            if read_bool(body, "return_prompt_text")
            else None
        )
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None
    # vLLM's rule: max_completion_tokens (the newer name) wins over max_tokens.
    param = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    job = job_from_body(
        body, "chat", prompt_ids, "messages", read_int(body, param, lo=1), tokenizer
    )
    job = dataclasses.replace(
        job,
        max_tokens_param=param,
        role=chat.role,
        echo_text=chat.echo_text or None,
        prompt_text=prompt_text,
        logprobs=read_chat_logprobs(body, read_bool(body, "echo"), job.stream),
        tools=tools,
    )
    if tools is not None and tools.reads_calls:
        # As vLLM's tool parsers: special tokens stay in the text (tool-call markers are special
        # in many vocabularies); a forced choice's schema replaces any other constraint.
        job = dataclasses.replace(job, skip_special_tokens=False)
        constraint = tool_constraint(tools, settings)
        if constraint is not None:
            job = dataclasses.replace(job, structured=constraint)
    return job


def job_from_body(
    body: dict[str, Any],
    kind: str,
    prompt_ids: list[int],
    prompt_param: str,
    max_tokens: int | None,
    tokenizer: Tokenizer,
) -> Job:
    stream = read_bool(body, "stream")
    options = body.get("stream_options")
    if isinstance(options, dict):
        check_fields(options, STREAM_OPTIONS_FIELDS, "stream_options.")
    include_usage, continuous_usage = read_stream_options(options, stream)
    top_k = read_int(body, "top_k", lo=-1, hi=INT64_MAX)
    temperature = normalized_temperature(read_number(body, "temperature", 0.0, 2.0, default=1.0))
    truncation_side = body.get("truncation_side") or "left"
    if truncation_side not in ("left", "right"):
        raise bad_request("`truncation_side` must be either 'left' or 'right'.", "truncation_side")
    return Job(
        kind=kind,
        prompt_token_ids=prompt_ids,
        prompt_param=prompt_param,
        max_tokens=max_tokens,
        min_tokens=read_int(body, "min_tokens", lo=0) or 0,
        temperature=temperature,
        top_p=read_number(body, "top_p", 0.0, 1.0, default=1.0, lo_open=True),
        top_k=0 if top_k in (None, -1) else top_k,
        seed=_seed(body),
        stop=read_stop(body.get("stop")),
        stop_token_ids=read_token_ids(body.get("stop_token_ids"), "stop_token_ids"),
        include_stop_str_in_output=read_bool(body, "include_stop_str_in_output"),
        ignore_eos=read_bool(body, "ignore_eos"),
        skip_special_tokens=read_bool(body, "skip_special_tokens", default=True),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        stream_interval=read_int(body, "stream_interval", lo=1) or 1,
        cache_salt=read_cache_salt(body.get("cache_salt")),
        priority=read_int(body, "priority", lo=INT64_MIN, hi=INT64_MAX) or 0,
        return_token_ids=read_bool(body, "return_token_ids"),
        model=read_model(body.get("model")),
        truncate_prompt_tokens=read_int(body, "truncate_prompt_tokens", lo=-1, hi=INT64_MAX),
        truncation_side=truncation_side,
        request_id=read_str(body, "request_id"),
        user=read_str(body, "user"),
        session_id=read_str(body, "session_id"),
        logits=read_logits_fields(body, tokenizer),
        n=read_n(body),
        structured=read_structured(body),
    )


def _seed(body: dict[str, Any]) -> int | None:
    seed = read_int(body, "seed", lo=INT64_MIN, hi=INT64_MAX)
    return None if seed == -1 else seed  # vLLM: -1 means unseeded


def resolve(job: Job, limits: Limits) -> Job:
    """Check the job against the serving ledger's limits, truncate its prompt when asked, and
    fill chat's default max_tokens."""
    if job.model is not None and job.model != limits.model_name:
        raise unknown_model(job.model, limits.model_name)
    if job.priority != 0 and limits.scheduling_policy != "priority":
        raise bad_request(
            f"Got priority {job.priority} but priority scheduling is not enabled: the ledger "
            f"runs --scheduling-policy {limits.scheduling_policy}. Send priority 0, or start "
            "the ledger with --scheduling-policy priority.",
            "priority",
        )
    job = _truncate(job, limits.max_model_len)
    _check_vocab(job.prompt_token_ids, limits.vocab_size, job.prompt_param)
    _check_vocab(job.stop_token_ids, limits.vocab_size, "stop_token_ids")
    for param, ids in job.logits.token_ids_to_check():
        _check_vocab(ids, limits.vocab_size, param)
    job = dataclasses.replace(job, logprobs=job.logprobs.resolved(limits.vocab_size))
    num_prompt = len(job.prompt_token_ids)
    if num_prompt >= limits.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, your "
            f"request has {num_prompt} input tokens, which leaves no room for output. Please "
            "reduce the length of the input.",
            job.prompt_param,
        )
    max_tokens = job.max_tokens if job.max_tokens is not None else limits.max_model_len - num_prompt
    if job.cap_max_tokens:
        max_tokens = min(max_tokens, limits.max_model_len - num_prompt)
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


def _truncate(job: Job, max_model_len: int) -> Job:
    """vLLM's truncate_prompt_tokens: keep N prompt tokens (the last ones unless
    truncation_side is 'right'); -1 keeps what leaves room for the output."""
    keep = job.truncate_prompt_tokens
    if keep is None:
        return job
    max_input = max_model_len - (job.max_tokens or 1)
    if keep < 0:
        keep = max(max_input, 0)
    elif keep > max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = "
            f"{max_model_len}. Please request a smaller truncation size.",
            "truncate_prompt_tokens",
        )
    ids = job.prompt_token_ids
    if keep >= len(ids):
        return job
    kept = ids[len(ids) - keep :] if job.truncation_side == "left" else ids[:keep]
    if not kept:
        raise bad_request(
            "'truncate_prompt_tokens' leaves an empty prompt", "truncate_prompt_tokens"
        )
    return dataclasses.replace(job, prompt_token_ids=kept)


def sampling_params(job: Job, eos_token_ids: Sequence[int]) -> SamplingParams:
    """The wire's sampling settings; the first EOS id stops the request, the others join stops."""
    stop_ids = list(job.stop_token_ids)
    eos = None
    if not job.ignore_eos and eos_token_ids:
        eos = eos_token_ids[0]
        stop_ids += [i for i in eos_token_ids[1:] if i not in stop_ids]
    assert job.max_tokens is not None, "resolve() the job first"
    greedy = is_greedy(job.temperature)  # vLLM: greedy ignores the filters
    logits = job.logits
    return SamplingParams(
        temperature=0.0 if greedy else job.temperature,
        top_p=1.0 if greedy else job.top_p,
        top_k=0 if greedy else job.top_k,
        min_p=0.0 if greedy else logits.min_p,
        presence_penalty=logits.presence_penalty,
        frequency_penalty=logits.frequency_penalty,
        repetition_penalty=logits.repetition_penalty,
        logit_bias=logits.logit_bias or None,
        allowed_token_ids=logits.allowed_token_ids,
        bad_words_token_ids=logits.bad_words_token_ids or None,
        logprobs=job.logprobs.logprobs,
        prompt_logprobs=job.logprobs.prompt_logprobs,
        seed=job.seed,
        max_tokens=job.max_tokens,
        min_tokens=job.min_tokens,
        stop_token_ids=stop_ids or None,
        eos_token_id=eos,
        structured=job.structured,
    )


def _check_vocab(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((i for i in ids if i >= vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"token id {bad} in '{param}' is out of the vocabulary (ids 0..{vocab_size - 1})", param
        )


def fan_out(jobs: list[Job]) -> list[Job]:
    """One job per sequence, as vLLM's parallel sampling: sample i of a prompt gets seed + i
    (unseeded ones get their own seed from the ledger). Choices are indexed prompt by prompt.
    best_of's samples compute their logprobs to be ranked, shown only when asked."""
    children = []
    for job in jobs:
        count = job.best_of or job.n
        if job.best_of is not None and job.logprobs.logprobs is None:
            job = dataclasses.replace(
                job, logprobs=dataclasses.replace(job.logprobs, logprobs=0, hidden=True)
            )
        for i in range(count):
            seed = None if job.seed is None else job.seed + i
            children.append(dataclasses.replace(job, seed=seed))
    return children
