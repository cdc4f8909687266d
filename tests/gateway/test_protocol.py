"""The pure request core: parsing, the ledger-limit checks with vLLM's messages, the wire's
sampling settings, and response shapes. No Redis, no HTTP."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.bodies import Meta, Usage, chunk_body, final_body, sse
from gateway.fields import ApiError
from gateway.protocol import (
    Limits,
    parse_chat,
    parse_completion,
    parse_json,
    resolve,
    sampling_params,
)
from services.tokenization.tokenizer import ByteTokenizer
from services.wire import codec
from services.wire.messages import GenerateRequest

TOK = ByteTokenizer()
BOS = ByteTokenizer.BOS_ID
LIMITS = Limits("m", max_model_len=32, vocab_size=258)


def completion(**body):
    (job,) = parse_completion(body, TOK, default_max_tokens=16)
    return job


def test_text_prompt_is_tokenized_and_defaults_follow_openai():
    job = completion(prompt="Hi")
    assert job.prompt_token_ids == [BOS, ord("H"), ord("i")]
    assert (job.max_tokens, job.temperature, job.top_p, job.top_k) == (16, 1.0, 1.0, 0)
    assert (job.stop, job.stream, job.include_usage, job.priority) == ([], False, False, 0)


@pytest.mark.parametrize("prompt", [[5, 6], [[5, 6]]])
def test_token_prompts_pass_through_unchanged(prompt):
    assert completion(prompt=prompt).prompt_token_ids == [5, 6]


def test_a_batch_of_one_text_prompt_is_accepted():
    assert completion(prompt=["Hi"]).prompt_token_ids == [BOS, *b"Hi"]


@pytest.mark.parametrize(("top_k", "expected"), [(-1, 0), (0, 0), (1, 1), (40, 40)])
def test_top_k_minus_one_and_zero_both_mean_off(top_k, expected):
    assert completion(prompt="x", top_k=top_k).top_k == expected


def test_stop_takes_a_string_or_a_list():
    assert completion(prompt="x", stop="END").stop == ["END"]
    assert completion(prompt="x", stop=["a", "b"]).stop == ["a", "b"]


def test_harmless_values_of_unsupported_fields_are_accepted():
    job = completion(prompt="x", n=1, echo=False, presence_penalty=0, logit_bias={})
    assert job.prompt_token_ids == [BOS, ord("x")]
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": False}, TOK)
    assert chat.kind == "chat"


def test_chat_text_parts_are_joined_and_max_completion_tokens_wins():
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                 {"type": "text", "text": "b"}]}],
        "max_tokens": 9, "max_completion_tokens": 4,
    }  # fmt: skip
    job = parse_chat(body, TOK)
    expected = TOK.apply_chat_template([{"role": "user", "content": "a\nb"}])
    assert job.prompt_token_ids == expected
    assert (job.max_tokens, job.max_tokens_param) == (4, "max_completion_tokens")


def test_bad_json_and_non_objects_are_400_without_a_param():
    for raw in (b"{", b"3", b'"text"', b"[" * 100_000, b'{"temperature": NaN}'):
        with pytest.raises(ApiError) as err:
            parse_json(raw)
        assert (err.value.status, err.value.param) == (400, None)


def test_long_values_are_never_echoed_whole():
    with pytest.raises(ApiError) as err:
        parse_chat({"messages": [{"role": "x" * 500, "content": "hi"}]}, TOK)
    assert err.value.message.endswith("x" * 36 + "...")  # 40 characters of the value at most


def test_prompt_plus_max_tokens_over_the_context_uses_vllms_message():
    job = completion(prompt=[1] * 10, max_tokens=30)
    with pytest.raises(ApiError) as err:
        resolve(job, LIMITS)
    assert err.value.message == (
        "This model's maximum context length is 32 tokens. However, you requested 40 tokens "
        "(10 in the messages, 30 in the completion). Please reduce the length of the messages "
        "or completion."
    )
    assert err.value.param == "max_tokens"


def test_a_prompt_that_fills_the_context_is_refused_on_the_prompt():
    with pytest.raises(ApiError) as err:
        resolve(completion(prompt=[1] * 32, max_tokens=1), LIMITS)
    assert err.value.param == "prompt" and "has 32 input tokens" in err.value.message
    chat = parse_chat({"messages": [{"role": "user", "content": "y" * 40}]}, TOK)
    with pytest.raises(ApiError) as err:
        resolve(chat, LIMITS)
    assert err.value.param == "messages"


def test_chat_without_max_tokens_gets_what_the_context_leaves():
    job = parse_chat({"messages": [{"role": "user", "content": "x"}]}, TOK)
    resolved = resolve(job, LIMITS)
    assert resolved.max_tokens == 32 - len(job.prompt_token_ids)


def test_token_ids_outside_the_ledgers_vocabulary_are_refused():
    with pytest.raises(ApiError) as err:
        resolve(completion(prompt=[1, 258]), LIMITS)
    assert (err.value.param, err.value.status) == ("prompt", 400)
    with pytest.raises(ApiError) as err:
        resolve(completion(prompt=[1], stop_token_ids=[999]), LIMITS)
    assert err.value.param == "stop_token_ids"


def test_a_model_other_than_the_served_one_is_404():
    with pytest.raises(ApiError) as err:
        resolve(completion(prompt="x", model="other"), LIMITS)
    assert (err.value.status, err.value.param) == (404, "model")
    assert resolve(completion(prompt="x", model="m"), LIMITS).model == "m"


def test_first_eos_stops_the_request_and_the_others_join_stop_ids():
    job = resolve(completion(prompt="x", stop_token_ids=[7]), LIMITS)
    params = sampling_params(job, [257, 300, 7])
    assert params.eos_token_id == 257
    assert params.stop_token_ids == [7, 300]
    ignoring = resolve(completion(prompt="x", ignore_eos=True), LIMITS)
    params = sampling_params(ignoring, [257, 300])
    assert (params.eos_token_id, params.stop_token_ids) == (None, None)


def test_whole_and_streamed_bodies_have_openai_shapes():
    meta = Meta("chat", "chatcmpl-1", 1700000000, "m")
    usage = Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1)
    body = final_body(meta, "hi", "stop", None, usage, token_ids=([1, 2, 3], [4, 5]))
    assert body == {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "m",
        "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
            "finish_reason": "stop", "stop_reason": None, "token_ids": [4, 5],
        }],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                  "prompt_tokens_details": {"cached_tokens": 1}},
        "prompt_token_ids": [1, 2, 3],  # chat: beside the choices, as vLLM
    }  # fmt: skip
    chunk = chunk_body(Meta("completion", "cmpl-1", 1, "m"), "é", None)
    assert sse(chunk) == (
        b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
        b'"choices":[{"index":0,"text":"\xc3\xa9","logprobs":null,"finish_reason":null}]}\n\n'
    )


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)
FIELDS = [
    "prompt", "messages", "max_tokens", "max_completion_tokens", "min_tokens", "temperature",
    "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "stream", "stream_options",
    "cache_salt", "priority", "return_token_ids", "model", "n", "echo", "logprobs",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES), chat=st.booleans())
def test_any_body_is_either_a_valid_wire_request_or_a_4xx_naming_a_field(body, chat):
    try:
        job = parse_chat(body, TOK) if chat else parse_completion(body, TOK, 16)[-1]
        job = resolve(job, Limits("m", max_model_len=64, vocab_size=258))
        params = sampling_params(job, [257])
    except ApiError as err:
        assert 400 <= err.status < 500
        assert err.param is None or err.param.split("[")[0].split(".")[0] in FIELDS
        return
    message = GenerateRequest("r", "g", job.prompt_token_ids, params, 0.0, job.priority)
    assert codec.decode(codec.encode(message)) == message
