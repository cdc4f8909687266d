"""Tool calling end to end with the official `openai` client: a tiny random checkpoint per
`--tool-call-parser` (its tokenizer carries the format's special tokens, its chat template
renders tools, calls and results: tests/gpu_worker/tool_checkpoints.py) served by the real
gateway, ledger and worker. `required` and a named function are constrained by the tools' JSON
schema, so even a random model answers valid calls, which the client's typed objects parse,
whole and streamed (as chat tool_calls and as /v1/responses' function_call items); `none` and
`auto` answer content, and a conversation holding tool calls and results goes through the
template."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from typing import Any, cast

import openai
import pytest

from gpu_worker.checkpoint import load_model
from gpu_worker.runner import ModelRunner
from tests.gpu_worker.tool_checkpoints import FORMATS, tool_checkpoint
from tests.harness.gateway_stack import gateway_on
from tests.harness.stack import Stack

CITIES = ["Paris", "Rome", "Oslo"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city for some days",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": CITIES},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# hermes is the short version; the other formats are marked slow (a minute or so each).
@pytest.fixture(params=[p if p == "hermes" else pytest.param(p, marks=pytest.mark.slow)
                        for p in FORMATS])  # fmt: skip
async def served(request, redis_url, tmp_path) -> AsyncIterator[tuple[str, openai.AsyncOpenAI]]:
    parser = request.param
    folder = tool_checkpoint(tmp_path, parser)
    stack = Stack(redis_url, load_model(folder), num_blocks=256, block_size=16,
                  max_model_len=2048)  # fmt: skip
    # The worker masks structured outputs over the checkpoint's own tokenizer.
    stack.runner_factory = functools.partial(ModelRunner, tokenizer_model=str(folder))
    await stack.start()
    try:
        async with gateway_on(stack, model=str(folder), tool_call_parser=parser,
                              enable_auto_tool_choice=True, max_model_len=2048) as http:  # fmt: skip
            base_url = str(http.make_url("/v1"))
            async with openai.AsyncOpenAI(base_url=base_url, api_key="unused") as client:
                yield parser, client
    finally:
        await stack.stop()


def _valid(name: str, arguments: dict[str, Any]) -> bool:
    if name == "get_weather":
        return (
            set(arguments) == {"city", "days"}
            and arguments["city"] in CITIES
            and (1 <= arguments["days"] <= 7)
        )
    return name == "get_time" and arguments in ({"zone": "UTC"}, {"zone": "CET"})


async def _called(client, model: str, finish: str, **body: Any) -> tuple[int, Any]:
    """A choice that finishes with calls (`finish`), and its seed. A random model may spend its
    tokens on the whitespace the JSON grammar allows (vLLM's grammars allow it too), so eight
    samples run at once (n=8: seeds 0..7); every call that finished must be valid."""
    done = await client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, max_tokens=400, temperature=1.0, seed=0, n=8,
        **body,
    )  # fmt: skip
    finished = [c for c in done.choices if c.finish_reason == finish]
    for choice in finished:
        for call in choice.message.tool_calls or []:
            assert _valid(call.function.name, json.loads(call.function.arguments)), call
    assert finished, f"no sample of 8 finished its tool call within 400 tokens ({body})"
    return finished[0].index, finished[0]


async def test_required_and_named_calls_parse_in_the_openai_client(served):
    parser, client = served
    model = (await client.models.list()).data[0].id
    _, choice = await _called(client, model, "tool_calls", tool_choice="required",
                              parallel_tool_calls=False)  # fmt: skip
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    if parser == "mistral":
        assert len(call.id) == 9 and call.id.isalnum()

    named = {"type": "function", "function": {"name": "get_weather"}}
    seed, choice = await _called(client, model, "stop", tool_choice=named)  # OpenAI's "stop"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert choice.message.content == ""  # vLLM: a forced call has empty content

    # Streamed with that sample's seed (n's sample i has seed + i): the same tokens, so the
    # client's delta objects, joined by index, give the same call.
    stream = await client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, max_tokens=400, temperature=1.0, seed=seed,
        tool_choice=named, stream=True,
    )  # fmt: skip
    names: dict[int, str | None] = {}
    arguments: dict[int, str] = {}
    finish = None
    async for chunk in stream:
        for part in chunk.choices:
            for delta in part.delta.tool_calls or []:
                if delta.id is not None:
                    names[delta.index] = delta.function.name
                arguments[delta.index] = arguments.get(delta.index, "") + (
                    delta.function.arguments or ""
                )
            finish = part.finish_reason or finish
    assert finish == "stop" and names == {0: "get_weather"}
    assert json.loads(arguments[0]) == json.loads(call.function.arguments)


async def test_none_auto_and_a_conversation_with_tool_results_answer_content(served):
    parser, client = served
    model = (await client.models.list()).data[0].id
    for choice in ("none", "auto"):
        done = await client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=8,
            temperature=0.0,
        )  # fmt: skip
        assert done.choices[0].finish_reason in ("stop", "length", "tool_calls"), choice
    call_id = "abc123XYZ"  # nine letters and digits: fine for Mistral's templates too
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
        }]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"},
    ]  # fmt: skip
    done = await client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=8, temperature=0.0,
        extra_body={"return_prompt_text": True},
    )  # fmt: skip
    prompt = done.model_extra["prompt_text"]
    assert "sunny, 21 C" in prompt and "get_weather" in prompt, (parser, prompt)
    assert done.usage is not None and done.usage.prompt_tokens > 20


async def test_responses_function_calls_parse_in_the_openai_client(served):
    """/v1/responses with tool_choice required: the seed of a chat sample that finished its call
    gives the same call as a function_call item, whole and through responses.stream (its
    arguments deltas joined), parsed by the client's typed models."""
    parser, client = served
    model = (await client.models.list()).data[0].id
    seed, choice = await _called(client, model, "tool_calls", tool_choice="required",
                                 parallel_tool_calls=False)  # fmt: skip
    (call,) = choice.message.tool_calls
    expected = (call.function.name, json.loads(call.function.arguments))
    body: dict[str, Any] = {
        "model": model, "input": ASK[0]["content"], "tool_choice": "required",
        "tools": [{"type": "function", **cast(dict[str, Any], tool["function"])} for tool in TOOLS],
        "parallel_tool_calls": False, "max_output_tokens": 400, "temperature": 1.0,
        "extra_body": {"seed": seed},
    }  # fmt: skip
    done = await client.responses.create(**body)
    assert done.status == "completed", parser
    (item,) = done.output
    assert isinstance(item, openai.types.responses.ResponseFunctionToolCall)
    assert (item.name, json.loads(item.arguments)) == expected and item.call_id
    async with client.responses.stream(**body) as stream:
        arguments = "".join([e.delta async for e in stream
                             if e.type == "response.function_call_arguments.delta"])  # fmt: skip
        final = await stream.get_final_response()
    (streamed,) = final.output
    assert streamed.type == "function_call" and streamed.name == expected[0]
    assert json.loads(arguments) == json.loads(streamed.arguments) == expected[1]
