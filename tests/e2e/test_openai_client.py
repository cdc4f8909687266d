"""The official `openai` client against the real gateway, ledger and worker: what a user coming
from `vllm serve` runs. Its typed models parse every answer, so a field of the wrong shape fails
here."""

from __future__ import annotations

import math

import openai
import pytest

from tests.harness.gateway_stack import gateway_on
from tests.harness.stack import Stack

MODEL = "kvledger-tiny-llama"
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
async def client(redis_url, tiny_model):
    stack = await Stack(redis_url, tiny_model, num_blocks=128).start()
    try:
        async with gateway_on(stack) as http:
            base_url = str(http.make_url("/v1"))
            async with openai.AsyncOpenAI(base_url=base_url, api_key="unused") as oa:
                yield oa
    finally:
        await stack.stop()


async def test_completions_and_chat(client):
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    done = await client.completions.create(
        model=MODEL, prompt="The KV cache", max_tokens=8, temperature=0.0
    )
    assert done.object == "text_completion" and done.model == MODEL
    (choice,) = done.choices
    assert choice.finish_reason == "length" and len(choice.text) == 8  # bytes: one per token
    assert done.usage is not None and done.usage.completion_tokens == 8
    assert done.usage.prompt_tokens == 1 + len("The KV cache")
    chat = await client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0.0, seed=3
    )
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].message.content or "") == 6
    again = await client.completions.create(
        model=MODEL, prompt="The KV cache", max_tokens=8, temperature=0.0
    )
    assert again.choices[0].text == choice.text  # greedy is greedy


async def test_streaming_matches_the_whole_answer(client):
    whole = await client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=10, temperature=0.8, seed=5
    )
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=10,
        temperature=0.8,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage, finish = [], None, None
    async for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == "length" and usage is not None and usage.completion_tokens == 10
    text_stream = await client.completions.create(
        model=MODEL, prompt="Stream", max_tokens=5, temperature=0.0, stream=True
    )
    streamed = "".join([c.choices[0].text async for c in text_stream if c.choices])
    whole_text = await client.completions.create(
        model=MODEL, prompt="Stream", max_tokens=5, temperature=0.0
    )
    assert streamed == whole_text.choices[0].text


async def test_logprobs_in_both_shapes(client):
    done = await client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=4, temperature=0.0, logprobs=3
    )
    lp = done.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert "".join(lp.tokens) == done.choices[0].text and len(lp.token_logprobs) == 4
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs or [], strict=True):
        assert len(top) == 3 and math.isclose(chosen, max(top.values()), abs_tol=1e-6)
    chat = await client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)


async def test_n_choices(client):
    done = await client.completions.create(
        model=MODEL, prompt="Pick", max_tokens=6, temperature=1.0, seed=9, n=3
    )
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert len({c.text for c in done.choices}) == 3
    assert done.usage is not None and done.usage.completion_tokens == 18
    chat = await client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=1.0, seed=9, n=2
    )
    assert [c.index for c in chat.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=0)
    assert refused.value.body["param"] == "n"  # type: ignore[index]
