"""Several choices in one response, through real HTTP against the fake ledger: `n` (one ledger
request per choice, seeds seed + i as vLLM's parallel sampling), batch prompts in
/v1/completions, OpenAI's `best_of`, streamed and not, indexed as OpenAI does, usage summed."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import aiohttp

from services.tokenization.tokenizer import ByteTokenizer
from tests.gateway.fake_ledger import TEXT, Script
from tests.gateway.helpers import read_sse

BOS = ByteTokenizer.BOS_ID
CHAT = [{"role": "user", "content": "Hi"}]


async def _post(client, route: str, **body):
    resp = await client.post(route, json={"max_tokens": 4, **body})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_n_choices_are_child_requests_with_seeds_seed_plus_i(start_gateway, start_ledger):
    ledger = await start_ledger(Script(vary_by_seed=True))
    client = await start_gateway()
    body = await _post(client, "/v1/completions", prompt="Hi", n=3, seed=10)
    assert [r.sampling.seed for r in ledger.requests] == [10, 11, 12]
    assert len({r.req_id for r in ledger.requests}) == 3
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [(TEXT * 2)[s : s + 4] for s in (10, 11, 12)]
    assert body["usage"]["prompt_tokens"] == 3  # the prompt counts once, as vLLM
    assert body["usage"]["completion_tokens"] == 12 and body["usage"]["total_tokens"] == 15
    unseeded = await _post(client, "/v1/chat/completions", messages=CHAT, n=2)
    assert [r.sampling.seed for r in ledger.requests[3:]] == [None, None]  # the ledger seeds them
    assert [c["index"] for c in unseeded["choices"]] == [0, 1]
    assert all(c["message"]["content"] == TEXT[:4] for c in unseeded["choices"])


async def test_batch_prompts_are_answered_prompt_by_prompt_with_echo(start_gateway, start_ledger):
    ledger = await start_ledger()
    client = await start_gateway()
    body = await _post(
        client, "/v1/completions", prompt=["Hi", [BOS, ord("Y")]], n=2, echo=True, seed=1
    )
    assert [r.prompt_token_ids for r in ledger.requests] == [[BOS, 72, 105]] * 2 + [[BOS, 89]] * 2
    assert [r.sampling.seed for r in ledger.requests] == [1, 2, 1, 2]  # per prompt, as vLLM
    texts = [c["text"] for c in body["choices"]]
    assert texts == ["Hi" + TEXT[:4]] * 2 + ["<s>Y" + TEXT[:4]] * 2
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 16


async def test_streamed_choices_interleave_by_index_and_usage_is_summed(
    start_gateway, start_ledger
):
    await start_ledger(Script(delay_s=0.01, vary_by_seed=True))
    client = await start_gateway()
    resp = await client.post(
        "/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 5, "n": 2, "seed": 3, "stream": True,
              "stream_options": {"include_usage": True}},
    )  # fmt: skip
    events = [e for e in await read_sse(resp) if e != "[DONE]"]
    assert [e["choices"][0]["delta"].get("role") for e in events[:2]] == ["assistant"] * 2
    assert [e["choices"][0]["index"] for e in events[:2]] == [0, 1]  # every role chunk first
    content: dict[int, str] = defaultdict(str)
    finished = {}
    for event in events[2:-1]:
        (choice,) = event["choices"]
        content[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finished[choice["index"]] = choice["finish_reason"]
    assert dict(content) == {0: (TEXT * 2)[3:8], 1: (TEXT * 2)[4:9]}
    assert finished == {0: "length", 1: "length"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 10


async def test_best_of_returns_the_samples_with_the_best_mean_logprob(start_gateway, start_ledger):
    ledger = await start_ledger(Script(vary_by_seed=True))
    client = await start_gateway()
    # Seeds 5, 6, 7: the fake ledger's logprobs are best for seed 7 (7 % 7 == 0), then 5.
    body = await _post(client, "/v1/completions", prompt="Hi", best_of=3, seed=5)
    assert [r.sampling.logprobs for r in ledger.requests] == [0, 0, 0]  # to rank them
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["text"] == (TEXT * 2)[7:11]
    assert choice["logprobs"] is None  # computed to rank, not asked for
    assert body["usage"]["completion_tokens"] == 12  # every sample drawn, as OpenAI bills
    two = await _post(client, "/v1/completions", prompt="Hi", best_of=3, n=2, seed=5, logprobs=0)
    texts = [c["text"] for c in two["choices"]]
    assert texts == [(TEXT * 2)[5:9], (TEXT * 2)[7:11]]  # the best two, in sample order
    assert all(c["logprobs"]["token_logprobs"] for c in two["choices"])


async def test_a_disconnect_aborts_every_choice(start_gateway, start_ledger):
    ledger = await start_ledger(Script(delay_s=0.05))
    client = await start_gateway()
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            client.make_url("/v1/completions"),
            json={"prompt": "x", "max_tokens": 50, "stream": True, "n": 3},
        )
        assert (await resp.content.readline()).startswith(b"data: ")
        resp.close()
    requests = await ledger.wait_for_requests(3)
    aborts = await asyncio.gather(*(ledger.wait_for_abort(r.req_id) for r in requests))
    assert {a.reason for a in aborts} == {"client_disconnected"}


async def test_a_failed_choice_fails_the_whole_response(start_gateway, start_ledger):
    ledger = await start_ledger(Script(error="worker exploded", error_after=2))
    client = await start_gateway()
    resp = await client.post("/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 5})
    assert resp.status == 500
    assert "worker exploded" in (await resp.json())["error"]["message"]
    assert len(ledger.requests) == 2
