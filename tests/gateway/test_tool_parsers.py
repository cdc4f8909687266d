"""The tool-call parsers on text in their formats (vLLM 0.33's reading of them): a whole output,
and the same output streamed in random pieces, which must add up to the same calls and content
whatever the cut; markers split across pieces are held back, never shown as content."""

from __future__ import annotations

import json
import random

import pytest

from gateway.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedChoice,
    RequiredChoice,
    ToolParser,
    ToolStream,
    tool_call_id,
)

CALLS = [("get_weather", {"city": "Zürich", "days": [1, 2], "note": "a } in \" text"}),
         ("get_time", {})]  # fmt: skip


def _hermes() -> ToolParser:
    return HermesParser(lambda _: False)


def _llama() -> ToolParser:
    return Llama3JsonParser(lambda _: True)


def _mistral(v11: bool = True) -> ToolParser:
    return MistralParser(lambda token: v11 and token == "[ARGS]")


def _hermes_text(content: str = "Let me check.\n") -> str:
    return content + "".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>\n" for n, a in CALLS
    )


# (parser, text, content, calls)
CASES = [
    (_hermes, _hermes_text(), "Let me check.\n", CALLS),
    (_hermes, _hermes_text(""), None, CALLS),
    (_hermes, "No tools needed: 4.", "No tools needed: 4.", []),
    (_llama, "<|python_tag|>" + "; ".join(
        json.dumps({"name": n, "parameters": a}) for n, a in CALLS), None, CALLS),
    (_llama, json.dumps({"name": "get_time", "arguments": {}}), None, CALLS[1:]),
    (_llama, "The answer is 4.", "The answer is 4.", []),
    (_mistral, "Sure. " + "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in CALLS),
     "Sure.", CALLS),  # vLLM's engine strips Mistral's content beside calls (whole answers)
    (_mistral, "[TOOL_CALLS]get_time{}", None, CALLS[1:]),
    (lambda: _mistral(v11=False), "[TOOL_CALLS] " + json.dumps(
        [{"name": n, "arguments": a} for n, a in CALLS]), None, CALLS),
    (lambda: _mistral(v11=False), "Hm [TOOL_CALLS]" + json.dumps(
        {"name": "get_time", "arguments": {}}), "Hm ", CALLS[1:]),
    (lambda: RequiredChoice("parameters", tool_call_id),
     json.dumps([{"name": n, "parameters": a} for n, a in CALLS]), "", CALLS),
    (lambda: NamedChoice("get_weather"), json.dumps(CALLS[0][1]), "", CALLS[:1]),
]  # fmt: skip
IDS = ["hermes", "hermes-no-content", "hermes-none", "llama", "llama-bare", "llama-none",
       "mistral", "mistral-brace", "mistral-pre-v11", "mistral-pre-v11-object", "required",
       "named"]  # fmt: skip


def _calls(parsed_calls) -> list[tuple[str | None, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed_calls]


# Those that write the arguments again as JSON (vLLM's json.dumps, no ASCII escapes); the
# others keep the model's text.
REWRITTEN = ("hermes", "hermes-no-content", "llama", "llama-bare", "mistral-pre-v11",
             "mistral-pre-v11-object", "required")  # fmt: skip


@pytest.mark.parametrize(("make", "text", "content", "calls"), CASES, ids=IDS)
def test_a_whole_output(make, text, content, calls, request):
    parsed = make().parse(text)
    assert parsed.content == content
    assert _calls(parsed.calls) == calls
    escaped = ["\\u00fc" in call.arguments for call in parsed.calls if call.arguments != "{}"]
    rewritten = request.node.callspec.id in REWRITTEN
    assert escaped == [not rewritten] * len(escaped)


@pytest.mark.parametrize(("make", "text", "content", "calls"), CASES, ids=IDS)
def test_streamed_in_random_pieces_adds_up_to_the_same(make, text, content, calls):
    rng = random.Random(7)
    for _ in range(30):
        stream = ToolStream(make(), first_only=False)
        shown, arguments, names, pos = "", {}, {}, 0
        while pos < len(text):
            piece = text[pos : pos + rng.randint(1, 6)]
            pos += len(piece)
            delta, deltas = stream.push(piece)
            shown += delta or ""
            for d in deltas:
                if "id" in d:
                    assert d["index"] == len(names) and d["type"] == "function"
                    names[d["index"]] = d["function"]["name"]
                arguments[d["index"]] = arguments.get(d["index"], "") + d["function"]["arguments"]
        assert shown.strip() == (content or "").strip()  # streams are not stripped
        assert [(names[i], json.loads(arguments[i])) for i in sorted(names)] == calls


def test_markers_split_across_pieces_are_held_back():
    stream = ToolStream(_hermes(), first_only=False)
    assert stream.push("Let me <tool") == ("Let me ", [])
    assert stream.push("_cal") == (None, [])
    assert stream.push('l>{"na') == (None, [])
    content, deltas = stream.push('me": "get_time", "arguments": {')
    assert content is None and deltas[0]["function"] == {"name": "get_time", "arguments": "{"}
    assert stream.push("}}</tool_c")[1] == [{"index": 0, "function": {"arguments": "}"}}]
    # Text that only looked like a marker goes out as content.
    other = ToolStream(_hermes(), first_only=False)
    assert other.push("a <tool") == ("a ", [])
    assert other.push("s> b") == ("<tools> b", [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    stream = ToolStream(_hermes(), first_only=True)
    _, deltas = stream.push(_hermes_text(""))
    assert {d["index"] for d in deltas} == {0}


def test_malformed_calls_leave_the_output_as_content():
    broken = '<tool_call>{"name": "f", "arguments": {oops}}</tool_call>'
    assert _hermes().parse(broken).content == broken and _hermes().parse(broken).calls == []
    no_name = json.dumps({"function": "f", "parameters": {}})
    assert _llama().parse(no_name).content == no_name
    assert RequiredChoice("parameters", tool_call_id).parse('[{"name": "f", "param').calls == []
