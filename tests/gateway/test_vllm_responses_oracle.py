"""/v1/responses against vLLM 0.33's own Responses serving code, field by field: each request
goes through the real gateway to the fake ledger, and the engine outputs the fake ledger sent
are given to vLLM's responses_full_generator / responses_stream_generator (its SimpleContext,
tests/oracle/vllm_serving_driver.py, in vLLM's venv). The whole response, or every stream event
in order, must be equal once ids and timestamps are set aside and null fields dropped; vLLM's
protocol models (and openai's event models, which vLLM streams) parse every body kvledger sent
and declare every key in it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.tokenization.tokenizer import ByteTokenizer, HFTokenizer
from services.wire.messages import GenerateRequest
from tests.gateway.fake_ledger import EOS, Script, outputs_for
from tests.gateway.test_http_responses import read_events
from tests.gateway.test_vllm_serving_oracle import _drop_nulls, _entry
from tests.gpu_worker.tool_checkpoints import FORMATS, tool_tokenizer
from tests.oracle.conftest import require_vllm_python, run_driver

pytestmark = pytest.mark.oracle

MODEL = "served-model"  # the driver's name for the model
MAX_MODEL_LEN = 256
SCRIPT = Script(eos_after=5, cached_tokens=2)
TOKENIZER = ByteTokenizer()
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [
    {"role": "user", "content": "Hi"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Yo"}]},
    {"role": "user", "content": [{"type": "input_text", "text": "More"}]},
]
SAMPLING = {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 3,
            "presence_penalty": 0.2, "frequency_penalty": 0.1, "repetition_penalty": 1.1}  # fmt: skip
LOGPROBS = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}

# (name, body): every one answered by the fake ledger, EOS after 5 tokens.
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("text", {"input": "Hi", "max_output_tokens": 9}),
    ("text_cut", {"input": "Hi", "max_output_tokens": 3}),
    ("text_default_max", {"input": "Hi"}),
    ("messages", {"input": MESSAGES, "max_output_tokens": 9}),
    ("instructions", {"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 9}),
    ("sampling", {"input": "Hi", "max_output_tokens": 9, **SAMPLING}),
    ("echoed_fields",
     {"input": "Hi", "max_output_tokens": 9, "metadata": {"k": "v"}, "user": "u1",
      "service_tier": "default", "truncation": "auto", "parallel_tool_calls": False,
      "prompt_cache_key": "pk", "safety_identifier": "s1"}),
    ("json_schema",
     {"input": "Hi", "max_output_tokens": 9,
      "text": {"format": {"type": "json_schema", "name": "obj", "schema": SCHEMA}}}),
    ("json_object", {"input": "Hi", "max_output_tokens": 9,
                     "text": {"format": {"type": "json_object"}}}),
    ("logprobs", {"input": "Hi", "max_output_tokens": 9, **LOGPROBS}),
    ("stream", {"input": "Hi", "max_output_tokens": 9, "stream": True}),
    ("stream_cut", {"input": "Hi", "max_output_tokens": 3, "stream": True}),
    ("stream_messages_instructions",
     {"input": MESSAGES, "instructions": "Be brief.", "max_output_tokens": 9, "stream": True,
      **SAMPLING}),
    ("stream_json_schema",
     {"input": "Hi", "max_output_tokens": 9, "stream": True,
      "text": {"format": {"type": "json_schema", "name": "obj", "schema": SCHEMA}}}),
    ("stream_logprobs", {"input": "Hi", "max_output_tokens": 4, "stream": True, **LOGPROBS}),
]  # fmt: skip
# Keys set aside: random ids and the clock.
IDS = ("id", "item_id", "call_id", "created_at")


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    return require_vllm_python()


async def test_responses_equal_vllms_serving_code_field_by_field(
    vllm_python, start_gateway, start_ledger, tmp_path
):
    ledger = await start_ledger(SCRIPT, model_name=MODEL, max_model_len=MAX_MODEL_LEN)
    client = await start_gateway()
    ours: dict[str, list[Any]] = {}
    cases = []
    for name, body in REQUESTS:
        body = body | {"model": MODEL}
        resp = await client.post("/v1/responses", json=body)
        assert resp.status == 200, (name, await resp.text())
        ours[name] = await read_events(resp) if body.get("stream") else [await resp.json()]
        cases.append(_case(name, body, ledger.requests[-1]))
    results = run_driver(vllm_python, "vllm_serving_driver", {"cases": cases}, tmp_path)
    _assert_equal(ours, results)
    _assert_parsed(vllm_python, ours, tmp_path)


@pytest.mark.slow  # two more starts of vLLM's code; chat's hermes calls run in every run
async def test_function_calls_equal_vllms_with_the_hermes_parser(
    vllm_python, start_gateway, start_ledger, tmp_path
):
    """A message and two function_call items read by the hermes parser, whole and streamed
    (vLLM's OpenAIServingResponses with --enable-auto-tool-choice --tool-call-parser hermes)."""
    folder = tool_tokenizer(tmp_path, "hermes")
    tokenizer = HFTokenizer(folder)
    calls: list[tuple[str, dict[str, Any]]] = [
        ("get_weather", {"city": "Zürich", "days": 2}),
        ("get_time", {"zone": "UTC"}),
    ]
    ids = tokenizer.encode(FORMATS["hermes"].call_text(calls, "Checking. "),
                           add_special_tokens=False)  # fmt: skip
    script = Script(ids=ids, eos=1)
    ledger = await start_ledger(script, model_name=MODEL, vocab_size=320, max_model_len=4096)
    client = await start_gateway(model=str(folder), tool_call_parser="hermes",
                                 enable_auto_tool_choice=True)  # fmt: skip
    tools = [
        {"type": "function", "name": name, "parameters": {"type": "object"}}
        for name in ("get_weather", "get_time")
    ]
    ours: dict[str, list[Any]] = {}
    cases = []
    for stream in (False, True):
        name = f"hermes-{'stream' if stream else 'whole'}"
        body = {"model": MODEL, "input": "Weather?", "tools": tools, "stream": stream}
        resp = await client.post("/v1/responses", json=body)
        assert resp.status == 200, await resp.text()
        ours[name] = await read_events(resp) if stream else [await resp.json()]
        request = ledger.requests[-1]
        cases.append({
            "name": name, "request": body, "kind": "responses", "prompt": None,
            "prompt_token_ids": request.prompt_token_ids, "num_cached_tokens": 0,
            "default_max_tokens": 4096 - len(request.prompt_token_ids),
            "steps": _checkpoint_steps(ids, tokenizer), "tool_parser": "hermes",
            "tokenizer": str(folder),
        })  # fmt: skip
    results = run_driver(vllm_python, "vllm_serving_driver", {"cases": cases}, tmp_path)
    _assert_equal(ours, results)
    whole = ours["hermes-whole"][0]["output"]
    assert [item["type"] for item in whole] == ["message", "function_call", "function_call"]
    _assert_parsed(vllm_python, ours, tmp_path)


def _case(name: str, body: dict[str, Any], request: GenerateRequest) -> dict[str, Any]:
    """The driver's case: the body and the engine outputs the fake ledger sent for it."""
    steps = []
    for out in outputs_for(request, SCRIPT):
        shown = [t for t in out.new_token_ids if t != EOS]  # vLLM shows no EOS text either
        steps.append({
            "index": 0, "text": TOKENIZER.decode(shown), "token_ids": out.new_token_ids,
            "finish_reason": out.finish_reason, "stop_reason": None,
            "logprobs": None if out.logprobs is None else [_entry(e) for e in out.logprobs],
        })  # fmt: skip
    return {
        "name": name, "kind": "responses", "request": body, "prompt": None,
        "prompt_token_ids": request.prompt_token_ids, "num_cached_tokens": SCRIPT.cached_tokens,
        "default_max_tokens": MAX_MODEL_LEN - len(request.prompt_token_ids), "steps": steps,
        "tokenizer": "bytes",
    }  # fmt: skip


def _checkpoint_steps(ids: list[int], tokenizer: HFTokenizer) -> list[dict[str, Any]]:
    """vLLM's detokenizer over a checkpoint's ids: one delta per token, specials shown, then
    the EOS."""
    steps, shown = [], ""
    for i in range(len(ids)):
        now = tokenizer.decode(ids[: i + 1], skip_special_tokens=False)
        steps.append({"index": 0, "text": now[len(shown) :], "token_ids": [ids[i]]})
        shown = now
    steps.append({"index": 0, "text": "", "token_ids": [1], "finish_reason": "stop"})
    return steps


def _assert_equal(ours: dict[str, list[Any]], results: dict[str, Any]) -> None:
    differences = []
    for result in results["results"]:
        name = result["name"]
        assert "error" not in result, f"{name}: vLLM's code failed:\n{result['error']}"
        mine, theirs = _normal(ours[name]), _normal(result["bodies"])
        if mine != theirs:
            differences.append(f"{name}:\n{_first_difference(mine, theirs)}")
    assert differences == [], "\n".join(differences)


def _normal(value: Any) -> Any:
    """Nulls dropped, ids and timestamps set aside, at any depth."""
    value = _drop_nulls(value)
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items() if k not in IDS}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    return value


def _first_difference(mine: Any, theirs: Any, path: str = "$") -> str:
    """Where the two first part, with both sides there."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for key in sorted(set(mine) | set(theirs)):
            if mine.get(key) != theirs.get(key):
                return _first_difference(mine.get(key), theirs.get(key), f"{path}.{key}")
    if isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            if a != b:
                return _first_difference(a, b, f"{path}[{i}]")
    if isinstance(mine, list) and isinstance(theirs, list):
        ours, vllm = (
            [e.get("type") for e in side if isinstance(e, dict)] for side in (mine, theirs)
        )
        return f"  {path}: {len(mine)} vs {len(theirs)} entries\n  ours {ours}\n  vllm {vllm}"
    return f"  {path}:\n    ours {str(mine)[:600]}\n    vllm {str(theirs)[:600]}"


# vLLM streams openai's event models, with its own ResponsesResponse in the four that carry one.
VLLM_RESPONSES = "vllm.entrypoints.openai.responses.protocol"
EVENT_MODELS = {
    "response.created": f"{VLLM_RESPONSES}:ResponseCreatedEvent",
    "response.in_progress": f"{VLLM_RESPONSES}:ResponseInProgressEvent",
    "response.completed": f"{VLLM_RESPONSES}:ResponseCompletedEvent",
    "response.incomplete": f"{VLLM_RESPONSES}:ResponseIncompleteEvent",
    "response.output_item.added": "openai.types.responses:ResponseOutputItemAddedEvent",
    "response.output_item.done": "openai.types.responses:ResponseOutputItemDoneEvent",
    "response.content_part.added": "openai.types.responses:ResponseContentPartAddedEvent",
    "response.content_part.done": "openai.types.responses:ResponseContentPartDoneEvent",
    "response.output_text.delta": "openai.types.responses:ResponseTextDeltaEvent",
    "response.output_text.done": "openai.types.responses:ResponseTextDoneEvent",
    "response.function_call_arguments.delta":
        "openai.types.responses:ResponseFunctionCallArgumentsDeltaEvent",
    "response.function_call_arguments.done":
        "openai.types.responses:ResponseFunctionCallArgumentsDoneEvent",
}  # fmt: skip


# Keys vLLM itself sends that the event's model does not declare: its function_call_arguments
# .done event repeats the function's name (openai's model has no such field; its extra is kept).
VLLM_EXTRAS = {"response.function_call_arguments.done": ["$.name"]}


def _assert_parsed(vllm_python: Path, ours: dict[str, list[Any]], tmp_path: Path) -> None:
    checks, extras = [], {}
    for name, bodies in ours.items():
        for i, body in enumerate(bodies):
            model = f"{VLLM_RESPONSES}:ResponsesResponse"
            if "sequence_number" in body:
                model = EVENT_MODELS[body["type"]]
                extras[f"{name}[{i}]"] = VLLM_EXTRAS.get(body["type"], [])
            checks.append({"name": f"{name}[{i}]", "body": body, "model": model})
    parsed = run_driver(vllm_python, "api_protocol_driver", {"cases": checks}, tmp_path)
    problems = [f"{r['name']}: {r['error'] or r['undeclared']}" for r in parsed["results"]
                if r["error"] or r["undeclared"] != extras.get(r["name"], [])]  # fmt: skip
    assert problems == [], "\n".join(problems)
