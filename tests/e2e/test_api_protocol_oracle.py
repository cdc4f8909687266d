"""API compatibility against vLLM 0.33 itself: the answers of the real gateway, ledger and worker
(whole responses, every streamed chunk, errors, models, tokenize) are parsed by vLLM's own
OpenAI protocol models in vLLM's venv (KVLEDGER_VLLM_ORACLE), and every key they do not declare
is reported. Skipped without the venv (failed when KVLEDGER_ORACLE_REQUIRED=1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.gateway.helpers import read_sse
from tests.harness.gateway_stack import gateway_on
from tests.harness.stack import Stack
from tests.oracle.conftest import require_vllm_python, run_driver

pytestmark = pytest.mark.oracle

COMPLETION = "vllm.entrypoints.openai.completion.protocol"
CHAT = "vllm.entrypoints.openai.chat_completion.protocol"
ENGINE = "vllm.entrypoints.serve.engine.protocol"
TOKENIZE = "vllm.entrypoints.serve.tokenize.protocol"
MESSAGES = [{"role": "user", "content": "Name a colour."}]

# (name, route, body, vLLM's model of the answer: a whole body, or each streamed chunk)
REQUESTS: list[tuple[str, str, dict[str, Any], str]] = [
    ("completion", "/v1/completions", {"prompt": "The KV", "max_tokens": 5}, "CompletionResponse"),
    ("completion_logprobs_echo", "/v1/completions",
     {"prompt": "The KV", "max_tokens": 4, "logprobs": 2, "echo": True, "prompt_logprobs": 1,
      "return_token_ids": True, "temperature": 0.0}, "CompletionResponse"),
    ("completion_n_batch", "/v1/completions",
     {"prompt": ["a", [256, 98]], "max_tokens": 3, "n": 2, "seed": 1}, "CompletionResponse"),
    ("completion_best_of", "/v1/completions",
     {"prompt": "b", "max_tokens": 3, "n": 1, "best_of": 2, "seed": 1}, "CompletionResponse"),
    ("completion_structured", "/v1/completions",
     {"prompt": "x", "max_tokens": 8, "structured_outputs": {"choice": ["red", "blue"]}},
     "CompletionResponse"),
    ("completion_stream", "/v1/completions",
     {"prompt": "The KV", "max_tokens": 4, "stream": True, "logprobs": 1,
      "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "CompletionStreamResponse"),
    ("chat", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5}, "ChatCompletionResponse"),
    ("chat_logprobs", "/v1/chat/completions",
     {"messages": MESSAGES, "max_tokens": 4, "logprobs": True, "top_logprobs": 2,
      "return_token_ids": True, "n": 2, "seed": 3}, "ChatCompletionResponse"),
    ("chat_json", "/v1/chat/completions",
     {"messages": MESSAGES, "max_tokens": 60, "response_format": {"type": "json_object"},
      "structured_outputs": {"disable_any_whitespace": True}}, "ChatCompletionResponse"),
    ("chat_stream", "/v1/chat/completions",
     {"messages": MESSAGES, "max_tokens": 4, "stream": True, "logprobs": True, "top_logprobs": 1,
      "stream_options": {"include_usage": True}}, "ChatCompletionStreamResponse"),
    ("chat_stream_continuous_usage", "/v1/chat/completions",
     {"messages": MESSAGES, "max_tokens": 3, "stream": True,
      "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "ChatCompletionStreamResponse"),
    ("completion_score", "/v1/completions",
     {"prompt": [[256, 72, 105], [256, 66]], "max_tokens": 0, "echo": True, "logprobs": 1,
      "temperature": 0, "seed": 1234}, "CompletionResponse"),
    ("completion_score_stream", "/v1/completions",
     {"prompt": "Hi", "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True},
     "CompletionStreamResponse"),
    ("error", "/v1/completions", {"prompt": "x", "temperature": 9}, "ErrorResponse"),
    ("error_model", "/v1/chat/completions", {"messages": MESSAGES, "model": "gpt-9"},
     "ErrorResponse"),
    ("tokenize", "/tokenize", {"prompt": "Hi", "return_token_strs": True}, "TokenizeResponse"),
    ("tokenize_chat", "/tokenize", {"messages": MESSAGES}, "TokenizeResponse"),
    ("detokenize", "/detokenize", {"tokens": [72, 105]}, "DetokenizeResponse"),
]  # fmt: skip
STATUS = {"error": 400, "error_model": 404}
ERROR_TYPES = {"error": "BadRequestError", "error_model": "NotFoundError"}  # vLLM 0.33's
MODULES = {
    "CompletionResponse": COMPLETION, "CompletionStreamResponse": COMPLETION,
    "ChatCompletionResponse": CHAT, "ChatCompletionStreamResponse": CHAT,
    "ErrorResponse": ENGINE, "ModelList": ENGINE,
    "TokenizeResponse": TOKENIZE, "DetokenizeResponse": TOKENIZE,
}  # fmt: skip


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    return require_vllm_python()


async def test_vllms_protocol_models_parse_every_answer(
    vllm_python, redis_url, tiny_model, tmp_path
):
    cases = await _answers(redis_url, tiny_model)
    assert len(cases) > len(REQUESTS)  # the streams gave several chunks each
    results = run_driver(vllm_python, "api_protocol_driver", {"cases": cases}, tmp_path)["results"]
    assert [r["name"] for r in results] == [c["name"] for c in cases]
    failures = [f"{r['name']}: {r['error']}" for r in results if r["error"]]
    assert failures == [], "\n".join(failures)
    extra = [f"{r['name']}: {path}" for r in results for path in r["undeclared"]]
    assert extra == [], "keys vLLM's models do not declare:\n" + "\n".join(extra)


async def _answers(redis_url, tiny_model) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    stack = await Stack(redis_url, tiny_model, num_blocks=128).start()
    try:
        async with gateway_on(stack) as client:
            models = await client.get("/v1/models")
            cases.append(_case("models", "ModelList", await models.json()))
            for name, route, body, model in REQUESTS:
                resp = await client.post(route, json=body)
                assert resp.status == STATUS.get(name, 200), name
                if body.get("stream"):
                    events = await read_sse(resp)
                    assert events[-1] == "[DONE]"
                    cases += [_case(f"{name}[{i}]", model, e) for i, e in enumerate(events[:-1])]
                else:
                    answer = await resp.json()
                    if name in ERROR_TYPES:
                        assert answer["error"]["type"] == ERROR_TYPES[name], answer
                    cases.append(_case(name, model, answer))
    finally:
        await stack.stop()
    return cases


def _case(name: str, model: str, body: Any) -> dict[str, Any]:
    return {"name": name, "model": f"{MODULES[model]}:{model}", "body": body}
