"""vLLM's request options that the gateway itself honours, through real HTTP against the fake
ledger: echo, include_stop_str_in_output, skip_special_tokens, truncation, stream_interval,
continuous usage, request_id, the chat template's fields and the answer's role."""

from __future__ import annotations

from services.tokenization.tokenizer import ByteTokenizer
from services.wire.messages import GenerateRequest
from tests.gateway.fake_ledger import EOS, TEXT, Script, request_stream
from tests.gateway.helpers import read_sse

BOS = ByteTokenizer.BOS_ID
CHAT = [{"role": "user", "content": "Hi"}]


async def _complete(client, **body):
    resp = await client.post("/v1/completions", json={"max_tokens": 6, **body})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_echo_puts_the_prompt_text_before_the_completion(start_gateway, start_ledger):
    await start_ledger()
    client = await start_gateway()
    text = (await _complete(client, prompt="Say: ", echo=True))["choices"][0]["text"]
    assert text == "Say: " + TEXT[:6]
    ids = [BOS, *b"ids "]
    text = (await _complete(client, prompt=ids, echo=True))["choices"][0]["text"]
    assert text == "<s>ids " + TEXT[:6]  # a token prompt is echoed as its decoded text


async def test_stop_string_is_kept_with_include_stop_str_in_output(start_gateway, start_ledger):
    await start_ledger()
    client = await start_gateway()
    cut = await _complete(client, prompt="x", max_tokens=20, stop="from")
    kept = await _complete(
        client, prompt="x", max_tokens=20, stop="from", include_stop_str_in_output=True
    )
    assert cut["choices"][0]["text"] == "Hello "
    assert kept["choices"][0]["text"] == "Hello from"
    assert kept["choices"][0]["stop_reason"] == "from"


async def test_eos_text_shows_only_when_asked_and_not_skipped(start_gateway, start_ledger):
    await start_ledger(Script(eos_after=3))
    client = await start_gateway()
    plain = await _complete(client, prompt="x")
    shown = await _complete(
        client, prompt="x", include_stop_str_in_output=True, skip_special_tokens=False
    )
    assert plain["choices"][0]["text"] == "Hel"
    assert shown["choices"][0]["text"] == "Hel</s>"
    assert shown["choices"][0]["finish_reason"] == "stop"


async def test_truncate_prompt_tokens_keeps_the_last_tokens_or_the_first(
    start_gateway, start_ledger, redis, prefix
):
    await start_ledger()
    client = await start_gateway()
    await _complete(client, prompt=[1, 2, 3, 4, 5], truncate_prompt_tokens=2)
    await _complete(
        client, prompt=[1, 2, 3, 4, 5], truncate_prompt_tokens=3, truncation_side="right"
    )
    left, right = await request_stream(redis, prefix)
    assert isinstance(left, GenerateRequest) and isinstance(right, GenerateRequest)
    assert (left.prompt_token_ids, right.prompt_token_ids) == ([4, 5], [1, 2, 3])
    resp = await client.post("/v1/completions", json={"prompt": "x", "truncate_prompt_tokens": 65})
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "truncate_prompt_tokens"


async def test_stream_interval_batches_tokens_and_usage_rides_every_chunk(
    start_gateway, start_ledger
):
    await start_ledger()
    client = await start_gateway()
    resp = await client.post(
        "/v1/completions",
        json={
            "prompt": "x", "max_tokens": 7, "stream": True, "stream_interval": 3,
            "return_token_ids": True,
            "stream_options": {"continuous_usage_stats": True, "include_usage": True},
        },
    )  # fmt: skip
    events = await read_sse(resp)
    chunks = [e for e in events[:-1] if e["choices"]]
    sizes = [len(c["choices"][0]["token_ids"]) for c in chunks]
    assert sizes == [1, 3, 3]  # the first chunk goes at once, then 3 tokens per chunk
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 4, 7]
    assert "".join(c["choices"][0]["text"] for c in chunks) == TEXT[:7]
    assert events[-2]["usage"]["completion_tokens"] == 7 and events[-1] == "[DONE]"
    # vLLM's chunk usage: the counts only (the last usage chunk has the cache details).
    assert chunks[0]["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    assert "prompt_tokens_details" in events[-2]["usage"]


async def test_continuous_usage_stats_alone_puts_usage_in_no_chunk(start_gateway, start_ledger):
    # vLLM 0.33: continuous_usage_stats counts only together with include_usage.
    await start_ledger()
    client = await start_gateway()
    for route, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ):
        resp = await client.post(
            route,
            json=body | {"max_tokens": 3, "stream": True,
                         "stream_options": {"continuous_usage_stats": True}},
        )  # fmt: skip
        events = await read_sse(resp)
        assert events[-1] == "[DONE]" and len(events) > 3, route
        assert [e for e in events[:-1] if "usage" in e] == [], route


async def test_chat_role_chunk_carries_usage_with_no_completion_tokens(start_gateway, start_ledger):
    await start_ledger()
    client = await start_gateway()
    messages = [*CHAT, {"role": "assistant", "content": "Sure"}]
    resp = await client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 2, "stream": True, "echo": True,
              "add_generation_prompt": False, "continue_final_message": True,
              "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )  # fmt: skip
    events = await read_sse(resp)
    prompt = len(ByteTokenizer().encode("<|user|>\nHi\n<|assistant|>\nSure"))
    role, echo, *tokens, last, done = events
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert echo["choices"][0]["delta"] == {"content": "Sure"}
    opening = {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
    assert role["usage"] == echo["usage"] == opening
    assert [t["usage"]["completion_tokens"] for t in tokens] == [1, 2]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2 and done == "[DONE]"


async def test_request_id_names_the_response(start_gateway, start_ledger, redis, prefix):
    await start_ledger()
    client = await start_gateway()
    first = await _complete(client, prompt="x", request_id="abc")
    second = await _complete(client, prompt="x", request_id="abc")
    assert first["id"] == second["id"] == "cmpl-abc"
    a, b = await request_stream(redis, prefix)
    assert isinstance(a, GenerateRequest) and isinstance(b, GenerateRequest)
    assert a.req_id != b.req_id  # the ledger's ids stay unique


async def test_chat_template_fields_reach_the_prompt(start_gateway, start_ledger, redis, prefix):
    await start_ledger()
    client = await start_gateway()
    messages = [*CHAT, {"role": "assistant", "content": "Sure, "}]
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "messages": messages, "max_tokens": 4, "add_generation_prompt": False,
            "continue_final_message": True, "echo": True, "return_prompt_text": True,
        },
    )  # fmt: skip
    body = await resp.json()
    assert resp.status == 200, body
    assert body["prompt_text"] == "<|user|>\nHi\n<|assistant|>\nSure, "
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Sure, " + TEXT[:4]}
    (req,) = await request_stream(redis, prefix)
    assert isinstance(req, GenerateRequest)
    assert req.prompt_token_ids == ByteTokenizer().encode(body["prompt_text"])


async def test_without_a_generation_prompt_the_answer_takes_the_last_role(
    start_gateway, start_ledger
):
    await start_ledger()
    client = await start_gateway()
    resp = await client.post(
        "/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 3, "add_generation_prompt": False, "stream": True},
    )
    events = await read_sse(resp)
    assert events[0]["choices"][0]["delta"]["role"] == "user"


async def test_ignore_eos_drops_eos_and_the_stop_token_text_is_hidden(
    start_gateway, start_ledger, redis, prefix
):
    await start_ledger()
    client = await start_gateway()
    await _complete(client, prompt="x", ignore_eos=True)
    (req,) = await request_stream(redis, prefix)
    assert isinstance(req, GenerateRequest) and req.sampling.eos_token_id is None
    assert EOS not in (req.sampling.stop_token_ids or [])


async def test_logits_fields_reach_the_worker_as_vllm_normalises_them(
    start_gateway, start_ledger, redis, prefix
):
    await start_ledger()
    client = await start_gateway()
    await _complete(
        client, prompt="x", min_p=0.2, presence_penalty=0.5, frequency_penalty=-0.5,
        repetition_penalty=1.3, logit_bias={"65": 250, "66": -1}, allowed_token_ids=[65, 66],
        bad_words=["ab"], temperature=0.001,
    )  # fmt: skip
    (req,) = await request_stream(redis, prefix)
    assert isinstance(req, GenerateRequest)
    s = req.sampling
    assert (s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (
        0.2, 0.5, -0.5, 1.3
    )  # fmt: skip
    assert s.logit_bias == {65: 100.0, 66: -1.0}  # clamped to [-100, 100]
    assert s.allowed_token_ids == [65, 66]
    # " ab" is three byte tokens, not a different first token of the same length: one variant
    assert s.bad_words_token_ids == [[*b"ab"]]
    assert s.temperature == 0.01  # vLLM raises 0 < t < 0.01 to 0.01
    for body, param in (
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"999": 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"min_p": 1.5}, "min_p"),
    ):
        resp = await client.post("/v1/completions", json={"prompt": "x", **body})
        assert resp.status == 400, body
        assert (await resp.json())["error"]["param"] == param
