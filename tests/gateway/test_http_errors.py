"""Bad input and refusals through real HTTP: each answers a clear status with an OpenAI-style
error body naming the field; none of them reaches the ledger."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.gateway.fake_ledger import Script
from tests.gateway.helpers import assert_error

CHAT = [{"role": "user", "content": "Hi"}]

# (route, body, param, fragment of the message)
BAD_INPUT: list[tuple[str, dict[str, Any], str | None, str]] = [
    ("completions", {}, "prompt", "'prompt' is required"),
    ("completions", {"prompt": 5}, "prompt", "string or a list of token ids"),
    ("completions", {"prompt": {"text": "hi"}}, "prompt", "string or a list of token ids"),
    ("completions", {"prompt": []}, "prompt", "must not be empty"),
    ("completions", {"prompt": ["a", []]}, "prompt", "'prompt[1]' must not be empty"),
    ("completions", {"prompt": [1, "a"]}, "prompt", "'prompt[1]'"),
    ("completions", {"prompt": [3, -1]}, "prompt", "non-negative integer token id"),
    ("completions", {"prompt": [300]}, "prompt", "out of the vocabulary (ids 0..257)"),
    ("completions", {"prompt": "x", "stop_token_ids": [258]}, "stop_token_ids", "vocabulary"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
    ("completions", {"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens", ">= 0"),
    ("completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens", "must be an integer"),
    ("completions", {"prompt": "x", "temperature": 2.5}, "temperature", "at most 2.0"),
    ("completions", {"prompt": "x", "temperature": "hot"}, "temperature", "must be a number"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p", "greater than 0.0"),
    ("completions", {"prompt": "x", "top_p": 1.5}, "top_p", "at most 1.0"),
    ("completions", {"prompt": "x", "top_k": -2}, "top_k", "between -1 and"),
    ("completions", {"prompt": "x", "top_k": 2**70}, "top_k", "between -1 and"),
    ("completions", {"prompt": "x", "seed": 2**64}, "seed", "between"),
    ("completions", {"prompt": "x", "n": 0}, "n", "between 1 and 16384"),
    ("completions", {"prompt": "x", "n": 3, "best_of": 2}, "best_of", "greater than or equal to n"),
    ("completions", {"prompt": "x", "best_of": 2, "stream": True}, "best_of", "cannot be streamed"),
    ("completions", {"prompt": ["x"] * 3, "n": 6000}, "n", "make 18000 sequences"),
    ("completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ("completions", {"prompt": "x", "stop": [""]}, "stop", "must not be empty"),
    ("completions", {"prompt": "x", "stop": 7}, "stop", "string or a list of strings"),
    ("completions", {"prompt": "x", "ignore_eos": "yes"}, "ignore_eos", "must be a boolean"),
    ("completions", {"prompt": "x", "min_tokens": 20}, "min_tokens", "must not exceed"),
    ("completions", {"prompt": "x", "stream_options": {}}, "stream_options", "'stream' is true"),
    ("completions", {"prompt": "x", "cache_salt": ""}, "cache_salt", "non-empty string"),
    ("completions", {"prompt": "x", "priority": 1.5}, "priority", "must be an integer"),
    ("completions", {"prompt": "x", "return_token_ids": 1}, "return_token_ids", "boolean"),
    ("completions", {"prompt": "x", "priority": 1}, "priority", "--scheduling-policy fcfs"),
    ("completions", {"prompt": "x", "guided_json": {}}, "guided_json", "removed in vLLM"),
    ("completions", {"prompt": "x", "frobnicate": 1}, "frobnicate", "unknown field"),
    ("completions", {"prompt": "x", "stream": True, "stream_options": {"x": 1}},
     "stream_options.x", "unknown field"),
    ("chat/completions", {"messages": CHAT, "chat_template": "{{ 1 }}"}, "chat_template",
     "--trust-request-chat-template"),
    ("chat/completions", {"messages": CHAT, "add_generation_prompt": True,
                          "continue_final_message": True}, "continue_final_message",
     "Cannot set both"),
    ("completions", {"prompt": "x", "logprobs": 21}, "logprobs", "max allowed: 20"),
    ("completions", {"prompt": "x", "max_tokens": 63}, "max_tokens",
     "This model's maximum context length is 64 tokens. However, you requested 65 tokens "
     "(2 in the messages, 63 in the completion). Please reduce the length of the messages or "
     "completion."),
    ("completions", {"prompt": "y" * 70}, "prompt", "maximum context length is 64 tokens"),
    ("chat/completions", {}, "messages", "non-empty list"),
    ("chat/completions", {"messages": ["hi"]}, "messages[0]", "'role' and 'content'"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role",
     "must be one of"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "string or a list of text parts"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]", "only text"),
    ("chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs", "must be a boolean"),
    ("completions", {"prompt": "\ud800abc"}, "prompt", "lone UTF-16 surrogate"),
    ("completions", {"prompt": ["ok", "a\udfff"]}, "prompt[1]", "lone UTF-16 surrogate"),
    ("completions", {"prompt": "x", "stop": ["\ud800"]}, "stop[0]", "lone UTF-16 surrogate"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800abc"}]},
     "messages[0].content", "lone UTF-16 surrogate"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "\udc00"}]}]}, "messages[0].content[0].text", "surrogate"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0},
     "max_completion_tokens", ">= 1"),
    ("chat/completions", {"messages": CHAT, "max_tokens": 100}, "max_tokens",
     "maximum context length is 64 tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "param", "fragment"), BAD_INPUT)
async def test_bad_input_gets_400_naming_the_field(
    start_gateway, start_ledger, route, body, param, fragment
):
    ledger = await start_ledger()
    client = await start_gateway()
    resp = await client.post(f"/v1/{route}", json=body)
    assert resp.status == 400
    body = await resp.json()
    assert_error(body, param, fragment)
    assert body["error"]["type"] == "BadRequestError"  # vLLM 0.33's type
    assert ledger.requests == []


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe"])
async def test_a_body_that_is_not_a_json_object_gets_400(start_gateway, raw):
    client = await start_gateway()
    resp = await client.post("/v1/completions", data=raw)
    assert resp.status == 400
    assert_error(await resp.json(), None, "request body")


async def test_an_unknown_model_gets_404_naming_model(start_gateway, start_ledger):
    await start_ledger()
    client = await start_gateway()
    resp = await client.post("/v1/completions", json={"prompt": "x", "model": "gpt-9"})
    assert resp.status == 404
    assert_error(await resp.json(), "model", "The model `gpt-9` does not exist.")
    resp = await client.post(
        "/v1/completions", json={"prompt": "x", "model": "fake-model", "max_tokens": 1}
    )
    assert resp.status == 200


async def test_an_unknown_model_is_vllms_not_found_error_on_every_route(
    start_gateway, start_ledger
):
    await start_ledger()
    client = await start_gateway()
    expected = {
        "message": "The model `gpt-9` does not exist. Valid aliases: fake-model.",
        "type": "NotFoundError", "param": "model", "code": 404,
    }  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for route, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", chat),
        ("/v1/responses", {"input": "x"}),
        ("/tokenize", {"prompt": "x"}),
        ("/detokenize", {"tokens": [1]}),
    ):
        resp = await client.post(route, json=body | {"model": "gpt-9"})
        assert (resp.status, await resp.json()) == (404, {"error": expected}), route
    resp = await client.get("/v1/models/gpt-9")
    assert (resp.status, await resp.json()) == (404, {"error": expected})


async def test_the_ledgers_limits_win_over_the_config(start_gateway, start_ledger):
    await start_ledger(max_model_len=32, vocab_size=200)
    client = await start_gateway(max_model_len=4096)
    resp = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 32})
    assert_error(await resp.json(), "max_tokens", "maximum context length is 32 tokens")
    resp = await client.post("/v1/completions", json={"prompt": [199, 200]})
    assert_error(
        await resp.json(),
        "prompt",
        "token id 200 in 'prompt' is out of the vocabulary (ids 0..199)",
    )


async def test_an_oversized_body_gets_413(start_gateway, start_ledger):
    ledger = await start_ledger()
    client = await start_gateway(max_body_bytes=1024)
    resp = await client.post("/v1/completions", json={"prompt": "x" * 2000})
    assert resp.status == 413
    assert_error(await resp.json(), None, "larger than the limit of 1024 bytes")
    assert ledger.requests == []


async def test_a_full_gateway_answers_429_with_retry_after(start_gateway, start_ledger):
    ledger = await start_ledger(Script(delay_s=0.1))
    client = await start_gateway(max_queue=1)
    first_task = asyncio.ensure_future(
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    )
    await ledger.wait_for_requests(1)
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert resp.status == 429
    assert resp.headers["Retry-After"] == "1"
    body = await resp.json()
    assert_error(body, None, "max_queue=1")
    assert body["error"]["type"] == "Too Many Requests"
    done = await first_task
    assert done.status == 200
    assert (await done.json())["choices"][0]["text"] == "Hel"
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert resp.status == 200  # the slot is free again
    assert len(ledger.requests) == 2


async def test_api_key_is_required_on_v1_when_set(start_gateway, start_ledger, no_api_key):
    no_api_key.setenv("KVLEDGER_API_KEY", "s3cret-key")
    await start_ledger()
    client = await start_gateway()
    body = {"prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"}):
        resp = await client.post("/v1/completions", json=body, headers=headers)
        assert resp.status == 401, headers
        assert resp.headers["WWW-Authenticate"] == "Bearer"
        assert (await resp.json())["error"]["type"] == "Unauthorized"
    resp = await client.get("/v1/models")
    assert resp.status == 401
    ok = {"Authorization": "Bearer s3cret-key"}
    resp = await client.post("/v1/completions", json=body, headers=ok)
    assert resp.status == 200
    assert (await client.get("/v1/models", headers=ok)).status == 200
    assert (await client.get("/health")).status == 200  # probes need no key
    # As vLLM, which guards only /v1: the utility routes need no key either.
    assert (await client.post("/tokenize", json={"prompt": "hi"})).status == 200
    assert (await client.post("/detokenize", json={"tokens": [104, 105]})).status == 200


async def test_no_ledger_gets_503_after_waiting(start_gateway):
    client = await start_gateway(ledger_wait_s=0.2)
    resp = await client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status == 503
    body = await resp.json()
    assert_error(body, None, "no ledger is running")
    assert body["error"]["type"] == "ServiceUnavailableError"


async def test_a_ledger_without_workers_gets_503_after_waiting(start_gateway, start_ledger):
    ledger = await start_ledger(num_workers=0)
    client = await start_gateway(ledger_wait_s=0.2)
    resp = await client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status == 503
    assert_error(await resp.json(), None, "the ledger is running but has no worker")
    assert ledger.requests == []


async def test_a_ledger_that_comes_up_while_waiting_serves_the_request(start_gateway, start_ledger):
    client = await start_gateway(ledger_wait_s=3.0)
    pending = asyncio.ensure_future(
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    )
    await asyncio.sleep(0.3)
    assert not pending.done()
    await start_ledger()
    resp = await pending
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["text"] == "He"


async def test_unknown_routes_get_404_and_wrong_methods_405(start_gateway):
    client = await start_gateway()
    resp = await client.get("/v1/nothing-here")
    assert resp.status == 404
    body = await resp.json()
    assert_error(body, None, "no route GET /v1/nothing-here")
    assert body["error"]["type"] == "NotFoundError"
    resp = await client.get("/v1/completions")
    assert resp.status == 405
    assert "POST" in resp.headers["Allow"]
    body = await resp.json()
    assert_error(body, None, "use POST")
    assert body["error"]["type"] == "Method Not Allowed"  # the phrase, as vLLM's handler


async def test_an_authorization_header_that_is_not_utf8_gets_401(
    start_gateway, start_ledger, no_api_key
):
    no_api_key.setenv("KVLEDGER_API_KEY", "s3cret-key")
    await start_ledger()
    client = await start_gateway()
    body = b'{"prompt": "x", "max_tokens": 1}'
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer \xff\xfe\xc3(\r\nConnection: close\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    await writer.drain()
    reply = await reader.read()
    writer.close()
    status_line = reply.split(b"\r\n", 1)[0]
    assert status_line.split()[1] == b"401", reply[:300]
    assert b'"type": "Unauthorized"' in reply
