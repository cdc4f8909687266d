"""The official `openai` client against the real gateway, ledger and worker: what a user coming
from `vllm serve` runs. Its typed models parse every answer, so a field of the wrong shape fails
here, the Responses API's (`responses.create`, `responses.stream`, `retrieve`) included."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator

import openai
import pytest

from tests.harness.gateway_stack import gateway_on
from tests.harness.stack import Stack

MODEL = "kvledger-tiny-llama"
CHAT = [{"role": "user", "content": "Name a colour."}]


@contextlib.asynccontextmanager
async def _served(redis_url, tiny_model, **settings) -> AsyncIterator[openai.AsyncOpenAI]:
    stack = await Stack(redis_url, tiny_model, num_blocks=128).start()
    try:
        async with gateway_on(stack, **settings) as http:
            base_url = str(http.make_url("/v1"))
            async with openai.AsyncOpenAI(base_url=base_url, api_key="unused") as oa:
                yield oa
    finally:
        await stack.stop()


@pytest.fixture
async def client(redis_url, tiny_model):
    async with _served(redis_url, tiny_model) as oa:
        yield oa


@pytest.fixture
async def storing_client(redis_url, tiny_model):
    """A gateway started with --enable-responses-store."""
    async with _served(redis_url, tiny_model, enable_responses_store=True) as oa:
        yield oa


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
    content = chat.choices[0].logprobs.content
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


# --- the Responses API ---------------------------------------------------------------------------

SYSTEM = "Answer briefly."


async def test_responses_create_answers_as_chat_does(client):
    """Text input with instructions, and the same turn as messages: both the greedy answer of
    the chat endpoint for that conversation (instructions are its system message), cut at
    max_output_tokens ("incomplete"), with usage the typed model parses."""
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *CHAT], max_tokens=6,
        temperature=0.0,
    )  # fmt: skip
    expected = chat.choices[0].message.content
    assert chat.usage is not None and len(expected or "") == 6
    done = await client.responses.create(
        model=MODEL, input=CHAT[0]["content"], instructions=SYSTEM, max_output_tokens=6,
        temperature=0.0,
    )  # fmt: skip
    assert done.object == "response" and done.model == MODEL and done.id.startswith("resp_")
    assert done.output_text == expected and done.instructions == SYSTEM
    assert done.status == "incomplete" and done.incomplete_details is not None
    assert done.incomplete_details.reason == "max_output_tokens"
    (item,) = done.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    usage = done.usage
    assert usage is not None and usage.output_tokens == 6
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert usage.total_tokens == usage.input_tokens + 6
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    messages = await client.responses.create(
        model=MODEL, max_output_tokens=6, temperature=0.0,
        input=[{"role": "system", "content": SYSTEM},
               {"role": "user", "content": [{"type": "input_text", "text": CHAT[0]["content"]}]}],
    )  # fmt: skip
    assert messages.output_text == expected and messages.instructions is None
    assert messages.usage is not None and messages.usage.input_tokens == usage.input_tokens


async def test_responses_stream_events_give_the_final_text(client):
    """responses.stream's events: response.created first, text deltas whose join is the final
    response's text (cut by a stop string: "completed", which the helper's final response
    needs); the whole answer's text the same. A stream cut by max_output_tokens ends with
    response.incomplete."""
    whole = await client.responses.create(
        model=MODEL, input="Stream", max_output_tokens=12, temperature=0.0
    )
    stop = whole.output_text[6:9]  # first seen at or before position 6
    expected = whole.output_text[: whole.output_text.index(stop)]
    async with client.responses.stream(
        model=MODEL, input="Stream", max_output_tokens=12, temperature=0.0,
        extra_body={"stop": [stop]},
    ) as stream:  # fmt: skip
        kinds, deltas = [], []
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = await stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and final.status == "completed"
    assert "".join(deltas) == final.output_text == expected
    assert final.usage is not None and final.usage.output_tokens == len(expected) + len(stop)
    events = await client.responses.create(
        model=MODEL, input="Stream", max_output_tokens=12, temperature=0.0, stream=True
    )
    seen = [event async for event in events]
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    last = seen[-1]
    assert last.type == "response.incomplete" and last.response.output_text == whole.output_text
    joined = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert joined == whole.output_text


async def test_stored_responses_are_retrieved_and_continued(storing_client):
    """With --enable-responses-store: a response is stored by default, retrieve gives it back
    as it was, and previous_response_id continues its conversation (the greedy answer of the
    chat endpoint to the whole conversation; the first turn's instructions are not carried)."""
    client = storing_client
    first = await client.responses.create(
        model=MODEL, input="Hi", instructions=SYSTEM, max_output_tokens=5, temperature=0.0
    )
    got = await client.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    second = await client.responses.create(
        model=MODEL, input="More?", previous_response_id=first.id, max_output_tokens=5,
        temperature=0.0, store=False,
    )  # fmt: skip
    assert second.previous_response_id == first.id
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "More?"},
    ]
    chat = await client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=5, temperature=0.0
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(second.id)  # store: false
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_0000000000000000")
