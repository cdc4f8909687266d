"""The gateway's answers against vLLM 0.33's own serving code, field by field: each request goes
through the real gateway to the fake ledger, and the engine outputs the fake ledger sent are
given to vLLM's completion and chat generators (tests/oracle/vllm_serving_driver.py, in vLLM's
venv). Both answers must be equal once ids and timestamps are set aside and null fields dropped
(a null and an absent field parse the same; vLLM writes some of its nulls, kvledger omits them).

This pins what the protocol models cannot: which chunks carry `usage` under stream_options, the
role chunk's usage, echo chunks, finish and stop reasons, the final usage chunk."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.tokenization.tokenizer import ByteTokenizer, HFTokenizer
from services.wire.messages import GenerateRequest, TokenLogprobs
from tests.gateway.fake_ledger import EOS, FakeLedger, Script, outputs_for
from tests.gateway.helpers import read_sse
from tests.gateway.test_http_tools import TOOLS
from tests.gpu_worker.checkpoints import write_tokenizer
from tests.gpu_worker.tool_checkpoints import FORMATS, tool_tokenizer
from tests.oracle.conftest import require_vllm_python, run_driver

pytestmark = pytest.mark.oracle

MODEL = "served-model"  # the driver's name for the model
CHAT = [{"role": "user", "content": "Hi"}]
CONTINUED = [*CHAT, {"role": "assistant", "content": "Sure"}]
BOTH = {"include_usage": True, "continuous_usage_stats": True}
COMPLETIONS, CHATS = "/v1/completions", "/v1/chat/completions"

# (name, route, body): every one answered by the fake ledger, EOS after 5 tokens.
REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    ("completion", COMPLETIONS, {"prompt": "The KV", "max_tokens": 4}),
    ("completion_eos", COMPLETIONS, {"prompt": "The KV", "max_tokens": 9}),
    ("completion_echo_ids", COMPLETIONS,
     {"prompt": "ab", "max_tokens": 3, "echo": True, "return_token_ids": True}),
    ("completion_stream", COMPLETIONS, {"prompt": "The KV", "max_tokens": 3, "stream": True}),
    ("completion_stream_usage", COMPLETIONS,
     {"prompt": "x", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}),
    ("completion_stream_continuous", COMPLETIONS,
     {"prompt": "x", "max_tokens": 9, "stream": True, "stream_options": BOTH}),
    ("completion_stream_continuous_alone", COMPLETIONS,
     {"prompt": "x", "max_tokens": 3, "stream": True,
      "stream_options": {"continuous_usage_stats": True}}),
    ("completion_stream_echo_ids", COMPLETIONS,
     {"prompt": "ab", "max_tokens": 3, "stream": True, "echo": True, "return_token_ids": True,
      "stream_options": BOTH}),
    ("completion_logprobs_echo", COMPLETIONS,
     {"prompt": "The KV", "max_tokens": 3, "echo": True, "logprobs": 2}),
    ("completion_score", COMPLETIONS,
     {"prompt": "The KV", "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}),
    ("completion_score_ids", COMPLETIONS,
     {"prompt": [[256, 65, 66], [256, 67]], "max_tokens": 0, "echo": True, "logprobs": 1,
      "return_token_ids": True}),
    ("completion_score_stream", COMPLETIONS,
     {"prompt": "ab", "max_tokens": 0, "echo": True, "logprobs": 0, "stream": True,
      "stream_options": BOTH}),
    ("chat", CHATS, {"messages": CHAT, "max_tokens": 4}),
    ("chat_eos_ids", CHATS, {"messages": CHAT, "max_tokens": 9, "return_token_ids": True}),
    ("chat_echo", CHATS,
     {"messages": CONTINUED, "max_tokens": 2, "echo": True, "add_generation_prompt": False,
      "continue_final_message": True}),
    ("chat_stream", CHATS, {"messages": CHAT, "max_tokens": 3, "stream": True}),
    ("chat_stream_usage", CHATS,
     {"messages": CHAT, "max_tokens": 9, "stream": True,
      "stream_options": {"include_usage": True}}),
    ("chat_stream_continuous", CHATS,
     {"messages": CHAT, "max_tokens": 3, "stream": True, "stream_options": BOTH}),
    ("chat_stream_continuous_alone", CHATS,
     {"messages": CHAT, "max_tokens": 3, "stream": True,
      "stream_options": {"continuous_usage_stats": True}}),
    ("chat_stream_echo_continuous", CHATS,
     {"messages": CONTINUED, "max_tokens": 2, "stream": True, "echo": True,
      "add_generation_prompt": False, "continue_final_message": True, "stream_options": BOTH}),
    ("chat_stream_ids", CHATS,
     {"messages": CHAT, "max_tokens": 2, "stream": True, "return_token_ids": True}),
]  # fmt: skip
REQUESTS_BY_NAME = {name: body for name, _, body in REQUESTS}
# A whole answer to a batch of prompts: kvledger's cached_tokens counts every prompt's hits (each
# hits SCRIPT.cached_tokens here), vLLM's only the last prompt's. The one difference kept.
SUMMED_CACHE_HITS = ("completion_score_ids",)
SCRIPT = Script(eos_after=5, cached_tokens=2)
TOKENIZER = ByteTokenizer()


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    return require_vllm_python()


async def test_answers_equal_vllms_serving_code_field_by_field(
    vllm_python, start_gateway, start_ledger, tmp_path
):
    ledger = await start_ledger(SCRIPT, model_name=MODEL)
    client = await start_gateway()
    ours: dict[str, list[Any]] = {}
    cases, sent = [], 0
    for name, route, body in REQUESTS:
        body = body | {"model": MODEL}
        resp = await client.post(route, json=body)
        assert resp.status == 200, (name, await resp.text())
        ours[name] = await read_sse(resp) if body.get("stream") else [await resp.json()]
        requests = ledger.requests[sent:]
        sent += len(requests)
        case = _case(name, route, body, requests[0])
        if len(requests) > 1:  # a batch of prompts: one ledger request each
            prompts = body["prompt"]
            case["batch"] = [_case(name, route, body | {"prompt": p}, r)
                             for p, r in zip(prompts, requests, strict=True)]  # fmt: skip
        cases.append(case)
    results = run_driver(vllm_python, "vllm_serving_driver", {"cases": cases}, tmp_path)
    differences = []
    for result in results["results"]:
        name = result["name"]
        assert "error" not in result, f"{name}: vLLM's code failed:\n{result['error']}"
        theirs = [_normal(b) for b in result["bodies"]]
        if name in SUMMED_CACHE_HITS:  # vLLM reports the last prompt's hits, kvledger all
            usage = theirs[0]["usage"]
            usage["prompt_tokens_details"]["cached_tokens"] *= len(REQUESTS_BY_NAME[name]["prompt"])
        mine = [_normal(b) for b in ours[name]]
        if mine != theirs:
            differences.append(f"{name}:\n  ours {mine}\n  vllm {theirs}")
    assert differences == [], "\n".join(differences)


def _case(name: str, route: str, body: dict[str, Any], request: GenerateRequest) -> dict[str, Any]:
    """The driver's case: the body and the engine outputs the fake ledger sent for it."""
    steps, prompt_logprobs = [], None
    for out in outputs_for(request, SCRIPT):
        if out.prompt_logprobs is not None:
            prompt_logprobs = [None, *map(_entry, out.prompt_logprobs)]
        ids = out.new_token_ids
        shown = [t for t in ids if t != EOS]  # vLLM's detokenizer shows no EOS text either
        steps.append({
            "index": 0, "text": TOKENIZER.decode(shown), "token_ids": ids,
            "finish_reason": out.finish_reason, "stop_reason": None,
            "logprobs": None if out.logprobs is None else [_entry(e) for e in out.logprobs],
        })  # fmt: skip
    prompt = body.get("prompt")
    return {
        "name": name, "kind": "completion" if route == COMPLETIONS else "chat", "request": body,
        "prompt": prompt if isinstance(prompt, str) else None,
        "prompt_token_ids": request.prompt_token_ids, "prompt_logprobs": prompt_logprobs,
        "num_cached_tokens": SCRIPT.cached_tokens, "steps": steps, "tokenizer": "bytes",
    }  # fmt: skip


def _entry(entry: TokenLogprobs) -> dict[str, dict[str, Any]]:
    """A position's logprobs as vLLM's engine gives them: by token id, the chosen one first
    with its rank, the top-k ranked 1, 2, ..., each with its decoded text."""
    ranks = [entry.rank, *range(1, len(entry.token_ids))]
    return {
        str(t): {"logprob": lp, "rank": rank, "decoded_token": TOKENIZER.decode([t], False)}
        for t, lp, rank in zip(entry.token_ids, entry.logprobs, ranks, strict=True)
    }


def _normal(body: Any) -> Any:
    """Nulls dropped, ids and timestamps set aside."""
    if body == "[DONE]":
        return body
    return {k: v for k, v in _drop_nulls(body).items() if k not in ("id", "created")}


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


# --- tool calls: kvledger's parsers against vLLM's ----------------------------------------------

# vLLM's llama3_json stream sends no arguments for a call whose arguments are {} (its check for
# arguments skips an empty object); kvledger sends "{}". The one difference kept.
EMPTY_ARGUMENTS_LOST = ("llama3_json-auto-stream",)
CHOICES = ("auto", "required", "named")
NAMED = {"type": "function", "function": {"name": "get_weather"}}


# hermes in every run; the other parsers (another minute of vLLM's code) with -m slow.
@pytest.mark.parametrize(
    "parsers",
    [("hermes",), pytest.param(tuple(f for f in FORMATS if f != "hermes"), marks=pytest.mark.slow)],
    ids=lambda parsers: "+".join(parsers),
)
async def test_tool_calls_equal_vllms_parsers(
    parsers, vllm_python, start_gateway, redis_url, prefix, tmp_path
):
    """The same output read by kvledger's parser and by vLLM's (--enable-auto-tool-choice
    --tool-call-parser NAME, the same tokenizer), for each parser and tool_choice auto,
    required and named: the same content, tool calls (ids aside) and finish reason, whole and
    streamed (the streamed deltas joined, as a client joins them)."""
    cases, ours = [], {}
    for parser, choice in [(parser, choice) for parser in parsers for choice in CHOICES]:
        folder = tool_tokenizer(tmp_path / parser, parser)
        if parser == "mistral" and choice != "auto":
            # vLLM reads a forced choice's bare JSON list with Mistral tokenizers before v11
            # only (with v11's [ARGS] it shows the list as content); kvledger reads it with
            # both, so it is compared where vLLM reads it.
            folder = tmp_path / "mistral-pre-v11"
            fmt = FORMATS["mistral"]
            tokens = tuple(t for t in fmt.special_tokens if t != "[ARGS]")
            write_tokenizer(folder, tokens, fmt.chat_template)
        tokenizer = HFTokenizer(folder)
        ids = tokenizer.encode(_tool_output(parser, choice), add_special_tokens=False)
        script = Script(ids=ids, eos=1)
        async with FakeLedger(redis_url, prefix, script, model_name=MODEL, vocab_size=320,
                              max_model_len=4096) as ledger:  # fmt: skip
            client = await start_gateway(model=str(folder), tool_call_parser=parser,
                                         enable_auto_tool_choice=True,
                                         gateway_id=f"gw-{parser}-{choice}")  # fmt: skip
            for stream in (False, True):
                body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
                        "tools": TOOLS, "tool_choice": NAMED if choice == "named" else choice,
                        "max_tokens": 300, "stream": stream}  # fmt: skip
                resp = await client.post("/v1/chat/completions", json=body)
                assert resp.status == 200, await resp.text()
                name = f"{parser}-{choice}-{'stream' if stream else 'whole'}"
                ours[name] = await read_sse(resp) if stream else [await resp.json()]
                prompt_ids = ledger.requests[-1].prompt_token_ids
                cases.append(_tool_case(name, body, prompt_ids, ids, tokenizer, parser, folder))
    results = run_driver(vllm_python, "vllm_serving_driver", {"cases": cases}, tmp_path)
    differences = []
    for result in results["results"]:
        name = result["name"]
        assert "error" not in result, f"{name}: vLLM's code failed:\n{result['error']}"
        mine, theirs = _folded(ours[name]), _folded(result["bodies"])
        if name in EMPTY_ARGUMENTS_LOST:
            theirs["calls"] = [(n, {} if a == "" else a) for n, a in theirs["calls"]]
        if mine != theirs:
            differences.append(f"{name}:\n  ours {mine}\n  vllm {theirs}")
        assert mine["calls"], f"{name} was meant to call a tool"
    assert differences == [], "\n".join(differences)
    # vLLM's protocol models parse every answer and chunk, tool calls included, and declare
    # every key they hold.
    chat = "vllm.entrypoints.openai.chat_completion.protocol"
    checks = [
        {"name": f"{name}[{i}]", "body": body,
         "model": f"{chat}:ChatCompletion{'StreamResponse' if 'stream' in name else 'Response'}"}
        for name, bodies in ours.items() for i, body in enumerate(bodies) if body != "[DONE]"
    ]  # fmt: skip
    parsed = run_driver(vllm_python, "api_protocol_driver", {"cases": checks}, tmp_path)
    problems = [f"{r['name']}: {r['error'] or r['undeclared']}" for r in parsed["results"]
                if r["error"] or r["undeclared"]]  # fmt: skip
    assert problems == [], "\n".join(problems)


def _tool_case(name, body, prompt_ids, ids, tokenizer, parser, folder) -> dict[str, Any]:
    steps, shown = [], ""
    for i in range(len(ids)):  # vLLM's detokenizer: one delta per token, specials shown
        now = tokenizer.decode(ids[: i + 1], skip_special_tokens=False)
        steps.append({"index": 0, "text": now[len(shown) :], "token_ids": [ids[i]]})
        shown = now
    steps.append({"index": 0, "text": "", "token_ids": [1], "finish_reason": "stop"})
    return {
        "name": name, "kind": "chat", "request": body, "prompt": None,
        "prompt_token_ids": prompt_ids, "steps": steps, "tool_parser": parser,
        "tokenizer": str(folder),
    }  # fmt: skip


def _tool_output(parser: str, choice: str) -> str:
    calls = [("get_weather", {"city": "Zürich", "days": 2}), ("get_time", {})]
    key = "arguments" if parser == "mistral" else "parameters"
    if choice == "required" or (choice == "named" and parser == "mistral"):
        return json.dumps([{"name": n, key: a} for n, a in calls[: 1 if choice == "named" else 2]])
    if choice == "named":
        return json.dumps(calls[0][1])
    return FORMATS[parser].call_text(calls, "" if parser == "llama3_json" else "Checking. ")


def _folded(bodies: list[Any]) -> dict[str, Any]:
    """Content, tool calls (name, parsed arguments) and finish reason of a whole answer or of
    a stream's chunks joined."""
    content, calls, finish = "", {}, None
    for body in bodies:
        if body == "[DONE]":
            continue
        for choice in body["choices"]:
            part = choice.get("message") or choice.get("delta") or {}
            content += part.get("content") or ""
            for i, call in enumerate(part.get("tool_calls") or []):
                index = call.get("index", i)
                entry = calls.setdefault(index, {"name": "", "arguments": ""})
                entry["name"] += call["function"].get("name") or ""
                entry["arguments"] += call["function"].get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return {
        "content": content,
        "calls": [(calls[i]["name"], _json(calls[i]["arguments"])) for i in sorted(calls)],
        "finish_reason": finish,
    }


def _json(text: str) -> Any:
    """Arguments as JSON; text that is not (a difference to report) as it is."""
    try:
        return json.loads(text)
    except ValueError:
        return text


# --- error bodies: kvledger's against vLLM's create_error_response -------------------------------

# (name, route, body, vLLM's error): each refused by the gateway before any ledger sees it.
ERRORS: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    ("max_tokens_negative", COMPLETIONS, {"prompt": "x", "max_tokens": -1},
     {"error": "validation", "param": "max_tokens"}),
    ("temperature_negative", CHATS, {"messages": CHAT, "temperature": -1},
     {"error": "validation", "param": "temperature"}),
    ("unknown_model_completion", COMPLETIONS, {"prompt": "x", "model": "gpt-9"},
     {"error": "unknown_model", "model": "gpt-9", "served": MODEL}),
    ("unknown_model_chat", CHATS, {"messages": CHAT, "model": "gpt-9"},
     {"error": "unknown_model", "model": "gpt-9", "served": MODEL}),
    ("unknown_model_responses", "/v1/responses", {"input": "x", "model": "gpt-9"},
     {"error": "unknown_model", "model": "gpt-9", "served": MODEL}),
]  # fmt: skip


async def test_error_bodies_equal_vllms(vllm_python, start_gateway, start_ledger, tmp_path):
    """kvledger's 400 and 404 bodies beside the ones vLLM's create_error_response makes for the
    same error: the same keys, type, param and code; for an unknown model the same message too
    (vLLM's words; a 400's message is kvledger's own wording of the same refusal)."""
    await start_ledger(SCRIPT, model_name=MODEL)
    client = await start_gateway()
    ours, cases = {}, []
    for name, route, body, error in ERRORS:
        resp = await client.post(route, json={"model": MODEL} | body)
        ours[name] = (resp.status, await resp.json())
        message = ours[name][1]["error"]["message"]
        cases.append({"name": name, "kind": "error", "request": error | {"message": message}})
    results = run_driver(vllm_python, "vllm_serving_driver", {"cases": cases}, tmp_path)
    for result in results["results"]:
        name = result["name"]
        assert "error" not in result, f"{name}: vLLM's code failed:\n{result['error']}"
        (theirs,) = result["bodies"]
        status, mine = ours[name]
        assert status == theirs["error"]["code"], (name, mine, theirs)
        assert mine.keys() == theirs.keys() == {"error"}
        assert mine["error"].keys() == theirs["error"].keys(), (name, mine, theirs)
        for key in ("type", "param", "code"):
            assert mine["error"][key] == theirs["error"][key], (name, key, mine, theirs)
        if name.startswith("unknown_model"):
            assert mine == theirs
