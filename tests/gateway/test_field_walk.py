"""The field walk: every field vLLM 0.33's request models accept (`vllm_fields.json`, dumped from
vLLM itself by `dump_vllm_fields.py`) is either honoured (a request setting it to a real value
succeeds) or refused with a 400 that names it. Nothing is silently ignored: a field vLLM does not
know is refused too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.support import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DETOKENIZE_FIELDS,
    REMOVED_GUIDED_FIELDS,
    STREAM_OPTIONS_FIELDS,
    TOKENIZE_FIELDS,
    markdown_field_list,
)
from tests.gateway.helpers import assert_error

VLLM = json.loads(Path(__file__).with_name("vllm_fields.json").read_text())
MODELS = VLLM["models"]
CHAT = [{"role": "user", "content": "Hi"}]

# A value that asks for something (never the do-nothing default) for every field of the tables.
SAMPLES: dict[str, Any] = {
    "model": "fake-model", "prompt": "Hi", "messages": CHAT, "max_tokens": 4,
    "max_completion_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
    "seed": 3, "stop": ["zz"], "stop_token_ids": [7], "include_stop_str_in_output": True,
    "ignore_eos": True, "min_tokens": 1, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "stream": True,
    "stream_options": {"include_usage": True}, "stream_interval": 2,
    "truncate_prompt_tokens": 2, "truncation_side": "right", "priority": 1,
    "request_id": "walk-1", "session_id": "s-1", "user": "u-1", "cache_salt": "salt",
    "return_token_ids": True, "use_beam_search": True, "length_penalty": 0.5,
    "watermarking": True, "n": 2, "best_of": 3, "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "repetition_penalty": 1.2, "logit_bias": {"5": 1.0},
    "bad_words": ["xyz"], "allowed_token_ids": [5, 6, 7], "logprobs": 2, "top_logprobs": 2,
    "prompt_logprobs": 1, "logprob_token_ids": [5], "return_tokens_as_token_ids": True,
    "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "[ab]+"},
    "repetition_detection": {"max_pattern_size": 4}, "thinking_token_budget": 10,
    "vllm_xargs": {"a": 1}, "kv_transfer_params": {"do_remote_prefill": True},
    "ec_transfer_params": {"a": 1}, "return_weight_versions": True,
    "routed_experts_prompt_start": 1, "return_token_offsets": True, "mm_payload": "none",
    "return_mm_kwargs": False, "echo": True, "add_special_tokens": False, "suffix": "end",
    "prompt_embeds": "AAAA", "add_generation_prompt": False, "continue_final_message": True,
    "documents": [{"title": "t", "text": "x"}], "chat_template_kwargs": {"flavour": "x"},
    "reasoning_effort": "low", "return_prompt_text": True, "chat_template": "{{ 1 }}",
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none",
    "parallel_tool_calls": False, "include_reasoning": False, "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"a": 1}, "return_token_strs": True, "tokens": [72, 105],
}  # fmt: skip

# Values of supported fields that only make sense together with another field.
COMPANIONS: dict[str, dict[str, Any]] = {
    "stream_options": {"stream": True},
    "stream_interval": {"stream": True},
    "continue_final_message": {"add_generation_prompt": False},
    "top_logprobs": {"logprobs": True},
    # This gateway has no --tool-call-parser: tools only with tool_choice none (tests/gateway/
    # test_http_tools.py covers the others).
    "tools": {"tool_choice": "none"},
    "tool_choice": {"tools": [{"type": "function", "function": {"name": "f"}}]},
}
# Where one endpoint types a field differently from the other.
KIND_SAMPLES: dict[str, dict[str, Any]] = {"chat": {"logprobs": True}}

ENDPOINTS = [
    # (vLLM model, our table, route, the minimal body)
    ("completion", COMPLETION_FIELDS, "/v1/completions", {"prompt": "Hi", "max_tokens": 4}),
    ("chat", CHAT_FIELDS, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4}),
    ("tokenize_completion", TOKENIZE_FIELDS, "/tokenize", {"prompt": "Hi"}),
    ("tokenize_chat", TOKENIZE_FIELDS, "/tokenize", {"messages": CHAT}),
    ("detokenize", DETOKENIZE_FIELDS, "/detokenize", {"tokens": [72, 105]}),
]


def test_the_field_list_comes_from_vllm_0_33():
    assert VLLM["vllm_version"].startswith("0.33")
    assert len(MODELS["completion"]) > 50 and len(MODELS["chat"]) > 60


@pytest.mark.parametrize(("kind", "table"), [(e[0], e[1]) for e in ENDPOINTS])
def test_every_vllm_field_has_a_decision(kind, table):
    missing = [name for name in MODELS[kind] if name not in table]
    assert missing == [], f"fields of vLLM's {kind} request with no decision in gateway.support"


def test_every_stream_option_has_a_decision():
    assert set(MODELS["stream_options"]) == set(STREAM_OPTIONS_FIELDS)


def test_every_field_has_a_sample_and_the_docs_list_them_all():
    readme = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    for table in (COMPLETION_FIELDS, CHAT_FIELDS, TOKENIZE_FIELDS, DETOKENIZE_FIELDS):
        for name, support in table.items():
            assert name in SAMPLES, name
            assert not support.harmless(SAMPLES[name]), f"the sample of {name} asks for nothing"
    assert markdown_field_list() in readme, (
        "docs/api.md's field list is not support.py's; regenerate it"
    )


def _cases() -> list[tuple[str, str, str, dict[str, Any], bool]]:
    cases = []
    for kind, table, route, base in ENDPOINTS:
        for name in MODELS[kind]:
            if name in base:
                continue
            refused = table[name].refused
            wanted = {} if refused else COMPANIONS.get(name, {})
            companions = {k: v for k, v in wanted.items() if k in table}  # the endpoint's own
            sample = KIND_SAMPLES.get(kind, {}).get(name, SAMPLES[name])
            body = {**base, **companions, name: sample}
            cases.append((f"{kind}.{name}", route, name, body, refused))
    return cases


@pytest.mark.parametrize(
    ("case", "route", "name", "body", "is_refused"), _cases(), ids=[c[0] for c in _cases()]
)
async def test_each_field_is_honoured_or_refused_by_name(
    start_gateway, start_ledger, case, route, name, body, is_refused
):
    ledger = await start_ledger(scheduling_policy="priority", max_model_len=256)
    client = await start_gateway()
    resp = await client.post(route, json=body)
    text = await resp.text()
    if is_refused:
        assert resp.status == 400, text
        assert_error(json.loads(text), name, "not supported")
        assert ledger.requests == []
    else:
        assert resp.status == 200, text


@pytest.mark.parametrize("name", ["frobnicate", *REMOVED_GUIDED_FIELDS])
async def test_fields_vllm_does_not_know_are_refused(start_gateway, start_ledger, name):
    await start_ledger()
    client = await start_gateway()
    for route, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ):
        resp = await client.post(route, json={**body, name: {"type": "object"}})
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == name
