"""POST /v1/responses as vLLM 0.33 serves it for a generate model, and GET /v1/responses/{id}.

The request becomes one chat generation: `instructions` a system message, `input` text or items
(messages, function calls and their outputs) the conversation, rendered by the chat template
with the request's tools; `text.format` and a forced `tool_choice` constrain the output through
the structured outputs. The answer is vLLM's response object, whole or as its stream of events
(response.created, response.in_progress, per output item its added / delta / done events,
response.completed or response.incomplete), with the same fields, ids and usage.

`store` and `previous_response_id` work with --enable-responses-store: the response and the
conversation that led to it are kept in Redis for --responses-store-ttl-s, so any gateway of
the deployment continues it (vLLM keeps them in one process's memory behind
VLLM_ENABLE_RESPONSES_API_STORE). Without the flag they are refused by name.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from opentelemetry.trace import SpanKind

from gateway.chat import read_chat_prompt
from gateway.fields import (
    ApiError,
    bad_request,
    read_bool,
    read_int,
    short,
    type_name,
)
from gateway.generate import client_gone, read_body
from gateway.inflight import Delta, Generation, GenerationError
from gateway.logprobs import MAX_LOGPROBS, LogprobFields, LogprobsFormatter
from gateway.protocol import Job, job_from_body, parse_json, resolve
from gateway.state import GATEWAY, Gateway
from gateway.support import RESPONSES_FIELDS, check_fields, works
from gateway.tool_parsers import ToolStream
from gateway.tools import (
    ToolRequest,
    ToolSettings,
    answer,
    read_tools,
    tool_constraint,
    tool_stream,
)
from observability import Attr, get_logger
from services.tokenization.tokenizer import ChatTemplateError, Tokenizer
from services.transport.keys import stored_response
from services.wire import codec
from services.wire.messages import StoredResponse

log = get_logger("gateway.responses")

LOGPROBS_INCLUDE = "message.output_text.logprobs"
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
MAX_METADATA = 16
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# Fields the sampling reads under the chat endpoint's names.
_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "priority",
    "cache_salt", "user", "session_id", "skip_special_tokens", "include_stop_str_in_output",
    "stream", "structured_outputs", "model",
)  # fmt: skip


def random_id(prefix: str) -> str:
    """vLLM's ids: a prefix and 16 hex digits (its random_uuid)."""
    return f"{prefix}{uuid.uuid4().int & (2**64 - 1):016x}"


@dataclass(frozen=True, slots=True)
class ResponsesCall:
    """One /v1/responses request, parsed: the generation and what the response repeats."""

    job: Job
    response_id: str
    echo: dict[str, Any]  # request fields the response object repeats
    messages: list[dict[str, Any]]  # the conversation rendered (kept for previous_response_id)
    store: bool
    logprobs: bool  # include: message.output_text.logprobs


# --- the request ---------------------------------------------------------------------------------


def parse_responses(
    body: dict[str, Any],
    tokenizer: Tokenizer,
    settings: ToolSettings,
    store_enabled: bool,
    previous: StoredResponse | None = None,
) -> ResponsesCall:
    table = RESPONSES_FIELDS
    if store_enabled:
        table = RESPONSES_FIELDS | {
            "store": works("kept in Redis for --responses-store-ttl-s (default true)"),
            "previous_response_id": works("continues a stored response"),
        }
    check_fields(body, table)
    if body.get("input") is None:
        raise bad_request("'input' is required", "input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request(
            f"'instructions' must be a string, got {type_name(instructions)}", "instructions"
        )
    messages, continued = _conversation(body["input"], instructions, previous)
    chat_body: dict[str, Any] = {
        "tools": _chat_tools(body.get("tools")),
        "tool_choice": _chat_tool_choice(body.get("tool_choice")),
        "parallel_tool_calls": body.get("parallel_tool_calls"),
        "structured_outputs": body.get("structured_outputs"),
    }
    if not chat_body["tools"]:
        chat_body["tools"] = None
        if chat_body["tool_choice"] in ("auto", "none"):
            chat_body["tool_choice"] = None  # vLLM: the default, and "none" without tools
    tools = read_tools(chat_body, settings, refuse_unread=False)
    chat = read_chat_prompt(
        {"messages": messages, "add_generation_prompt": not continued,
         "continue_final_message": continued,
         "chat_template_kwargs": body.get("chat_template_kwargs")},
        tools.tools if tools is not None else None,
    )  # fmt: skip
    try:
        prompt_ids = tokenizer.apply_chat_template(chat.messages, chat.options)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "input") from None
    include_logprobs, top = _logprobs(body)
    job_body = {k: body[k] for k in _SAMPLING_FIELDS if k in body}
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        if body.get("structured_outputs") is not None:
            raise bad_request(
                "Cannot specify both structured_outputs and text.format", "structured_outputs"
            )
        job_body["response_format"] = response_format
    if _truncation(body) == "auto":
        job_body["truncate_prompt_tokens"] = -1
    max_tokens = read_int(body, "max_output_tokens", lo=1)
    job = job_from_body(job_body, "chat", prompt_ids, "input", max_tokens, tokenizer)
    job = dataclasses.replace(
        job,
        max_tokens_param="max_output_tokens",
        cap_max_tokens=True,
        tools=tools,
        logprobs=LogprobFields(logprobs=top if include_logprobs else None, num_shown=top),
    )
    if tools is not None and tools.reads_calls:
        job = dataclasses.replace(job, skip_special_tokens=False)
        constraint = tool_constraint(tools, settings)
        if constraint is not None:
            job = dataclasses.replace(job, structured=constraint)
    request_id = body.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise bad_request(f"'request_id' must be a string, got {type_name(request_id)}",
                          "request_id")  # fmt: skip
    # Stored unless store is false, as vLLM's and OpenAI's default (a plain create can be
    # continued with previous_response_id).
    store = read_bool(body, "store", default=True) if store_enabled else False
    return ResponsesCall(
        job=job,
        response_id=request_id or random_id("resp_"),
        echo=_echo(body, tools),
        messages=messages,
        store=store,
        logprobs=include_logprobs,
    )


def _conversation(
    value: Any, instructions: str | None, previous: StoredResponse | None
) -> tuple[list[dict[str, Any]], bool]:
    """vLLM's construct_input_messages: instructions, the stored conversation (its system
    messages dropped) and the previous answer's text, then the input. True when the input ends
    with an unfinished assistant message, which the model continues."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if previous is not None:
        messages += [m for m in previous.messages if m.get("role") != "system"]
        for item in previous.response.get("output", []):
            if item.get("type") == "message":
                messages += [{"role": "assistant", "content": part.get("text", "")}
                             for part in item.get("content", [])]  # fmt: skip
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}], False
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty list of items", "input")
    for i, item in enumerate(value):
        _add_item(messages, item, f"input[{i}]")
    last = value[-1]
    continued = (
        isinstance(last, dict)
        and last.get("type", "message") == "message"
        and last.get("role") == "assistant"
        and last.get("status") in ("in_progress", "incomplete")
    )
    return messages, continued


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise bad_request(f"'{where}' must be an object", where)
    kind = item.get("type", "message")
    previous = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    if kind == "function_call":
        name, arguments, call_id = (item.get(k) for k in ("name", "arguments", "call_id"))
        if not all(isinstance(v, str) for v in (name, arguments, call_id)):
            raise bad_request(f"'{where}' needs string 'name', 'arguments' and 'call_id'", where)
        call = {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}  # fmt: skip
        if previous is not None:  # calls after an assistant message join it, as vLLM
            previous.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return
    if kind == "function_call_output":
        output, call_id = item.get("output"), item.get("call_id")
        if not isinstance(call_id, str) or not isinstance(output, str | list):
            raise bad_request(f"'{where}' needs a string 'call_id' and an 'output'", where)
        messages.append({"role": "tool", "tool_call_id": call_id,
                         "content": _text(output, f"{where}.output")})  # fmt: skip
        return
    if kind != "message":
        raise bad_request(
            f"'{where}.type' {short(kind)} is not supported by kvledger: input items are "
            "messages, function_call and function_call_output",
            f"{where}.type",
        )
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise bad_request(
            f"'{where}.role' must be user, system, developer or assistant, got {short(role)}",
            f"{where}.role",
        )
    text = _text(item.get("content"), f"{where}.content")
    if role == "assistant" and previous is not None and previous.get("content") is None:
        previous["content"] = text
        return
    messages.append({"role": role, "content": text})


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or its input_text / output_text parts (other parts, such as
    images, are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or a list of text parts", where)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
            raise bad_request(
                f"'{where}[{i}]': only input_text and output_text parts are supported",
                f"{where}[{i}]",
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(f"'{where}[{i}].text' must be a string", f"{where}[{i}].text")
        texts.append(part["text"])
    return "\n".join(texts)


def _chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The Responses API's flat function tools as chat's {"type", "function"}."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request(f"'tools' must be a list of tools, got {type_name(tools)}", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise bad_request(
                f"'tools[{i}].type' {short(kind)} is not supported by kvledger: only function "
                "tools are served (no built-in tools)",
                f"tools[{i}].type",
            )
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request(
        f"'tool_choice' {short(choice)} is not supported by kvledger: use none, auto, required "
        'or {"type": "function", "name": ...}',
        "tool_choice",
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as the chat endpoint's response_format."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request(f"'text' must be an object, got {type_name(text)}", "text")
    for key in text:
        if key not in ("format", "verbosity"):
            raise bad_request(f"unknown field 'text.{key}'", f"text.{key}")
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("'text.verbosity' is not supported by kvledger", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request(
            "'text.format.type' must be text, json_object or json_schema", "text.format.type"
        )
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("'text.format.schema' must be a JSON schema object",
                              "text.format.schema")  # fmt: skip
        return {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}
    return {"type": fmt["type"]}


def _logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list):
            raise bad_request("'include' must be a list", "include")
        for value in include:
            if value != LOGPROBS_INCLUDE:
                raise bad_request(
                    f"'include' value {short(value)} is not supported by kvledger: only "
                    f"{LOGPROBS_INCLUDE}",
                    "include",
                )
    top = read_int(body, "top_logprobs", lo=0, hi=MAX_LOGPROBS) or 0
    return bool(include), top


def _truncation(body: dict[str, Any]) -> str:
    value = body.get("truncation")
    if value not in (None, "auto", "disabled"):
        raise bad_request(f"'truncation' must be auto or disabled, got {short(value)}",
                          "truncation")  # fmt: skip
    return value or "disabled"


def _echo(body: dict[str, Any], tools: ToolRequest | None) -> dict[str, Any]:
    """What vLLM's response object repeats from the request (checked here)."""
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and len(metadata) <= MAX_METADATA
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):  # fmt: skip
        raise bad_request(f"'metadata' must be at most {MAX_METADATA} string pairs", "metadata")
    tier = body.get("service_tier") or "auto"
    if tier not in SERVICE_TIERS:
        raise bad_request(f"'service_tier' must be one of {', '.join(SERVICE_TIERS)}",
                          "service_tier")  # fmt: skip
    parallel = body.get("parallel_tool_calls")
    return {
        "instructions": body.get("instructions"),
        "metadata": metadata,
        "parallel_tool_calls": True if parallel is None else parallel,
        "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
        "tools": copy.deepcopy(body.get("tools") or []),
        "previous_response_id": body.get("previous_response_id"),
        "prompt_cache_options": body.get("prompt_cache_options"),
        "prompt_cache_key": body.get("prompt_cache_key"),
        "prompt_cache_retention": body.get("prompt_cache_retention"),
        "safety_identifier": body.get("safety_identifier"),
        "service_tier": tier,
        "text": body.get("text"),
        "truncation": _truncation(body),
        "user": body.get("user"),
    }


# --- the response object -------------------------------------------------------------------------


def response_body(
    call: ResponsesCall,
    gen: Generation,
    model: str,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    with_usage: bool,
) -> dict[str, Any]:
    """vLLM's ResponsesResponse, every field as it writes them."""
    sampling, echo = gen.sampling, call.echo
    return {
        "id": call.response_id,
        "created_at": created_at,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": echo["instructions"],
        "metadata": echo["metadata"],
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": echo["parallel_tool_calls"],
        "temperature": sampling.temperature,
        "tool_choice": echo["tool_choice"],
        "tools": echo["tools"],
        "top_p": sampling.top_p,
        "background": False,
        "max_output_tokens": sampling.max_tokens,
        "max_tool_calls": None,
        "previous_response_id": echo["previous_response_id"],
        "prompt": None,
        "prompt_cache_options": echo["prompt_cache_options"],
        "prompt_cache_key": echo["prompt_cache_key"],
        "prompt_cache_retention": echo["prompt_cache_retention"],
        "reasoning": None,
        "safety_identifier": echo["safety_identifier"],
        "service_tier": echo["service_tier"],
        "status": status,
        "text": echo["text"],
        "top_logprobs": sampling.logprobs,
        "truncation": echo["truncation"],
        "usage": usage_body(gen) if with_usage else None,
        "user": echo["user"],
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


def usage_body(gen: Generation) -> dict[str, Any]:
    """vLLM's ResponseUsage of a single-turn generation (cached tokens: the prefix-cache hit)."""
    usage = gen.usage()
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cached_tokens, "cache_write_tokens": 0,
            "input_tokens_per_turn": [], "cached_tokens_per_turn": [],
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }  # fmt: skip


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def _text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def _message_item(item_id: str, parts: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"id": item_id, "content": parts, "role": "assistant", "status": status,
            "type": "message", "phase": None}  # fmt: skip


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {"arguments": arguments, "call_id": call_id, "name": name, "type": "function_call",
            "id": item_id, "namespace": None, "status": status}  # fmt: skip


def output_items(
    gen: Generation, text: str, logprobs: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """A whole output as vLLM's items: with a tool-call parser configured, a message when there
    is text and one function_call item per call (the last one's status is the output's);
    without one, a single message."""
    finish = gen.finish_reason
    settings: ToolSettings = gen.gw.tool_settings
    if settings.parser is None:
        parts = [_text_part(text, logprobs)] if text else []
        return [_message_item(random_id("msg_"), parts, _status(finish))]
    request = gen.job.tools
    content, calls = text, []
    if request is not None:
        read = answer(request, settings, text, finish or "stop")
        content, calls = read.content or "", read.tool_calls
    items = []
    if content:
        status = "completed" if calls else _status(finish)
        items.append(_message_item(random_id("msg_"), [_text_part(content, logprobs)], status))
    for i, call in enumerate(calls):
        status = _status(finish) if i == len(calls) - 1 else "completed"
        function = call["function"]
        items.append(_call_item(random_id("fc_"), call["id"], function["name"],
                                function["arguments"], status))  # fmt: skip
    return items


# --- the stream ----------------------------------------------------------------------------------


class EventStream:
    """vLLM's event sequence for one generation: an item opens when its first delta comes
    (a message for text, a function_call per call), receives deltas, and is closed (done
    events) when another opens or the output ends. sequence_number counts every event."""

    def __init__(self, formatter: LogprobsFormatter | None) -> None:
        self.sequence = 0
        self.formatter = formatter  # include's logprobs
        self.items: list[dict[str, Any]] = []  # every item closed so far
        self.state: str | None = None  # "content", "call" or None
        self.item_id = ""
        self.text = ""
        self.logprobs: list[dict[str, Any]] = []  # the open message's, for its done events
        self.call: tuple[str, str] = ("", "")  # (call id, name) of the open call

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        body = {**fields, "sequence_number": self.sequence, "type": kind}
        self.sequence += 1
        return body

    def content(self, delta: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events = []
        if self.state != "content":
            events += self.close("completed")
            self.state, self.item_id, self.text = "content", random_id("msg_"), ""
            self.logprobs = []
            events.append(self.event("response.output_item.added",
                                     item=_message_item(self.item_id, [], "in_progress"),
                                     output_index=len(self.items)))  # fmt: skip
            events.append(self.event("response.content_part.added", content_index=0,
                                     item_id=self.item_id, output_index=len(self.items),
                                     part=_text_part("", [])))  # fmt: skip
        self.text += delta
        self.logprobs += logprobs
        events.append(self.event("response.output_text.delta", content_index=0, delta=delta,
                                 item_id=self.item_id,
                                 logprobs=[_without_bytes(entry) for entry in logprobs],
                                 output_index=len(self.items)))  # fmt: skip
        return events

    def tool_call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        function = delta["function"]
        if "id" in delta:  # a new call
            events += self.close("completed")
            self.state, self.item_id, self.text = "call", random_id("fc_"), ""
            self.call = (delta["id"], function["name"])
            item = _call_item(self.item_id, delta["id"], function["name"], "", "in_progress")
            events.append(self.event("response.output_item.added", item=item,
                                     output_index=len(self.items)))  # fmt: skip
        if function.get("arguments"):
            self.text += function["arguments"]
            events.append(self.event("response.function_call_arguments.delta",
                                     delta=function["arguments"], item_id=self.item_id,
                                     output_index=len(self.items)))  # fmt: skip
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """The open item's done events (none open: none)."""
        index = len(self.items)
        if self.state == "content":
            # The done part carries the message's logprobs, bytes kept; the text's done event
            # none (vLLM's).
            part = _text_part(self.text, self.logprobs or None)
            item = _message_item(self.item_id, [part], status)
            events = [
                self.event("response.output_text.done", content_index=0, item_id=self.item_id,
                           logprobs=[], output_index=index, text=self.text),
                self.event("response.content_part.done", content_index=0, item_id=self.item_id,
                           output_index=index, part=part),
            ]  # fmt: skip
        elif self.state == "call":
            call_id, name = self.call
            item = _call_item(self.item_id, call_id, name, self.text, status)
            events = [self.event("response.function_call_arguments.done", arguments=self.text,
                                 item_id=self.item_id, output_index=index, name=name)]  # fmt: skip
        else:
            return []
        events.append(self.event("response.output_item.done", item=item, output_index=index))
        self.items.append(item)
        self.state = None
        return events


def sse_event(body: dict[str, Any]) -> bytes:
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return f"event: {body['type']}\ndata: {data}\n\n".encode()


# --- the handlers --------------------------------------------------------------------------------


async def create_response(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    attributes = {
        Attr.HTTP_REQUEST_METHOD: request.method,
        Attr.URL_PATH: request.path,
        Attr.GEN_AI_OPERATION_NAME: "chat",
    }
    with gw.tracer.start_as_current_span(
        f"{request.method} {request.path}", kind=SpanKind.SERVER, attributes=attributes,
        record_exception=False, set_status_on_exception=False,
    ) as span:  # fmt: skip
        try:
            response = await _create(request, gw)
        except ApiError as exc:
            span.set_attribute(Attr.HTTP_RESPONSE_STATUS_CODE, exc.status)
            raise
        span.set_attribute(Attr.HTTP_RESPONSE_STATUS_CODE, response.status)
        return response


async def _create(request: web.Request, gw: Gateway) -> web.StreamResponse:
    arrival = time.monotonic()
    gw.refuse_when_full()  # before reading: a full gateway answers a burst at once
    body = parse_json(await read_body(request, gw.config.body_timeout_s))
    enabled = gw.config.enable_responses_store
    previous = None
    if enabled and isinstance(body.get("previous_response_id"), str):
        previous = await load_response(gw, body["previous_response_id"])
    async with gw.admit(), gw.setting_up() as set_up:
        call = await asyncio.to_thread(
            parse_responses, body, gw.tokenizer, gw.tool_settings, enabled, previous
        )
        limits = gw.limits(await gw.wait_for_ledger())
        job = resolve(call.job, limits)
        created_at = int(time.time())
        gone = lambda: client_gone(request)  # noqa: E731
        async with Generation(gw, job, gone, arrival, call.response_id) as gen:
            set_up()  # on the stream: the next request's turn
            if job.stream:
                return await _stream(request, gw, call, gen, limits.model_name, created_at)
            text = "".join([delta.text async for delta in gen.deltas()])
            output = output_items(gen, text, _whole_logprobs(call, gen))
            answer_body = response_body(
                call, gen, limits.model_name, created_at, _status(gen.finish_reason), output, True
            )
    await _keep(gw, call, answer_body)
    return web.json_response(answer_body)


def _whole_logprobs(call: ResponsesCall, gen: Generation) -> list[dict[str, Any]] | None:
    if not call.logprobs:
        return None
    formatter = LogprobsFormatter(gen.gw.tokenizer, gen.job.logprobs)
    return formatter.chat(gen.tracker.token_ids, gen.tracker.logprobs)["content"]


async def _stream(
    request: web.Request,
    gw: Gateway,
    call: ResponsesCall,
    gen: Generation,
    model: str,
    created_at: int,
) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    formatter = LogprobsFormatter(gw.tokenizer, gen.job.logprobs) if call.logprobs else None
    events = EventStream(formatter)
    tools: ToolStream | None = None
    if gen.job.tools is not None:
        tools = tool_stream(gen.job.tools, gw.tool_settings)
    start = response_body(call, gen, model, created_at, "in_progress", [], False)
    try:
        for kind in ("response.created", "response.in_progress"):
            await response.write(sse_event(events.event(kind, response=start)))
        async for delta in gen.deltas():
            for body in _delta_events(events, tools, delta):
                await response.write(sse_event(body))
        status = _status(gen.finish_reason)
        for body in events.close(status):
            await response.write(sse_event(body))
        final = response_body(call, gen, model, created_at, status, events.items, True)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        await response.write(sse_event(events.event(kind, response=final)))
        await _keep(gw, call, final)
    except GenerationError as exc:  # headers are gone: the error travels as an event
        body = events.event("error", code=str(exc.status), message=exc.message, param=None)
        await response.write(sse_event(body))
    except ConnectionError:
        pass
    return response


def _delta_events(
    events: EventStream, tools: ToolStream | None, delta: Delta
) -> list[dict[str, Any]]:
    logprobs: list[dict[str, Any]] = []
    if events.formatter is not None and delta.logprobs:
        logprobs = events.formatter.chat(delta.token_ids, delta.logprobs)["content"]
    if tools is None:
        return events.content(delta.text, logprobs) if delta.text else []
    content, calls = tools.push(delta.text)
    out = events.content(content, logprobs) if content else []
    for call in calls:
        out += events.tool_call(call)
    return out


def _without_bytes(entry: dict[str, Any]) -> dict[str, Any]:
    """A delta event's logprob as vLLM streams it: openai's event model has no `bytes`, at
    either level (the whole response's output_text keeps them)."""
    out = {k: v for k, v in entry.items() if k != "bytes"}
    if "top_logprobs" in out:
        out["top_logprobs"] = [_without_bytes(top) for top in out["top_logprobs"]]
    return out


# --- the store -----------------------------------------------------------------------------------


async def _keep(gw: Gateway, call: ResponsesCall, body: dict[str, Any]) -> None:
    if not call.store:
        return
    stored = StoredResponse(response=body, messages=call.messages)
    key = stored_response(gw.streams.prefix, call.response_id)
    ttl_ms = max(1, int(gw.config.responses_store_ttl_s * 1000))
    await gw.redis.set(key, codec.encode(stored), px=ttl_ms)


async def load_response(gw: Gateway, response_id: str) -> StoredResponse:
    """A stored response, or vLLM's 404 naming it."""
    raw = await gw.redis.get(stored_response(gw.streams.prefix, response_id))
    if raw is None:
        raise ApiError(404, f"Response with id '{response_id}' not found.", "response_id",
                       err_type="invalid_request_error")  # fmt: skip
    return codec.decode(raw if isinstance(raw, bytes) else raw.encode(), StoredResponse)


async def retrieve_response(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    response_id = request.match_info["response_id"]
    if not gw.config.enable_responses_store:
        raise ApiError(404, f"Response with id '{response_id}' not found.", "response_id",
                       err_type="invalid_request_error")  # fmt: skip
    return web.json_response((await load_response(gw, response_id)).response)


def add_responses_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
