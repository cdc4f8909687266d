"""Tensor parallelism on the CPU: TP=2 and TP=4 ranks (spawned gloo processes) compute the logits
TP=1 computes, dense and paged, for the tiny Llama, Mistral and Qwen2 checkpoints."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from gpu_worker.checkpoint import load_checkpoint, load_model
from gpu_worker.parallel import TensorParallel, TensorParallelError, local_heads
from gpu_worker.runner import ModelRunner
from tests.gpu_worker.checkpoints import ARCHITECTURES, make_tiny_checkpoint
from tests.gpu_worker.driver import MiniLedger
from tests.gpu_worker.tp_ranks import run_ranks

TOL = {"atol": 1e-4, "rtol": 1e-4}
PROMPTS = {"a": 37, "b": 9, "c": 21}


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 300) for _ in range(length)]


def logits_of(tp: TensorParallel, folders: list[str]) -> dict[str, torch.Tensor]:
    """Per checkpoint: the dense logits of one prompt, and the paged logits of every sampling
    row of a chunked-prefill + decode run (with a preemption) through the runner."""
    out: dict[str, torch.Tensor] = {}
    for i, folder in enumerate(folders):
        model = load_checkpoint(folder, dtype="float32", tp=tp)
        out[f"{i}.dense"] = model.dense_logits(prompt(0, 30))
        runner = ModelRunner(model, num_blocks=64, block_size=16)
        ledger = MiniLedger(runner)
        for req_id, n in PROMPTS.items():
            ledger.add(req_id, prompt(n, n))
        rows = []
        for step in range(8):
            if step == 4:
                ledger.preempt("b")  # recomputed from its tokens on every rank
            result = ledger.step(max_chunk=16)
            if result.logits is not None:
                rows.append(result.logits)
        out[f"{i}.paged"] = torch.cat(rows)
        tokens = [t for s in sorted(ledger.seqs) for t in ledger.seqs[s].outputs]
        out[f"{i}.tokens"] = torch.tensor(tokens)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("tp")
    return [str(make_tiny_checkpoint(root / a, a, seed=3)) for a in ARCHITECTURES]


@pytest.fixture(scope="module")
def reference(folders) -> dict[str, torch.Tensor]:
    return logits_of(TensorParallel(), folders)


@pytest.mark.parametrize("size", [2, 4])
def test_tp_logits_equal_tp1(folders, reference, size, tmp_path: Path):
    # The checkpoints have 4 query heads and 2 KV heads: TP=4 replicates each KV head twice.
    got = run_ranks(logits_of, size, tmp_path, folders)
    assert set(got) == set(reference)
    for key, want in reference.items():
        if key.endswith("tokens"):
            assert got[key].tolist() == want.tolist(), key
        else:
            torch.testing.assert_close(got[key], want, **TOL, msg=lambda m, k=key: f"{k}: {m}")


def test_tp1_model_is_bit_identical_to_the_whole_model(folders):
    # Size 1 runs the same kernels on the same tensors: not close, equal.
    a = load_checkpoint(folders[0], dtype="float32")
    b = load_checkpoint(folders[0], dtype="float32", tp=TensorParallel(0, 1))
    ids = prompt(5, 40)
    assert torch.equal(a.dense_logits(ids), b.dense_logits(ids))


def test_rank_shards_hold_a_slice_of_each_tensor(folders):
    whole = load_checkpoint(folders[2], dtype="float32")  # Qwen2: q/k/v biases
    rank = load_checkpoint(folders[2], dtype="float32", tp=TensorParallel(1, 2))
    k_whole = whole.get_parameter("model.layers.0.self_attn.k_proj.bias")
    k_rank = rank.get_parameter("model.layers.0.self_attn.k_proj.bias")
    head_dim = whole.config.head_dim
    assert torch.equal(k_rank, k_whole[head_dim : 2 * head_dim])  # KV head 1 of 2
    down = rank.get_parameter("model.layers.1.mlp.down_proj.weight")
    assert torch.equal(down, whole.get_parameter("model.layers.1.mlp.down_proj.weight")[:, 48:])
    assert rank.num_local_heads == 2 and rank.num_local_kv_heads == 1


def test_default_model_shards_from_the_same_seeded_weights():
    whole = load_model("tiny", seed=7)
    rank = load_model("tiny", seed=7, tp=TensorParallel(1, 2))
    emb = rank.get_parameter("model.embed_tokens.weight")
    assert torch.equal(emb, whole.get_parameter("model.embed_tokens.weight")[emb.shape[0] :])


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "message"),
    [
        (4, 2, 3, "num_attention_heads (4) is not divisible by tensor_parallel_size (3)"),
        (8, 6, 4, "num_key_value_heads (6) is not divisible by tensor_parallel_size (4)"),
        (12, 4, 6, "tensor_parallel_size (6) is not divisible by num_key_value_heads (4)"),
    ],
)
def test_head_counts_that_do_not_divide_are_refused(heads, kv_heads, size, message):
    with pytest.raises(TensorParallelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        local_heads(heads, kv_heads, TensorParallel(0, size))


def test_kv_heads_are_replicated_when_ranks_outnumber_them():
    assert local_heads(8, 2, TensorParallel(3, 8)) == (1, 1)
    assert local_heads(32, 8, TensorParallel(0, 4)) == (8, 2)
