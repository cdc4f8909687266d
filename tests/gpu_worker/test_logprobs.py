"""Logprobs on the worker: vLLM's raw_logprobs (log-softmax of the model's raw logits), for the
sampled tokens and the prompt, checked against transformers' own forward pass.

Tolerance: 1e-4 absolute on every logprob (float32 checkpoints).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from gpu_worker.checkpoint import load_checkpoint
from gpu_worker.logprobs import gather_logprobs
from gpu_worker.runner import ModelRunner
from services.tokenization.tokenizer import HFTokenizer
from services.wire.messages import SamplingParams, TokenLogprobs
from tests.gpu_worker.checkpoints import ARCHITECTURES, make_tiny_checkpoint
from tests.gpu_worker.driver import MiniLedger

TOL = 1e-4
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Héllo wörld 🙂 def main():"]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def folder(request, tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param)


def reference_logprobs(folder: Path, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: transformers' log-softmax at every position."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def assert_entry(entry: TokenLogprobs, expected: torch.Tensor, token: int, k: int) -> None:
    """The chosen token's logprob and rank, then the top k in order, as vLLM lays them out."""
    assert entry.token_ids[0] == token
    assert abs(entry.logprobs[0] - expected[token].item()) < TOL
    value = expected[token]
    # Tokens within TOL of the chosen one may fall on either side of it.
    assert int((expected > value + TOL).sum()) < entry.rank <= int((expected >= value - TOL).sum())
    top = torch.topk(expected, k)
    assert len(entry.token_ids) == k + 1
    assert entry.token_ids[1:] == top.indices.tolist()
    assert (
        max(abs(a - b) for a, b in zip(entry.logprobs[1:], top.values.tolist(), strict=True)) < TOL
    )


def test_greedy_and_prompt_logprobs_match_transformers(folder):
    runner = ModelRunner(load_checkpoint(folder, dtype="float32"), 64, 4)
    tok = HFTokenizer(folder)
    ledger = MiniLedger(runner, prefix_caching=False)
    params = SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2)
    prompts = {f"r{i}": tok.encode(t) for i, t in enumerate(TEXTS)}
    for req_id, ids in prompts.items():
        ledger.add(req_id, ids, params)
    sampled: dict[str, list[TokenLogprobs]] = {r: [] for r in prompts}
    prompt: dict[str, dict[int, TokenLogprobs]] = {r: {} for r in prompts}
    for _ in range(12):  # chunks of 5: prompt logprobs arrive over several steps
        out = ledger.step(max_chunk=5)
        assert set(out.logprobs) == set(out.sampled)
        for req_id, entry in out.logprobs.items():
            sampled[req_id].append(entry)
        for req_id, chunk in out.prompt_logprobs.items():
            for offset, entry in enumerate(chunk.positions):
                assert chunk.start + offset not in prompt[req_id]  # each position once
                prompt[req_id][chunk.start + offset] = entry
    for req_id, ids in prompts.items():
        seq = ledger.seqs[req_id]
        expected = reference_logprobs(folder, seq.token_ids)
        assert sorted(prompt[req_id]) == list(range(1, len(ids)))
        for position, entry in prompt[req_id].items():
            assert_entry(entry, expected[position - 1], ids[position], k=2)
        assert len(sampled[req_id]) == len(seq.outputs) >= 3
        for i, (entry, token) in enumerate(zip(sampled[req_id], seq.outputs, strict=True)):
            assert entry.rank == 1  # greedy: the chosen token is the most likely
            assert_entry(entry, expected[len(ids) - 1 + i], token, k=3)


def test_logprobs_are_raw_whatever_the_penalties_and_only_for_requests_that_ask(make_runner):
    runner = make_runner()
    ledger = MiniLedger(runner, prefix_caching=False)
    prompt = list(range(40, 52))
    ledger.add("plain", prompt, SamplingParams(temperature=0.0, logprobs=0))
    biased = SamplingParams(temperature=0.7, seed=5, logprobs=0, logit_bias={7: 50.0})
    ledger.add("biased", prompt, biased)
    ledger.add("silent", prompt, SamplingParams(temperature=0.0))
    out = ledger.step()
    assert set(out.logprobs) == {"plain", "biased"} and not out.prompt_logprobs
    assert out.sampled["biased"] == 7  # the bias decided the token ...
    raw = runner.model.dense_logits(prompt)[-1].float().log_softmax(-1)
    entry = out.logprobs["biased"]
    assert entry.token_ids == [7] and abs(entry.logprobs[0] - raw[7].item()) < TOL
    assert entry.rank == int(
        (raw >= raw[7]).sum()
    )  # ... but its logprob is the raw one (ties count)


def test_gather_logprobs_counts_ties_in_the_rank_and_caps_top_k_at_the_vocab():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    (entry,) = gather_logprobs(logits, [2], [10])
    assert entry.rank == 2 and len(entry.token_ids) == 5
    assert sorted(entry.token_ids[1:3]) == [1, 2]
    assert gather_logprobs(logits, [], []) == []
