"""Tool calling through real HTTP against the fake ledger, per --tool-call-parser: the fake
ledger answers with the token ids of tool calls written in the parser's format (tokenized by a
tokenizer that carries the format's special tokens, `tests/gpu_worker/tool_checkpoints.py`), and
the answer carries them as OpenAI tool calls, whole and streamed. Also: vLLM's refusals,
`tool_choice: "none"` (200, the tools still reach the template), required and named choices
sent to the ledger with the tools' JSON schema as their constraint, and a conversation with
tool calls and results rendered by the chat template."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gateway import create_app
from services.environment import ConfigError
from services.tokenization.tokenizer import HFTokenizer
from tests.gateway.fake_ledger import Script
from tests.gateway.helpers import assert_error, read_sse
from tests.gpu_worker.tool_checkpoints import FORMATS, tool_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
CHECKPOINT_EOS = 1  # the tool tokenizers' </s>
PARSERS = list(FORMATS)


@pytest.fixture
def folder(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    return tool_tokenizer(tmp_path, getattr(request, "param", "hermes"))


async def _serve(start_gateway, start_ledger, folder: Path, text: str = "", **flags: Any):
    """A gateway with the tool flags and a fake ledger that answers with `text`'s token ids."""
    tokenizer = HFTokenizer(folder)
    ids = tokenizer.encode(text, add_special_tokens=False)
    ledger = await start_ledger(Script(ids=ids, eos=CHECKPOINT_EOS), vocab_size=320,
                                max_model_len=4096)  # fmt: skip
    client = await start_gateway(model=str(folder), **flags)
    return client, ledger


def _flags(parser: str) -> dict[str, Any]:
    return {"tool_call_parser": parser, "enable_auto_tool_choice": True}


async def _chat(client, **body: Any) -> dict[str, Any]:
    resp = await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 200,
                                                           **body})  # fmt: skip
    text = await resp.text()
    assert resp.status == 200, text
    return json.loads(text)


async def _streamed(client, **body: Any) -> tuple[str | None, list[dict[str, Any]], str, list]:
    """A streamed answer folded as a client folds it: content, calls, finish reason, chunks."""
    resp = await client.post(
        "/v1/chat/completions",
        json={"messages": ASK, "max_tokens": 200, "stream": True, **body},
    )
    assert resp.status == 200, await resp.text()
    events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    content, calls, finish = None, {}, None
    for event in events[:-1]:
        (choice,) = event["choices"]
        delta = choice["delta"]
        if delta.get("content"):
            content = (content or "") + delta["content"]
        for call in delta.get("tool_calls", []):
            if "id" in call:  # the first delta of a call: id, type and name
                assert call["index"] not in calls and call["type"] == "function"
                calls[call["index"]] = {"id": call["id"], "name": call["function"]["name"],
                                        "arguments": ""}  # fmt: skip
            calls[call["index"]]["arguments"] += call["function"].get("arguments", "")
        finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish, events


def _called(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls") or []]  # fmt: skip


# --- vLLM's refusals -----------------------------------------------------------------------------

REFUSED: list[tuple[dict[str, Any], dict[str, Any], str | None, str]] = [
    ({}, {"tools": TOOLS}, "tool_choice",
     '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
    ({}, {"tools": TOOLS, "tool_choice": "required"}, "tool_choice",
     'tool_choice="required" requires --tool-call-parser to be set'),
    ({}, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", 'tool_choice=function "get_time" requires --tool-call-parser to be set'),
    (_flags("hermes"), {"tools": []}, "tools", "`tools` must not be an empty array"),
    (_flags("hermes"), {"tool_choice": "auto"}, "tool_choice",
     "When using `tool_choice`, `tools` must be set."),
    (_flags("hermes"), {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice",
     "Invalid value for `tool_choice`: sometimes!"),
    (_flags("hermes"), {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
     "tool_choice.function.name", "Expected field `name` in `function`"),
    (_flags("hermes"), {"tools": TOOLS,
                        "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "does not match any of the specified `tools`"),
    (_flags("hermes"), {"tools": TOOLS, "structured_outputs": {"regex": "a"},
                        "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "You can only either use constraints for structured outputs or tools"),
    (_flags("hermes"), {"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0].type",
     "must be 'function'"),
    (_flags("hermes"), {"tools": [{"function": {"name": ""}}]}, "tools[0].function.name",
     "non-empty string"),
    (_flags("hermes"), {"tools": [{"function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters", "JSON schema object"),
    (_flags("hermes"), {"tools": [{"function": {"name": "f", "colour": "red"}}]},
     "tools[0].function.colour", "unknown field"),
    (_flags("hermes"), {"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls",
     "must be a boolean"),
    (_flags("hermes"), {"messages": [{"role": "assistant", "tool_calls": [{"type": "code"}]}]},
     "messages[0].tool_calls[0]", "only support assistant tool_calls of type 'function'"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "body", "param", "message"), REFUSED)
async def test_vllms_refusals(start_gateway, start_ledger, folder, flags, body, param, message):
    client, ledger = await _serve(start_gateway, start_ledger, folder, **flags)
    resp = await client.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert resp.status == 400
    assert_error(await resp.json(), param, message)
    assert ledger.requests == []


async def test_a_parser_whose_token_the_tokenizer_lacks_is_refused_at_start(tmp_path, make_config):
    hermes_vocab = tool_tokenizer(tmp_path, "hermes")  # has no <|python_tag|>
    with pytest.raises(ConfigError, match=re.escape("token '<|python_tag|>'")):
        create_app(make_config(model=str(hermes_vocab), tool_call_parser="llama3_json"))
    with pytest.raises(ConfigError, match="needs --tool-call-parser"):
        create_app(make_config(model=str(hermes_vocab), enable_auto_tool_choice=True))


# --- tool_choice none ----------------------------------------------------------------------------


async def test_tool_choice_none_answers_200_with_the_tools_in_the_prompt(
    start_gateway, start_ledger, folder
):
    # No tool flags at all: vLLM answers "none" with plain content and still renders the tools.
    text = FORMATS["hermes"].call_text(CALLS[:1], "Plain: ")
    client, ledger = await _serve(start_gateway, start_ledger, folder, text)
    body = await _chat(client, tools=TOOLS, tool_choice="none", return_prompt_text=True)
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    # Special tokens are skipped as usual: the markers do not show, the rest is content.
    assert choice["message"]["content"] == text.replace("<tool_call>", "").replace(
        "</tool_call>", ""
    )
    assert (
        '<tools>{"name": "get_weather", "description": "The weather in a city"'
        in (body["prompt_text"])
    )
    assert ledger.requests[0].sampling.structured is None


# --- auto: the parser reads calls in its format --------------------------------------------------


@pytest.mark.parametrize("folder", PARSERS, indirect=True)
async def test_auto_reads_the_parsers_calls_whole_and_streamed(start_gateway, start_ledger, folder):
    fmt = FORMATS[folder.name.removeprefix("tools-")]
    content = "" if fmt.parser == "llama3_json" else "Let me look. "
    text = fmt.call_text(CALLS, content)
    client, ledger = await _serve(start_gateway, start_ledger, folder, text, **_flags(fmt.parser))
    body = await _chat(client, tools=TOOLS)
    (choice,) = body["choices"]
    message = choice["message"]
    assert _called(message) == CALLS  # parallel calls, in order
    # vLLM's engine strips Mistral's content beside calls in whole answers (not in streams).
    assert message["content"] == ((content.strip() if fmt.parser == "mistral" else content) or None)
    assert choice["finish_reason"] == "tool_calls"
    ids = [c["id"] for c in message["tool_calls"]]
    assert len(set(ids)) == 2
    if fmt.parser == "mistral":  # Mistral's ids: nine letters and digits
        assert all(len(i) == 9 and i.isalnum() for i in ids)
    else:
        assert all(i.startswith("chatcmpl-tool-") for i in ids)
    assert ledger.requests[0].sampling.structured is None  # auto is not constrained
    streamed, calls, finish, _ = await _streamed(client, tools=TOOLS)
    assert streamed == (content or None) and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == CALLS
    first_only = await _chat(client, tools=TOOLS, parallel_tool_calls=False)
    assert _called(first_only["choices"][0]["message"]) == CALLS[:1]
    _, calls, _, _ = await _streamed(client, tools=TOOLS, parallel_tool_calls=False)
    assert [c["name"] for c in calls] == ["get_weather"]


@pytest.mark.parametrize("folder", ["hermes"], indirect=True)
async def test_auto_without_a_call_is_content_and_a_broken_call_stays_content(
    start_gateway, start_ledger, folder
):
    client, _ = await _serve(start_gateway, start_ledger, folder, "Sunny, 20 degrees.",
                             **_flags("hermes"))  # fmt: skip
    body = await _chat(client, tools=TOOLS)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Sunny, 20 degrees."}
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("folder", ["hermes"], indirect=True)
async def test_a_call_cut_by_max_tokens_finishes_with_length(start_gateway, start_ledger, folder):
    text = FORMATS["hermes"].call_text(CALLS[:1])
    client, _ = await _serve(start_gateway, start_ledger, folder, text, **_flags("hermes"))
    ids = HFTokenizer(folder).encode(text, add_special_tokens=False)
    _, calls, finish, _ = await _streamed(client, tools=TOOLS, max_tokens=len(ids) - 3)
    assert finish == "length"  # vLLM keeps "length" visible: the call may be incomplete
    assert [c["name"] for c in calls] == ["get_weather"]


# --- required and named: constrained to the tools' JSON schema ----------------------------------


@pytest.mark.parametrize("folder", PARSERS, indirect=True)
async def test_required_constrains_the_output_to_a_list_of_the_tools_calls(
    start_gateway, start_ledger, folder
):
    parser = folder.name.removeprefix("tools-")
    key = "arguments" if parser == "mistral" else "parameters"
    listed = json.dumps([{"name": n, key: a} for n, a in CALLS])
    client, ledger = await _serve(start_gateway, start_ledger, folder, listed,
                                  tool_call_parser=parser)  # fmt: skip
    body = await _chat(client, tools=TOOLS, tool_choice="required")
    (choice,) = body["choices"]
    assert _called(choice["message"]) == CALLS and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == ""  # vLLM: a forced call has empty content
    constraint = ledger.requests[0].sampling.structured
    assert constraint is not None and constraint.kind == "json"
    assert "get_weather" in constraint.grammar and "get_time" in constraint.grammar
    content, calls, finish, _ = await _streamed(client, tools=TOOLS, tool_choice="required")
    assert content is None and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == CALLS


@pytest.mark.parametrize("folder", PARSERS, indirect=True)
async def test_a_named_function_constrains_the_output_to_its_arguments(
    start_gateway, start_ledger, folder
):
    parser = folder.name.removeprefix("tools-")
    named = {"type": "function", "function": {"name": "get_weather"}}
    if parser == "mistral":  # vLLM's Mistral list, limited to the named function
        text = json.dumps([{"name": "get_weather", "arguments": CALLS[0][1]}])
    else:
        text = json.dumps(CALLS[0][1])
    client, ledger = await _serve(start_gateway, start_ledger, folder, text,
                                  tool_call_parser=parser)  # fmt: skip
    body = await _chat(client, tools=TOOLS, tool_choice=named)
    (choice,) = body["choices"]
    assert _called(choice["message"]) == CALLS[:1]
    assert choice["finish_reason"] == "stop"  # OpenAI's for a forced function
    constraint = ledger.requests[0].sampling.structured
    assert constraint is not None and "get_time" not in constraint.grammar
    _, calls, finish, _ = await _streamed(client, tools=TOOLS, tool_choice=named)
    assert finish == "stop"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == CALLS[:1]


# --- conversations with tool calls and results --------------------------------------------------


@pytest.mark.parametrize("folder", PARSERS, indirect=True)
async def test_tool_calls_and_results_in_the_history_reach_the_template(
    start_gateway, start_ledger, folder
):
    parser = folder.name.removeprefix("tools-")
    client, ledger = await _serve(start_gateway, start_ledger, folder, "It is sunny.",
                                  **_flags(parser))  # fmt: skip
    call = {"id": "call0abcd", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {
            "role": "tool",
            "tool_call_id": "call0abcd",
            "content": [{"type": "text", "text": "sunny"}],
        },
    ]
    body = await _chat(client, messages=messages, tools=TOOLS, return_prompt_text=True)
    assert body["choices"][0]["message"]["content"] == "It is sunny."
    expected = {
        "hermes": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
                  "</s>\n<|tool|><tool_response>sunny</tool_response>",
        "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
                       "</s>\n<|ipython|>sunny</s>",
        "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>[TOOL_RESULTS]sunny'
                   "[/TOOL_RESULTS]",
    }[parser]  # fmt: skip
    assert expected in body["prompt_text"]
    tokenizer = HFTokenizer(folder)
    assert ledger.requests[0].prompt_token_ids == tokenizer.encode(
        body["prompt_text"], add_special_tokens=False
    )
    # /tokenize renders the same conversation with the same tools.
    resp = await client.post("/tokenize", json={"messages": messages, "tools": TOOLS})
    assert (await resp.json())["tokens"] == ledger.requests[0].prompt_token_ids
