"""The paged forward through ModelRunner equals the dense cache-free forward of the same model.

Tolerance: float32 logits within atol 1e-4 + rtol 1e-4 (observed differences ~1e-6), and
greedy tokens identical, across ragged batches, chunked prefill, prefix hits and preemption.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from gpu_worker.checkpoint import load_model
from gpu_worker.model import LlamaForCausalLM
from gpu_worker.runner import ModelRunner
from tests.gpu_worker.driver import MiniLedger, generate_greedy

TOL = {"atol": 1e-4, "rtol": 1e-4}


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [256] + [rng.randrange(32, 127) for _ in range(length - 1)]  # BOS + printable bytes


def dense_greedy(model: LlamaForCausalLM, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model.dense_logits(ids)[-1].argmax()))
    return ids[-n:]


def check_step(ledger: MiniLedger, model: LlamaForCausalLM, **step_kwargs) -> dict[str, int]:
    """Run one step; every sampled row's logits must equal the dense last-token logits."""
    before = {r: list(s.token_ids) for r, s in ledger.seqs.items()}
    out = ledger.step(**step_kwargs)
    for row, req_id in enumerate(out.sampled):
        torch.testing.assert_close(out.logits[row], model.dense_logits(before[req_id])[-1], **TOL)
    return out.sampled


def test_ragged_batch_prefill_then_decode_matches_dense(make_runner, tiny_model):
    runner = make_runner(block_size=4)
    ledger = MiniLedger(runner)
    prompts = {f"r{n}": prompt(n, n) for n in (1, 7, 16, 33)}
    for req_id, ids in prompts.items():
        ledger.add(req_id, ids)
    for _ in range(6):
        assert set(check_step(ledger, tiny_model)) == set(prompts)
    for req_id, ids in prompts.items():
        assert ledger.seqs[req_id].outputs == dense_greedy(tiny_model, ids, 6)


def test_chunked_prefill_samples_only_when_the_chunk_reaches_the_end(make_runner, tiny_model):
    runner = make_runner(block_size=4)
    ledger = MiniLedger(runner)
    ledger.add("long", prompt(1, 40))
    ledger.add("short", prompt(2, 5))
    sampled_per_step = [set(check_step(ledger, tiny_model, max_chunk=12)) for _ in range(5)]
    # long: 12 + 12 + 12 + 4 prompt tokens, so it samples first in step 4; short samples always.
    both = {"long", "short"}
    assert sampled_per_step == [{"short"}, {"short"}, {"short"}, both, both]
    assert ledger.seqs["long"].outputs == dense_greedy(tiny_model, prompt(1, 40), 2)
    assert ledger.seqs["short"].outputs == dense_greedy(tiny_model, prompt(2, 5), 5)


def test_prefix_cache_hit_computes_only_the_uncached_tokens(make_runner, tiny_model):
    runner = make_runner(block_size=4)
    ledger = MiniLedger(runner)
    first = prompt(3, 24)
    ledger.add("a", first)
    check_step(ledger, tiny_model)
    shared = ledger.seqs["a"].block_ids[:4]
    before = [(k[shared].clone(), v[shared].clone()) for k, v in runner.kv_caches]

    second = first[:16] + prompt(4, 10)[1:]  # 16 shared tokens = 4 full blocks, then 9 new
    ledger.add("b", second)
    out = ledger.step(only=["b"])
    seq = ledger.seqs["b"]
    assert seq.num_cached_tokens == 16 and seq.block_ids[:4] == shared
    assert out.num_tokens == 9  # the runner computed only positions 16..24
    torch.testing.assert_close(out.logits[0], tiny_model.dense_logits(second)[-1], **TOL)
    for (k0, v0), (k, v) in zip(before, runner.kv_caches, strict=True):
        assert torch.equal(k[shared], k0) and torch.equal(v[shared], v0)  # shared blocks untouched
    for _ in range(4):
        check_step(ledger, tiny_model)
    assert seq.outputs == dense_greedy(tiny_model, second, 5)


def test_preempted_request_resumes_as_new_with_prompt_and_outputs(make_runner, tiny_model):
    runner = make_runner(block_size=4)
    ledger = MiniLedger(runner, prefix_caching=False)  # resume recomputes everything
    ledger.add("victim", prompt(5, 11))
    ledger.add("other", prompt(6, 6))
    for _ in range(3):
        check_step(ledger, tiny_model)
    old_blocks = list(ledger.seqs["victim"].block_ids)
    ledger.preempt("victim")
    ledger.step(only=["other"])  # the worker drops the victim's state in this step
    assert "victim" not in runner.requests
    ledger.add("thief", prompt(7, 20))  # takes fresh blocks; the victim resumes elsewhere
    for _ in range(5):
        check_step(ledger, tiny_model)
    victim = ledger.seqs["victim"]
    assert victim.num_cached_tokens == 0 and victim.block_ids[0] not in old_blocks
    assert victim.outputs == dense_greedy(tiny_model, prompt(5, 11), 8)


def test_generate_greedy_mixed_workload_matches_dense(make_runner, tiny_model):
    runner = make_runner(num_blocks=48, block_size=4)
    base = prompt(8, 13)
    prompts = [base, base[:9] + prompt(9, 5)[1:], prompt(10, 3), prompt(11, 22)]
    ledger = MiniLedger(runner)
    outs = generate_greedy(
        runner, prompts, 10, max_chunk=7, preempt_after={1: 4, 3: 2}, ledger=ledger
    )
    later = [base[:12] + prompt(12, 4)[1:]]  # admitted after base's blocks were cached
    outs += generate_greedy(runner, later, 10, ledger=ledger)
    assert ledger.num_preemptions == 2 and ledger.num_prefix_hit_tokens >= 8
    assert outs == [dense_greedy(tiny_model, p, 10) for p in prompts + later]
    assert len({tuple(o) for o in outs}) == len(outs)  # different prompts, different text


def check_low_precision_step(
    ledger: MiniLedger, model: LlamaForCausalLM, exact: LlamaForCausalLM, **step_kwargs
) -> dict[str, int]:
    """One step in float16/bfloat16: each sampled row's logits must be as close to the exact
    result (the same weights in float32) as the dense forward in the same low precision is.

    Token-for-token equality is not asked for: in low precision two summation orders can round
    a near-tie either way, and the sequences would then part for a legitimate reason.
    """
    before = {r: list(s.token_ids) for r, s in ledger.seqs.items()}
    out = ledger.step(**step_kwargs)
    for row, req_id in enumerate(out.sampled):
        truth = exact.dense_logits(before[req_id])[-1]
        dense = model.dense_logits(before[req_id])[-1].float()
        paged = out.logits[row].float()
        allowed = 2 * (dense - truth).abs().max() + 1e-2 * truth.abs().max()
        assert (paged - truth).abs().max() <= allowed, req_id
    return out.sampled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_runner_matches_dense_on_the_same_device(dtype):
    # The default model on a GPU: head_dim 64, a GQA group of 2, in float16/bfloat16, a shape
    # and dtypes the CUDA kernels serve, so the runner must run them, not the torch reference.
    model = load_model("tiny", dtype=dtype, device="cuda")
    assert model.config.head_dim in (64, 128) and model.lm_head.weight.dtype == dtype
    runner = ModelRunner(model, 256, 16)
    assert runner.backend.name == "cuda"
    exact = copy.deepcopy(model).float()
    ledger = MiniLedger(runner)
    base = prompt(20, 40)
    ledger.add("a", base)
    ledger.add("b", prompt(21, 7))
    for _ in range(4):  # chunked prefill, then decode
        check_low_precision_step(ledger, model, exact, max_chunk=24)
    ledger.add("c", base[:32] + prompt(22, 9)[1:])  # a prefix hit on a's two full blocks
    check_low_precision_step(ledger, model, exact, max_chunk=24)
    assert ledger.seqs["c"].num_cached_tokens == 32
    ledger.preempt("b")
    for _ in range(8):  # b resumes by recompute
        sampled = check_low_precision_step(ledger, model, exact, max_chunk=24)
    assert set(sampled) == {"a", "b", "c"} and ledger.num_preemptions == 1
