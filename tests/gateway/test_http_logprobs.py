"""Logprobs through real HTTP against the fake ledger: the fields go on the wire, the entries come
back in OpenAI's shapes (completions, chat, streamed and not) and vLLM's for prompt_logprobs,
and bad values get a 400 naming the field."""

from __future__ import annotations

import pytest

from services.tokenization.tokenizer import ByteTokenizer
from tests.gateway.fake_ledger import TEXT, fake_logprobs
from tests.gateway.helpers import assert_error, read_sse

BOS = ByteTokenizer.BOS_ID
CHAT = [{"role": "user", "content": "Hi"}]


async def _post(client, route: str, **body):
    resp = await client.post(route, json={"max_tokens": 5, **body})
    assert resp.status == 200, await resp.text()
    return await resp.json()


def _expected_chosen(n: int) -> list[float]:
    return [fake_logprobs(0, i, 0).logprobs[0] for i in range(n)]


async def test_completion_logprobs_have_openais_shape(start_gateway, start_ledger):
    ledger = await start_ledger()
    client = await start_gateway()
    body = await _post(client, "/v1/completions", prompt="Hi", logprobs=2)
    assert ledger.requests[0].sampling.logprobs == 2
    assert ledger.requests[0].sampling.prompt_logprobs is None
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == list(TEXT[:5])
    assert logprobs["token_logprobs"] == _expected_chosen(5)
    assert logprobs["text_offset"] == [0, 1, 2, 3, 4]
    first = logprobs["top_logprobs"][0]  # the chosen token first, then the top 2: 3 entries
    assert list(first) == ["H", "A", "B"] and first["H"] == -0.25
    assert "prompt_logprobs" not in body["choices"][0]


async def test_completion_echo_shows_the_prompts_logprobs_first(start_gateway, start_ledger):
    ledger = await start_ledger()
    client = await start_gateway()
    body = await _post(client, "/v1/completions", prompt="Hi", echo=True, logprobs=1)
    assert ledger.requests[0].sampling.prompt_logprobs == 1  # vLLM: echo asks for them
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["<s>", "H", "i", *TEXT[:5]]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"][:4] == [0, 3, 4, 5]
    prompt = choice["prompt_logprobs"]  # vLLM's shape: None, then {id: {logprob, rank, ...}}
    assert prompt[0] is None and len(prompt) == 3
    assert prompt[1][str(ord("H"))] == {"logprob": -0.5, "rank": 3, "decoded_token": "H"}
    assert list(prompt[1]) == [str(ord("H")), "65"]


async def test_echo_with_max_tokens_0_scores_the_prompt_alone(start_gateway, start_ledger):
    # vLLM's prompt scoring: the ledger samples one token (max_tokens 1), finishing after the
    # prefill; the answer is the prompt with its logprobs, the sampled token left out.
    ledger = await start_ledger()
    client = await start_gateway()
    body = await _post(client, "/v1/completions", prompt="Hi", echo=True, logprobs=1, max_tokens=0)
    sampling = ledger.requests[0].sampling
    assert (sampling.max_tokens, sampling.prompt_logprobs, sampling.logprobs) == (1, 1, 1)
    choice = body["choices"][0]
    assert choice["text"] == "Hi" and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["<s>", "H", "i"]
    assert logprobs["token_logprobs"] == [None, -0.5, -0.75]
    assert logprobs["text_offset"] == [0, 3, 4]
    assert logprobs["top_logprobs"] == [None, {"H": -0.5, "A": -0.1}, {"i": -0.75, "A": -0.1}]
    assert body["usage"]["completion_tokens"] == 1  # vLLM counts the sampled token
    resp = await client.post(
        "/v1/completions",
        json={"prompt": "Hi", "echo": True, "logprobs": 0, "max_tokens": 0, "stream": True},
    )
    chunk, done = await read_sse(resp)
    assert done == "[DONE]"
    (streamed,) = chunk["choices"]
    assert streamed["text"] == "Hi" and streamed["finish_reason"] == "length"
    assert streamed["prompt_token_ids"] == [BOS, *b"Hi"]  # vLLM sends them with the echo
    assert streamed["logprobs"]["token_logprobs"] == [None, -0.5, -0.75]


async def test_chat_logprobs_and_top_logprobs(start_gateway, start_ledger):
    ledger = await start_ledger()
    client = await start_gateway()
    body = await _post(client, "/v1/chat/completions", messages=CHAT, logprobs=True)
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == list(TEXT[:5])
    assert [c["logprob"] for c in content] == _expected_chosen(5)
    assert content[0]["bytes"] == [ord("H")] and content[0]["top_logprobs"] == []
    body = await _post(client, "/v1/chat/completions", messages=CHAT, logprobs=True, top_logprobs=2)
    assert ledger.requests[1].sampling.logprobs == 2
    top = body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    # vLLM's order: the chosen token, then the most likely ones, top_logprobs of them in all.
    assert [t["token"] for t in top] == ["H", "A"]
    plain = await _post(client, "/v1/chat/completions", messages=CHAT)
    assert plain["choices"][0]["logprobs"] is None
    assert ledger.requests[2].sampling.logprobs is None


async def test_chat_prompt_logprobs_sit_beside_the_choices(start_gateway, start_ledger):
    await start_ledger()
    client = await start_gateway()
    body = await _post(client, "/v1/chat/completions", messages=CHAT, prompt_logprobs=0)
    prompt = body["prompt_logprobs"]
    assert prompt[0] is None and all(len(p) == 1 for p in prompt[1:])
    assert "prompt_logprobs" not in body["choices"][0]


async def test_streamed_logprobs_cover_every_token_once(start_gateway, start_ledger):
    await start_ledger()
    client = await start_gateway()
    resp = await client.post(
        "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 6, "logprobs": 0, "stream": True, "stream_interval": 2},
    )
    chunks = [e for e in await read_sse(resp) if e != "[DONE]"]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == list(TEXT[:6]) and offsets == list(range(6))
    resp = await client.post(
        "/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 4, "logprobs": True, "stream": True},
    )
    events = [e for e in await read_sse(resp) if e != "[DONE]"]
    assert events[0]["choices"][0]["logprobs"] is None  # the role chunk
    content = [c for e in events[1:] for c in e["choices"][0]["logprobs"]["content"]]
    assert [c["token"] for c in content] == list(TEXT[:4])


async def test_return_tokens_as_token_ids_names_tokens_by_id(start_gateway, start_ledger):
    await start_ledger()
    client = await start_gateway()
    body = await _post(
        client, "/v1/completions", prompt="Hi", logprobs=1, return_tokens_as_token_ids=True
    )
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"][0] == f"token_id:{ord('H')}"
    assert list(logprobs["top_logprobs"][0]) == [f"token_id:{ord('H')}", "token_id:65"]


@pytest.mark.parametrize(
    ("route", "body", "param", "fragment"),
    [
        ("/v1/completions", {"logprobs": 21}, "logprobs", "greater than max allowed: 20"),
        ("/v1/completions", {"logprobs": -1}, "logprobs", "sample logprobs of 258"),
        ("/v1/completions", {"logprobs": -2}, "logprobs", "positive value or -1"),
        ("/v1/completions", {"logprobs": "2"}, "logprobs", "must be an integer"),
        ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "`logprobs` must be set"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 30}, "logprobs", "max"),
        ("/v1/chat/completions", {"prompt_logprobs": 25}, "prompt_logprobs", "max allowed"),
    ],
)
async def test_bad_logprobs_values_are_refused_by_name(
    start_gateway, start_ledger, route, body, param, fragment
):
    ledger = await start_ledger()
    client = await start_gateway()
    base = {"prompt": "Hi"} if route == "/v1/completions" else {"messages": CHAT}
    resp = await client.post(route, json={**base, **body})
    assert resp.status == 400
    assert_error(await resp.json(), param, fragment)
    assert ledger.requests == []
