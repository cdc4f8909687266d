"""Completions and chat through real HTTP, a real redis-server and the fake ledger: whole and
streamed bodies, usage, token ids, EOS, stop strings, repeats and gaps from the ledger."""

from __future__ import annotations

import pytest

from services.tokenization.tokenizer import BYTE_CHAT_TEMPLATE, ByteTokenizer, render_chat_template
from services.wire.messages import AbortRequest, GenerateRequest
from tests.gateway.fake_ledger import EOS, TEXT, Script, request_stream
from tests.gateway.helpers import GATEWAY_ID, read_sse

BOS = ByteTokenizer.BOS_ID


async def test_completion_returns_text_usage_and_cached_tokens(start_gateway, start_ledger):
    ledger = await start_ledger(Script(cached_tokens=16))
    client = await start_gateway()
    resp = await client.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 5})
    assert resp.status == 200
    body = await resp.json()
    assert body["id"].startswith("cmpl-") and len(body["id"]) == len("cmpl-") + 32
    assert body["object"] == "text_completion"
    assert body["model"] == "fake-model"
    (choice,) = body["choices"]
    assert choice["text"] == TEXT[:5]
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 9,  # BOS + 8 bytes
        "completion_tokens": 5,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 16},
    }
    (req,) = ledger.requests
    assert req.req_id == body["id"]
    assert req.gateway_id == GATEWAY_ID
    assert req.prompt_token_ids == [BOS, *b"Hi there"]
    assert req.sampling.max_tokens == 5
    assert req.sampling.eos_token_id == EOS
    assert req.sampling.temperature == 1.0


async def test_completion_request_carries_sampling_salt_and_priority(
    start_gateway, start_ledger, redis, prefix
):
    await start_ledger(scheduling_policy="priority")
    client = await start_gateway()
    resp = await client.post(
        "/v1/completions",
        json={
            "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 4,
            "seed": 11, "min_tokens": 2, "stop_token_ids": [42], "ignore_eos": True,
            "cache_salt": "tenant-a", "priority": -3,
        },
    )  # fmt: skip
    assert resp.status == 200
    (req,) = await request_stream(redis, prefix)
    assert isinstance(req, GenerateRequest)
    assert req.prompt_token_ids == [5, 6, 7]
    assert (req.cache_salt, req.priority) == ("tenant-a", -3)
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.5, 0.9, 4, 11)
    assert (s.max_tokens, s.min_tokens, s.stop_token_ids, s.eos_token_id) == (3, 2, [42], None)
    assert req.arrival_time > 0


async def test_streamed_completion_is_openai_sse_with_usage_and_done(start_gateway, start_ledger):
    await start_ledger(Script(chunk=2))
    client = await start_gateway()
    resp = await client.post(
        "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 6, "stream": True,
              "stream_options": {"include_usage": True}},
    )  # fmt: skip
    assert resp.status == 200
    events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    *chunks, usage, _ = events
    assert [c["choices"][0]["text"] for c in chunks] == ["He", "ll", "o "]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert {c["id"] for c in chunks} == {usage["id"]} and usage["id"].startswith("cmpl-")
    assert all(c["object"] == "text_completion" for c in chunks)
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["prompt_tokens"] == 3


async def test_chat_completion_uses_the_template_and_fills_max_tokens(start_gateway, start_ledger):
    ledger = await start_ledger(Script(eos_after=4), max_model_len=64)
    client = await start_gateway()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    resp = await client.post("/v1/chat/completions", json={"messages": messages})
    assert resp.status == 200
    body = await resp.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": TEXT[:4]}
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] is None  # EOS, as vLLM reports it
    (req,) = ledger.requests
    prompt = [BOS, *render_chat_template(BYTE_CHAT_TEMPLATE, messages, {}).encode()]
    assert req.prompt_token_ids == prompt
    assert req.sampling.max_tokens == 64 - len(prompt)  # what the context leaves, as vLLM
    assert body["usage"]["completion_tokens"] == 5  # the EOS counts, though it shows no text


async def test_streamed_chat_sends_role_first_then_content_and_finish(start_gateway, start_ledger):
    await start_ledger()
    client = await start_gateway()
    resp = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 3,
              "stream": True},
    )  # fmt: skip
    events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    first, *rest, _ = events
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"] for c in rest] == [
        {"content": "H"}, {"content": "e"}, {"content": "l"},
    ]  # fmt: skip
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in events[:-1])


async def test_return_token_ids_for_a_token_prompt_gives_exactly_the_generated_ids(
    start_gateway, start_ledger
):
    await start_ledger(Script(eos_after=3))
    client = await start_gateway()
    resp = await client.post(
        "/v1/completions", json={"prompt": [72, 105], "max_tokens": 8, "return_token_ids": True}
    )
    choice = (await resp.json())["choices"][0]
    assert choice["prompt_token_ids"] == [72, 105]
    assert choice["token_ids"] == [*TEXT[:3].encode(), EOS]
    assert choice["text"] == TEXT[:3]

    resp = await client.post(
        "/v1/completions",
        json={"prompt": [72, 105], "max_tokens": 8, "return_token_ids": True, "stream": True},
    )
    chunks = (await read_sse(resp))[:-1]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == [72, 105]
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    streamed = [i for c in chunks for i in c["choices"][0]["token_ids"]]
    assert streamed == [*TEXT[:3].encode(), EOS]


async def test_chat_return_token_ids_puts_the_prompts_beside_the_choices(
    start_gateway, start_ledger
):
    # vLLM's ChatCompletionResponse (and its first chunk) carry prompt_token_ids at the top.
    ledger = await start_ledger(Script(eos_after=3))
    client = await start_gateway()
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    body["return_token_ids"] = True
    reply = await (await client.post("/v1/chat/completions", json=body)).json()
    prompt = ledger.requests[0].prompt_token_ids
    assert reply["prompt_token_ids"] == prompt
    assert reply["choices"][0]["token_ids"] == [*TEXT[:3].encode(), EOS]
    assert "prompt_token_ids" not in reply["choices"][0]
    chunks = (
        await read_sse(await client.post("/v1/chat/completions", json=body | {"stream": True}))
    )[:-1]
    assert chunks[0]["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert all("prompt_token_ids" not in ch for c in chunks for ch in c["choices"])


async def test_stop_string_cuts_text_finishes_stop_and_aborts_on_the_ledger(
    start_gateway, start_ledger, redis, prefix
):
    ledger = await start_ledger(Script(delay_s=0.01))
    client = await start_gateway()
    resp = await client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 20, "stop": ["zzz", "the"]}
    )
    choice = (await resp.json())["choices"][0]
    assert choice["text"] == "Hello from "
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == "the"
    req_id = (await resp.json())["id"]
    abort = await ledger.wait_for_abort(req_id)
    assert abort.reason == "stop_string"
    on_stream = await request_stream(redis, prefix)
    assert AbortRequest(req_id, "stop_string") in on_stream


async def test_streamed_stop_string_never_leaks_into_chunks(start_gateway, start_ledger):
    ledger = await start_ledger(Script(delay_s=0.005))
    client = await start_gateway()
    resp = await client.post(
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 20, "stop": "fake", "stream": True},
    )
    events = await read_sse(resp)
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello from the "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-1] == "[DONE]"
    await ledger.wait_for_abort(chunks[0]["id"])


@pytest.mark.parametrize(
    "script",
    [
        Script(duplicate=True),
        Script(rerun_after=4),
        Script(swap_pairs=True),
        Script(chunk=3, duplicate=True, swap_pairs=True),
    ],
    ids=["duplicated", "rerun-from-zero", "out-of-order", "chunked-all"],
)
async def test_repeated_and_reordered_outputs_give_each_token_once(
    start_gateway, start_ledger, script
):
    await start_ledger(script)
    client = await start_gateway()
    resp = await client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 10, "return_token_ids": True}
    )
    choice = (await resp.json())["choices"][0]
    assert choice["text"] == TEXT[:10]
    assert choice["token_ids"] == list(TEXT[:10].encode())
    assert (await resp.json())["usage"]["completion_tokens"] == 10

    resp = await client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 10, "stream": True}
    )
    chunks = (await read_sse(resp))[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == TEXT[:10]


async def test_multibyte_characters_are_never_split(start_gateway, start_ledger):
    await start_ledger(Script(text="héllo ✓ "))
    client = await start_gateway()
    resp = await client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 10, "stream": True}
    )
    texts = [c["choices"][0]["text"] for c in (await read_sse(resp))[:-1]]
    assert "".join(texts) == "héllo ✓"
    assert all("\ufffd" not in t for t in texts)
