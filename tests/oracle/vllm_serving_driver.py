"""Runs inside vLLM 0.33's venv: vLLM's own OpenAI serving code (the completion and chat
generators of `vllm serve`, streaming and not) answers engine outputs a test describes, so the
test can compare kvledger's answer to the same outputs with vLLM's, field by field.

The serving objects are made without their engine (nothing here runs a model): only the settings
the generators read are set, as `vllm serve` sets them by default, plus
--enable-prompt-tokens-details (kvledger always reports cached tokens) and, for tool calls,
--enable-auto-tool-choice --tool-call-parser NAME with the case's tokenizer folder.

Usage: python vllm_serving_driver.py IN.json OUT.json, where IN is {"cases": [case, ...]} and a
case is {"name", "kind": "completion" | "chat" | "responses" | "error", "request": the body sent
(for "error": what `error_body` reads),
"prompt": its text, "default_max_tokens" (responses: what the context leaves),
"prompt_token_ids", "prompt_logprobs" (None or vLLM's list: None first, then
{token id: {"logprob", "rank", "decoded_token"}} per position), "num_cached_tokens",
"steps": [{"index", "text", "token_ids",
"finish_reason", "stop_reason", "logprobs" (one entry per token, as prompt_logprobs')}, ...],
optional "tool_parser" and "tokenizer" (a folder, or "bytes" for kvledger's byte tokenizer)}.
A whole completion of several prompts has "batch": [{"prompt", "prompt_token_ids",
"prompt_logprobs", "steps"}, ...] instead, one per prompt.
Each step is one engine output of one choice (the streamed deltas); a whole answer gets every
choice's steps joined. OUT is {"results": [{"name", "bodies": [...]} or {"name", "error"}]}.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from collections.abc import AsyncIterator
from typing import Any

# tool_choice "required" and named read as JSON (the tools' schema constrains the output), as
# kvledger does; vLLM's default constrains hermes and llama3_json calls with structural tags
# in their own format instead (set before vLLM's tool parsers are imported).
os.environ["VLLM_ENFORCE_STRICT_TOOL_CALLING"] = "0"

from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput

MODEL = "served-model"
DEFAULTS = {  # what OpenAIServing*'s __init__ sets from `vllm serve`'s default flags
    "enable_force_include_usage": False,
    "system_fingerprint": None,
    "enable_log_outputs": False,
    "enable_log_deltas": True,
    "request_logger": None,
    "enable_prompt_tokens_details": True,  # --enable-prompt-tokens-details
    "enable_per_request_metrics": False,
    "return_tokens_as_token_ids": False,
    "default_chat_template_kwargs": {},
    "model_config": None,
}


def serving(cls: type, **settings: Any) -> Any:
    server = object.__new__(cls)  # no engine: the generators only read these settings
    server.__dict__.update(DEFAULTS | settings)
    return server


def output(case: dict[str, Any], steps: list[dict[str, Any]], finished: bool) -> RequestOutput:
    outputs = [
        CompletionOutput(
            index=step["index"],
            text=step["text"],
            token_ids=step["token_ids"],
            cumulative_logprob=None,
            logprobs=entries(step.get("logprobs")),
            finish_reason=step.get("finish_reason"),
            stop_reason=step.get("stop_reason"),
        )
        for step in steps
    ]
    return RequestOutput(
        request_id="req", prompt=case["prompt"], prompt_token_ids=case["prompt_token_ids"],
        prompt_logprobs=entries(case.get("prompt_logprobs")), outputs=outputs,
        finished=finished,
        num_cached_tokens=case.get("num_cached_tokens", 0),
    )  # fmt: skip


def entries(positions: list[Any] | None) -> list[dict[int, Logprob] | None] | None:
    if positions is None:
        return None
    return [
        None if entry is None else {int(t): Logprob(**info) for t, info in entry.items()}
        for entry in positions
    ]


def joined(case: dict[str, Any]) -> RequestOutput:
    """The whole answer: each choice's steps as one output."""
    by_index: dict[int, dict[str, Any]] = {}
    for step in case["steps"]:
        whole = by_index.setdefault(step["index"], {"index": step["index"], "text": "",
                                                    "token_ids": []})  # fmt: skip
        whole["text"] += step["text"]
        whole["token_ids"] = whole["token_ids"] + step["token_ids"]
        if step.get("logprobs") is not None:
            whole["logprobs"] = whole.get("logprobs", []) + step["logprobs"]
        for key in ("finish_reason", "stop_reason"):
            if step.get(key) is not None:
                whole[key] = step[key]
    return output(case, [by_index[i] for i in sorted(by_index)], finished=True)


async def deltas(case: dict[str, Any]) -> AsyncIterator[RequestOutput]:
    steps = case["steps"]
    for i, step in enumerate(steps):
        yield output(case, [step], finished=i == len(steps) - 1)


def chat_server(case: dict[str, Any]) -> Any:
    settings: dict[str, Any] = {
        "parser_cls": None, "enable_auto_tools": False, "response_role": "assistant",
        "_include_reasoning_tokens_details": False, "exclude_tools_when_tool_choice_none": False,
    }  # fmt: skip
    if case.get("tool_parser"):
        from vllm.parser import ParserManager

        settings["enable_auto_tools"] = True
        settings["parser_cls"] = ParserManager.get_parser(
            tool_parser_name=case["tool_parser"], reasoning_parser_name="",
            enable_auto_tools=True, tool_strict_level=None, model_name=MODEL, is_harmony=False,
            tokenizer=tokenizer_of(case),
        )  # fmt: skip
    return serving(OpenAIServingChat, **settings)


class ByteTokenizer:
    """kvledger's tokenizer of its default model: ids 0..255 are bytes, then <s> and </s>."""

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else ids
        out = bytearray()
        for i in ids:
            if i < 256:
                out.append(i)
            elif not skip_special_tokens:
                out += b"<s>" if i == 256 else b"</s>"
        return out.decode("utf-8", errors="replace")


_TOKENIZERS: dict[str, Any] = {}


def tokenizer_of(case: dict[str, Any]) -> Any:
    """One tokenizer per folder for the whole run: vLLM's get_tokenizer reads the folder's model
    config first and, finding none (a tokenizer folder), retries after a 2 s sleep each time."""
    name = case.get("tokenizer")
    if not name:
        return None
    if name == "bytes":
        return ByteTokenizer()
    if name not in _TOKENIZERS:
        from vllm.tokenizers import get_tokenizer

        _TOKENIZERS[name] = get_tokenizer(name)
    return _TOKENIZERS[name]


async def answer(case: dict[str, Any]) -> list[dict[str, Any]]:
    body, meta = case["request"], RequestResponseMetadata(request_id="req")
    tokenizer = tokenizer_of(case)
    if case["kind"] == "responses":
        return await responses(case)
    if case["kind"] == "error":
        return [error_body(case)]
    if case["kind"] == "completion":
        request = CompletionRequest.model_validate(body)
        server = serving(OpenAIServingCompletion)
        if not body.get("stream"):
            prompts = [case | one for one in case.get("batch", [{}])]
            response = server.request_output_to_completion_response(
                [joined(p) for p in prompts], request, "cmpl-req", 0, MODEL, tokenizer, meta
            )
            return [json.loads(response.model_dump_json())]

        async def indexed() -> AsyncIterator[tuple[int, RequestOutput]]:
            async for res in deltas(case):
                yield 0, res

        stream = server.completion_stream_generator(
            request, [None], indexed(), "cmpl-req", 0, MODEL, 1, tokenizer, meta
        )
        return [event async for event in events(stream)]
    request = ChatCompletionRequest.model_validate(body)
    server = chat_server(case)
    conversation = body["messages"]
    if not body.get("stream"):

        async def whole() -> AsyncIterator[RequestOutput]:
            yield joined(case)

        parser = None
        if server.parser_cls is not None:
            parser = server._make_parser(request, tokenizer, {})
        response = await server.chat_completion_full_generator(
            request, whole(), "chatcmpl-req", MODEL, conversation, tokenizer, meta, parser
        )
        return [json.loads(response.model_dump_json())]
    stream = server.chat_completion_stream_generator(
        request, deltas(case), "chatcmpl-req", MODEL, conversation, tokenizer, meta
    )
    return [event async for event in events(stream)]


def error_body(case: dict[str, Any]) -> dict[str, Any]:
    """vLLM's error body (its create_error_response, which every route answers through) for
    the error the case names: "validation" (a VLLMValidationError naming `param`),
    "unknown_model" (_check_model's 404 for `model`, `served` the served names) or
    "retryable" (a RetryableRequestError: vLLM's 503)."""
    from http import HTTPStatus

    from vllm.entrypoints.serve import create_error_response
    from vllm.exceptions import RetryableRequestError, VLLMValidationError

    error = case["request"]
    if error["error"] == "validation":
        response = create_error_response(
            VLLMValidationError(error["message"], parameter=error["param"])
        )
    elif error["error"] == "unknown_model":
        # _check_model's own words and fields (it needs a served model list to run whole)
        response = create_error_response(
            f"The model `{error['model']}` does not exist. Valid aliases: {error['served']}.",
            err_type="NotFoundError", status_code=HTTPStatus.NOT_FOUND, param="model",
        )  # fmt: skip
    else:
        response = create_error_response(RetryableRequestError(error["message"]))
    return json.loads(response.model_dump_json())


async def responses(case: dict[str, Any]) -> list[Any]:
    """vLLM's Responses API for a generate model (its SimpleContext): the whole response, or
    every stream event, for the case's engine outputs."""
    from vllm.entrypoints.openai.responses.context import SimpleContext
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    body = case["request"]
    request = ResponsesRequest.model_validate(body)
    request.store = False  # vLLM's default: store silently off (kvledger's store is in Redis)
    tokenizer = tokenizer_of(case)
    server = serving(OpenAIServingResponses, use_harmony=False, tool_server=None,
                     enable_store=False, enable_auto_tools=bool(case.get("tool_parser")),
                     parser=chat_server(case).parser_cls)  # fmt: skip
    sampling = request.to_sampling_params(case["default_max_tokens"], {})
    parser = None
    if server.parser is not None:
        parser = server.parser(tokenizer, request.tools, chat_template_kwargs={})
    context = SimpleContext(response_parser=parser)
    meta = RequestResponseMetadata(request_id="req")

    async def outputs() -> AsyncIterator[Any]:
        if body.get("stream"):
            async for res in deltas(case):
                context.append_output(res)
                yield context
        else:
            context.append_output(joined(case))
            yield context

    if not body.get("stream"):
        response = await server.responses_full_generator(
            request, sampling, outputs(), context, MODEL, tokenizer, meta, created_time=0
        )
        return [json.loads(response.model_dump_json(by_alias=True))]
    stream = server.responses_stream_generator(
        request, sampling, outputs(), context, MODEL, tokenizer, meta, created_time=0
    )
    return [json.loads(event.model_dump_json(by_alias=True)) async for event in stream]


async def events(stream: AsyncIterator[str]) -> AsyncIterator[Any]:
    async for raw in stream:
        for line in raw.splitlines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                yield "[DONE]" if data == "[DONE]" else json.loads(data)


def run(case: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"name": case["name"], "bodies": asyncio.run(answer(case))}
    except Exception:
        return {"name": case["name"], "error": traceback.format_exc()[-3000:]}


def main() -> None:
    source, target = sys.argv[1], sys.argv[2]
    with open(source) as f:
        cases = json.load(f)["cases"]
    results = [run(case) for case in cases]
    with open(target, "w") as f:
        json.dump({"results": results}, f)


if __name__ == "__main__":
    main()
