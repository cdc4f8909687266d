"""Structured outputs through the real gateway, ledger and worker on the seeded tiny model: the
answers of response_format and structured_outputs are valid against their schema, regex, choice
or grammar, greedy and seeded, streamed or not, with n > 1, and through preemption."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance

from services.tokenization.tokenizer import ByteTokenizer
from services.wire.messages import StructuredOutput
from tests.gateway.helpers import read_sse
from tests.harness.gateway_stack import gateway_on
from tests.harness.stack import Stack

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Give me a record."}]
GREEDY_AND_SEEDED = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 4}]


async def test_json_schema_regex_choice_and_grammar_answers_are_valid(redis_url, tiny_model):
    stack = await Stack(redis_url, tiny_model, num_blocks=128, max_model_len=512).start()
    try:
        async with gateway_on(stack) as client:
            for sampling in GREEDY_AND_SEEDED:
                texts = await _texts(
                    client,
                    "/v1/chat/completions",
                    {
                        "messages": CHAT,
                        "max_tokens": 300,
                        **sampling,
                        "response_format": {
                            "type": "json_schema",
                            "json_schema": {"name": "record", "schema": SCHEMA},
                        },
                        # The random model likes newlines: free whitespace would run to max_tokens.
                        "structured_outputs": {"disable_any_whitespace": True},
                    },
                )
                jsonschema.validate(json.loads(texts[0]), SCHEMA)
                (text,) = await _texts(
                    client,
                    "/v1/completions",
                    {
                        "prompt": "JSON:",
                        "max_tokens": 200,
                        **sampling,
                        "structured_outputs": {"json_object": True, "disable_any_whitespace": True},
                    },
                )
                assert isinstance(json.loads(text), dict) and text.startswith("{")
                (plate,) = await _texts(
                    client,
                    "/v1/completions",
                    {"prompt": "Plate:", "max_tokens": 20, **sampling,
                     "structured_outputs": {"regex": r"[A-Z]{2}-\d{3}"}},
                )  # fmt: skip
                assert re.fullmatch(r"[A-Z]{2}-\d{3}", plate), plate
                greeting = await _texts(
                    client,
                    "/v1/completions",
                    {"prompt": "Say:", "max_tokens": 20, **sampling,
                     "structured_outputs": {"grammar": 'start: ("hi" | "hello") " " /[a-z]{2,5}/'}},
                )  # fmt: skip
                assert re.fullmatch(r"(hi|hello) [a-z]{2,5}", greeting[0]), greeting
    finally:
        await stack.stop()


async def test_choice_with_n_and_streaming(redis_url, tiny_model):
    choices = ["yes", "no", "maybe later"]
    stack = await Stack(redis_url, tiny_model, num_blocks=128).start()
    try:
        async with gateway_on(stack) as client:
            texts = await _texts(
                client,
                "/v1/completions",
                {"prompt": "Answer:", "max_tokens": 16, "n": 4, "temperature": 1.0, "seed": 1,
                 "structured_outputs": {"choice": choices}},
            )  # fmt: skip
            assert len(texts) == 4 and all(t in choices for t in texts), texts
            for sampling in GREEDY_AND_SEEDED:
                resp = await client.post(
                    "/v1/chat/completions",
                    json={"messages": CHAT, "max_tokens": 20, "stream": True, **sampling,
                          "structured_outputs": {"regex": r"\d{4}-\d{2}"}},
                )  # fmt: skip
                assert resp.status == 200, await resp.text()
                events = await read_sse(resp)
                deltas = [e["choices"][0]["delta"].get("content") or "" for e in events[:-1]]
                streamed = "".join(deltas)
                assert re.fullmatch(r"\d{4}-\d{2}", streamed), streamed
                assert events[-2]["choices"][0]["finish_reason"] == "stop"
    finally:
        await stack.stop()


async def test_preempted_requests_resume_their_grammar(redis_url, tiny_model):
    # 23 lendable blocks of 16 and requests of up to 7 blocks: preemptions are certain.
    stack = await Stack(
        redis_url, tiny_model, num_blocks=24, max_model_len=112, max_num_batched_tokens=256
    ).start()
    tok = ByteTokenizer()
    grammar = llguidance.LLMatcher.grammar_from_regex(r"(ab|cd){20,40}")
    structured = StructuredOutput(kind="regex", grammar=grammar)
    try:
        ids = [f"r{i}" for i in range(8)]
        for i, req_id in enumerate(ids):
            prompt = tok.encode(f"{i}: " + "z" * 50)
            await stack.submit(
                req_id, prompt, 40, temperature=1.0, seed=i, structured=structured,
                eos_token_id=tok.EOS_ID,
            )  # fmt: skip
        results = await stack.wait(ids, timeout=120)
        assert stack.ledger.scheduler.num_preemptions > 0
        preempted = [r for r in results.values() if r.final.num_preemptions > 0]
        assert preempted
        for r in results.values():
            text = tok.decode(r.tokens)
            assert re.fullmatch(r"(ab|cd){20}", text), text
    finally:
        await stack.stop()


async def test_a_grammar_that_never_ends_finishes_with_length_and_text_it_accepts(
    redis_url, tiny_model
):
    # No string ends `start: "a" start`: the answer is max_tokens of it, finish_reason
    # "length", streamed or not, never "stop" after text the grammar refuses.
    stack = await Stack(redis_url, tiny_model, num_blocks=64).start()
    grammar = 'start: "a" start'
    try:
        async with gateway_on(stack) as client:
            for sampling in GREEDY_AND_SEEDED:
                body = {"prompt": "Say:", "max_tokens": 24, **sampling,
                        "structured_outputs": {"grammar": grammar}}  # fmt: skip
                resp = await client.post("/v1/completions", json=body)
                payload = await resp.json()
                assert resp.status == 200, payload
                choice = payload["choices"][0]
                assert (choice["text"], choice["finish_reason"]) == ("a" * 24, "length"), choice
                resp = await client.post("/v1/completions", json={**body, "stream": True})
                events = await read_sse(resp)
                streamed = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
                finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
                assert streamed == "a" * 24 and finishes[-1] == "length", events[-3:]
    finally:
        await stack.stop()


async def _texts(client, route: str, body: dict) -> list[str]:
    resp = await client.post(route, json=body)
    payload = await resp.json()
    assert resp.status == 200, payload
    choices = sorted(payload["choices"], key=lambda c: c["index"])
    if route.endswith("chat/completions"):
        return [c["message"]["content"] for c in choices]
    return [c["text"] for c in choices]
