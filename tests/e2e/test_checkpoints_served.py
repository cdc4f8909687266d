"""Tiny random `transformers` checkpoints served by `kvledger up` answer like `transformers`.

One stack per architecture (LlamaForCausalLM with llama3 RoPE scaling, MistralForCausalLM,
Qwen2ForCausalLM), driven over HTTP: greedy `token_ids` of token-id prompts equal
`generate(do_sample=False)`'s new tokens exactly, for concurrent requests that are preempted and
recomputed, for prompts that hit the prefix cache, and for a chat completion rendered with the
folder's chat template. A sharded checkpoint answers exactly as the unsharded one.

First-step logits (float32, atol 1e-4 + rtol 1e-4 of transformers' forward) are pinned at the
runner level by tests/gpu_worker/test_checkpoint.py; over HTTP, greedy `logprobs`,
`top_logprobs` and `prompt_logprobs` equal transformers' log-softmax within 1e-4.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
import transformers

from tests.e2e.conftest import Served, launch, metric_value, serve, serving
from tests.gpu_worker.checkpoints import ARCHITECTURES, VOCAB_SIZE, make_tiny_checkpoint

# Block size 4 and a 40-block pool (39 usable): one max_model_len request needs 24 blocks, the
# concurrent waves below need ~70, so they are preempted; the prefix wave needs 32 and is not.
BLOCK_SIZE = 4
NUM_GPU_BLOCKS = 40
MAX_MODEL_LEN = 96
MAX_TOKENS = 20
SHARED_PREFIX = 24  # tokens: six full blocks


@dataclass
class Stack:
    served: Served
    folder: Path
    reference: torch.nn.Module


def random_prompt(rng: random.Random, length: int) -> list[int]:
    # The model's whole vocabulary, ids the tokenizer never produces included: an outside
    # harness may send any id the model has.
    return [rng.randrange(VOCAB_SIZE) for _ in range(length)]


def load_reference(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def reference_greedy(model: torch.nn.Module, ids: list[int], max_tokens: int) -> list[int]:
    # An explicit mask: generate() would otherwise take BOS (id 0 = pad here) for padding.
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module", params=ARCHITECTURES)
def stack(request, tmp_path_factory) -> Stack:
    # A seed per architecture: Llama and Mistral would otherwise share every weight.
    seed = ARCHITECTURES.index(request.param)
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("served"), request.param, seed=seed)
    with serve(
        folder, num_gpu_blocks=NUM_GPU_BLOCKS, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE
    ) as served:
        yield Stack(served, folder, load_reference(folder))


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body) as reply:
        text = await reply.text()
        assert reply.status == 200, f"{url} answered {reply.status}: {text}"
        return json.loads(text)


async def post_streamed(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> dict[str, Any]:
    """A streamed request, its chunks folded into the shape of a non-streamed reply."""
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    choice: dict[str, Any] = {"token_ids": [], "finish_reason": None}
    req_id = usage = None
    async with session.post(url, json=body) as reply:
        assert reply.status == 200, f"{url} answered {reply.status}: {await reply.text()}"
        async for raw in reply.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            req_id = chunk["id"]
            usage = chunk.get("usage") or usage
            for part in chunk["choices"]:
                if "prompt_token_ids" in part:
                    choice["prompt_token_ids"] = part["prompt_token_ids"]
                choice["token_ids"] += part.get("token_ids") or []
                choice["finish_reason"] = part["finish_reason"] or choice["finish_reason"]
    return {"id": req_id, "choices": [choice], "usage": usage}


async def complete_ids(
    url: str, prompts: list[list[int]], max_tokens: int = MAX_TOKENS, stream: bool = False
) -> list[dict[str, Any]]:
    """Greedy completions of token-id prompts, all in flight at once."""
    send = post_streamed if stream else post
    async with aiohttp.ClientSession() as session:
        bodies = [
            {
                "prompt": ids,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            for ids in prompts
        ]
        return await asyncio.gather(*(send(session, f"{url}/v1/completions", b) for b in bodies))


async def get_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as reply:
        assert reply.status == 200, f"{url} answered {reply.status}"
        return await reply.text()


def assert_matches_reference(
    stack: Stack, prompts: list[list[int]], replies: list[dict[str, Any]], max_tokens: int
) -> None:
    for i, (ids, reply) in enumerate(zip(prompts, replies, strict=True)):
        choice = reply["choices"][0]
        assert choice["prompt_token_ids"] == ids
        assert choice["finish_reason"] == "length"
        expected = reference_greedy(stack.reference, ids, max_tokens)
        assert len(expected) == max_tokens
        assert choice["token_ids"] == expected, f"prompt {i} ({len(ids)} tokens) diverged"
        assert reply["usage"]["completion_tokens"] == max_tokens


async def test_models_names_the_served_folder(stack):
    body = json.loads(await get_text(f"{stack.served.url}/v1/models"))
    assert [card["id"] for card in body["data"]] == [stack.folder.name]
    assert body["data"][0]["max_model_len"] == MAX_MODEL_LEN


async def test_concurrent_greedy_tokens_match_transformers_through_preemption(stack):
    url, metrics = stack.served.url, stack.served.ledger_metrics_url
    rng = random.Random(1)
    for stream in (False, True):  # the streamed path must not repeat or lose recomputed tokens
        before = metric_value(await get_text(metrics), "vllm:num_preemptions_total")
        logged = len(stack.served.log_records("request_preempted"))
        prompts = [random_prompt(rng, n) for n in (9, 17, 23, 30, 34, 41, 13, 27)]
        replies = await complete_ids(url, prompts, stream=stream)
        after = metric_value(await get_text(metrics), "vllm:num_preemptions_total")
        assert after > before, f"the wave (stream={stream}) was sized to be preempted, and was not"
        assert_matches_reference(stack, prompts, replies, MAX_TOKENS)
        # The ledger names each victim in a JSON log line: all are requests of this wave.
        victims = [r["req_id"] for r in stack.served.log_records("request_preempted")[logged:]]
        assert len(victims) == after - before
        assert set(victims) <= {reply["id"] for reply in replies}


async def test_prefix_cache_hits_report_cached_tokens_and_match_transformers(stack):
    url = stack.served.url
    rng = random.Random(2)
    first = random_prompt(rng, 40)
    [cold] = await complete_ids(url, [first], max_tokens=8)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    shared = first[:SHARED_PREFIX]
    # Each tail starts with an id that differs from first[SHARED_PREFIX], so the hit ends there.
    tails = [
        [(first[SHARED_PREFIX] + 1 + j) % VOCAB_SIZE, *random_prompt(rng, n - 1)]
        for j, n in enumerate((4, 8, 12))
    ]
    prompts = [first] + [shared + tail for tail in tails]
    replies = await complete_ids(url, prompts, max_tokens=16)
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
    # The repeat hits all but its last block (vLLM recomputes the last prompt token), the others
    # exactly the shared six blocks.
    assert cached == [36, SHARED_PREFIX, SHARED_PREFIX, SHARED_PREFIX]
    assert replies[0]["choices"][0]["token_ids"][:8] == cold["choices"][0]["token_ids"]
    assert_matches_reference(stack, prompts, replies, 16)


async def test_chat_completion_renders_the_folder_template_and_matches_transformers(stack):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Héllo 🙂"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "The fox?"},
    ]
    tokenizer = transformers.AutoTokenizer.from_pretrained(stack.folder)
    expected_prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    body = {
        "messages": messages,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    async with aiohttp.ClientSession() as session:
        reply = await post(session, f"{stack.served.url}/v1/chat/completions", body)
    assert reply["model"] == stack.folder.name
    assert reply["usage"]["prompt_tokens"] == len(expected_prompt)
    choice = reply["choices"][0]
    assert reply["prompt_token_ids"] == expected_prompt  # beside the choices for chat, as vLLM
    assert choice["message"]["role"] == "assistant"
    assert choice["token_ids"] == reference_greedy(stack.reference, expected_prompt, 16)
    # Ids past the tokenizer's 300 (the model has 320) decode to nothing, as in transformers.
    expected_text = tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert choice["message"]["content"] == expected_text


async def test_text_prompt_is_tokenized_like_transformers(stack):
    text = "The quick brown fox jumps over the lazy dog. ça va? 世界"
    tokenizer = transformers.AutoTokenizer.from_pretrained(stack.folder)
    expected_prompt = tokenizer(text).input_ids
    body = {"prompt": text, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    body["return_token_ids"] = True
    async with aiohttp.ClientSession() as session:
        reply = await post(session, f"{stack.served.url}/v1/completions", body)
    choice = reply["choices"][0]
    assert choice["prompt_token_ids"] == expected_prompt
    assert choice["token_ids"] == reference_greedy(stack.reference, expected_prompt, 8)
    assert choice["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)


LOGPROB_TOL = 1e-4


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: transformers' log-softmax at every position (float32)."""
    return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def token_id(name: str) -> int:
    assert name.startswith("token_id:"), name  # return_tokens_as_token_ids
    return int(name.removeprefix("token_id:"))


async def test_greedy_logprobs_over_http_match_transformers_log_softmax(stack):
    rng = random.Random(3)
    prompt = random_prompt(rng, 11)
    body = {
        "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "logprobs": 3, "prompt_logprobs": 2, "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }  # fmt: skip
    async with aiohttp.ClientSession() as session:
        reply = await post(session, f"{stack.served.url}/v1/completions", body)
        choice = reply["choices"][0]
        expected = reference_logprobs(stack.reference, [*prompt, *choice["token_ids"]])
        lp = choice["logprobs"]
        for i, (name, value, top) in enumerate(
            zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)
        ):
            row = expected[len(prompt) - 1 + i]
            assert token_id(name) == choice["token_ids"][i] == int(row.argmax())
            assert abs(value - row[token_id(name)].item()) < LOGPROB_TOL
            top_ids = row.topk(3).indices.tolist()
            assert sorted(token_id(t) for t in top) == sorted(top_ids)
            for t, v in top.items():
                assert abs(v - row[token_id(t)].item()) < LOGPROB_TOL
        assert choice["prompt_logprobs"][0] is None
        for position, entry in enumerate(choice["prompt_logprobs"][1:], start=1):
            row = expected[position - 1]
            assert str(prompt[position]) in entry and 1 <= len(entry) <= 3
            for tid, info in entry.items():
                assert abs(info["logprob"] - row[int(tid)].item()) < LOGPROB_TOL
        chat = await post(
            session,
            f"{stack.served.url}/v1/chat/completions",
            {"messages": [{"role": "user", "content": "The fox?"}], "max_tokens": 5,
             "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2,
             "return_tokens_as_token_ids": True, "return_token_ids": True},
        )  # fmt: skip
    ids = [*chat["prompt_token_ids"], *chat["choices"][0]["token_ids"]]
    expected = reference_logprobs(stack.reference, ids)
    content = chat["choices"][0]["logprobs"]["content"]
    for i, entry in enumerate(content):
        row = expected[len(chat["prompt_token_ids"]) - 1 + i]
        assert token_id(entry["token"]) == int(row.argmax())
        assert abs(entry["logprob"] - row.max().item()) < LOGPROB_TOL
        for top in entry["top_logprobs"]:
            assert abs(top["logprob"] - row[token_id(top["token"])].item()) < LOGPROB_TOL


def lm_eval_loglikelihood_body(model: str, prompts: list[list[int]]) -> dict[str, Any]:
    """The body lm-evaluation-harness's `local-completions` model sends for loglikelihood
    requests (lm_eval 0.4.13, models/openai_completions.py `_create_payload(generate=False)`):
    context + continuation as token ids, one generated token whose entry it drops."""
    return {
        "model": model, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
        "seed": 1234, "echo": True,
    }  # fmt: skip


async def test_prompt_scoring_matches_transformers_log_softmax(stack):
    """echo + max_tokens 0 (vLLM's prompt scoring) and lm-eval's loglikelihood body: each
    prompt token's logprob equals transformers' log-softmax within 1e-4."""
    rng = random.Random(4)
    contexts = [random_prompt(rng, n) for n in (7, 12)]
    # A random continuation (not greedy) and the model's own greedy one (greedy).
    continuations = [random_prompt(rng, 3), reference_greedy(stack.reference, contexts[1], 5)]
    prompts = [c + k for c, k in zip(contexts, continuations, strict=True)]
    url = f"{stack.served.url}/v1/completions"
    async with aiohttp.ClientSession() as session:
        scored = await post(session, url, {"prompt": prompts, "max_tokens": 0, "echo": True,
                                           "logprobs": 1, "return_token_ids": True})  # fmt: skip
        harness = await post(session, url, lm_eval_loglikelihood_body(stack.folder.name, prompts))
    for i, ids in enumerate(prompts):
        expected = reference_logprobs(stack.reference, ids)
        choice = scored["choices"][i]
        assert choice["index"] == i and choice["finish_reason"] == "length"
        assert choice["prompt_token_ids"] == ids and choice["text"] == ""  # ids, so no text
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids)  # the prompt's alone: no sampled token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for position in range(1, len(ids)):
            row = expected[position - 1]
            assert abs(lp["token_logprobs"][position] - row[ids[position]].item()) < LOGPROB_TOL
            top = lp["top_logprobs"][position]  # the prompt token and the most likely one
            assert max(top.values()) == pytest.approx(row.max().item(), abs=LOGPROB_TOL)
        # lm-eval reads token_logprobs[ctxlen:-1] (the last is the sampled token's) and calls the
        # continuation greedy when each of its tokens is the most likely.
        entry = harness["choices"][i]["logprobs"]
        ctxlen = len(contexts[i])
        assert len(entry["token_logprobs"]) == len(ids) + 1
        got = sum(entry["token_logprobs"][ctxlen:-1])
        want = sum(expected[p - 1, ids[p]].item() for p in range(ctxlen, len(ids)))
        assert abs(got - want) < LOGPROB_TOL * len(continuations[i])
        greedy = all(
            v == max(top.values())
            for v, top in zip(entry["token_logprobs"][ctxlen:-1],
                              entry["top_logprobs"][ctxlen:-1], strict=True)
        )  # fmt: skip
        want_greedy = all(int(expected[p - 1].argmax()) == ids[p] for p in range(ctxlen, len(ids)))
        assert greedy == want_greedy == (i == 1)
    assert scored["usage"]["prompt_tokens"] == sum(map(len, prompts))


async def test_sharded_checkpoint_answers_exactly_as_the_unsharded_one(tmp_path):
    arch = "LlamaForCausalLM"
    single = make_tiny_checkpoint(tmp_path / "single", arch)
    sharded = make_tiny_checkpoint(tmp_path / "sharded", arch, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (sharded / "model.safetensors").exists()
    rng = random.Random(3)
    prompts = [random_prompt(rng, n) for n in (5, 16, 29)]
    shape = {
        "num_gpu_blocks": NUM_GPU_BLOCKS,
        "max_model_len": MAX_MODEL_LEN,
        "block_size": BLOCK_SIZE,
    }
    with serving(launch(single, **shape), launch(sharded, **shape)) as (one, many):
        from_single, from_sharded = await asyncio.gather(
            complete_ids(one.url, prompts), complete_ids(many.url, prompts)
        )
    ids_single = [r["choices"][0]["token_ids"] for r in from_single]
    ids_sharded = [r["choices"][0]["token_ids"] for r in from_sharded]
    assert ids_sharded == ids_single
    reference = load_reference(single)
    assert ids_sharded == [reference_greedy(reference, p, MAX_TOKENS) for p in prompts]
