"""Tiny random transformers checkpoints load and run token-for-token like transformers itself.

Tolerance: float32 last-token logits within atol 1e-4 + rtol 1e-4 of transformers' forward;
greedy tokens identical to `generate(do_sample=False)`, through prefix hits and preemption.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from gpu_worker.checkpoint import load_checkpoint, read_model_config
from gpu_worker.loading import CheckpointError, resolve_dtype
from gpu_worker.runner import ModelRunner
from services.tokenization.tokenizer import HFTokenizer
from tests.gpu_worker.checkpoints import ARCHITECTURES, make_tiny_checkpoint
from tests.gpu_worker.driver import MiniLedger, generate_greedy

TOL = {"atol": 1e-4, "rtol": 1e-4}
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys",
    "Héllo wörld 🙂",
    "def main():\n    return",
]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def folder(request, tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param)


def hf_model(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_first_step_logits_match_transformers(folder):
    runner = ModelRunner(load_checkpoint(folder, dtype="float32"), 64, 4)
    prompts = [HFTokenizer(folder).encode(t) for t in TEXTS]
    ledger = MiniLedger(runner)
    for i, ids in enumerate(prompts):
        ledger.add(f"r{i}", ids)
    out = ledger.step()  # one ragged prefill step of all prompts
    reference = hf_model(folder)
    with torch.no_grad():
        for row, ids in enumerate(prompts):
            expected = reference(torch.tensor([ids])).logits[0]
            torch.testing.assert_close(out.logits[row], expected[-1], **TOL)
            torch.testing.assert_close(runner.model.dense_logits(ids), expected, **TOL)


def test_greedy_tokens_match_transformers_generate(folder):
    runner = ModelRunner(load_checkpoint(folder), 96, 4)
    tok = HFTokenizer(folder)
    first = [tok.encode(t) for t in TEXTS]
    later = [first[0][:14] + tok.encode(" cat")[1:], tok.encode("Paged attention stores")]
    ledger = MiniLedger(runner)
    ours = generate_greedy(runner, first, 12, max_chunk=6, preempt_after={1: 3}, ledger=ledger)
    ours += generate_greedy(runner, later, 12, preempt_after={0: 5}, ledger=ledger)
    assert ledger.num_prefix_hit_tokens >= 12 and ledger.num_preemptions == 2
    reference = hf_model(folder)
    for ids, got in zip(first + later, ours, strict=True):
        # An explicit mask: generate() would otherwise take BOS (id 0 = pad here) for padding.
        expected = reference.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
        assert len(expected) == 12 and got == expected


def test_sharded_checkpoint_loads_the_same_weights(tmp_path):
    single = load_checkpoint(make_tiny_checkpoint(tmp_path / "one", "LlamaForCausalLM"))
    folder = make_tiny_checkpoint(tmp_path / "many", "LlamaForCausalLM", max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    sharded = load_checkpoint(folder)
    for (name, a), (_, b) in zip(
        single.state_dict().items(), sharded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_tied_embeddings_and_llama_biases_load(tmp_path):
    folder = make_tiny_checkpoint(
        tmp_path, "LlamaForCausalLM", tie_word_embeddings=True, attention_bias=True, mlp_bias=True
    )
    model = load_checkpoint(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    ids = HFTokenizer(folder).encode(TEXTS[0])
    with torch.no_grad():
        expected = hf_model(folder)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(model.dense_logits(ids), expected, **TOL)


def test_requested_dtype_is_applied(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "Qwen2ForCausalLM")
    model = load_checkpoint(folder, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert resolve_dtype("auto", "float16", "cpu") == torch.float32  # CPU half is slow
    assert resolve_dtype("auto", "bfloat16", "cuda") == torch.bfloat16
    with pytest.raises(CheckpointError, match="dtype 'int8'"):
        resolve_dtype("int8", "float32", "cpu")


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel") as err:
        load_checkpoint(folder)
    assert "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM" in str(err.value)


def test_unsupported_rope_scaling_is_refused(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    edit_config(folder, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(CheckpointError, match="rope type 'dynamic' is not supported"):
        read_model_config(folder)


def test_sliding_window_needs_max_model_len_within_the_window(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "MistralForCausalLM", sliding_window=256)
    with pytest.raises(CheckpointError, match=r"sliding-window attention .*max_model_len <= 256"):
        load_checkpoint(folder)
    assert read_model_config(folder, max_model_len=256).sliding_window == 256


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor\(s\).*layers\.1\.mlp\.up_proj"):
        load_checkpoint(folder)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(96, 64)
    tensors["model.layers.7.mlp.up_proj.weight"] = torch.zeros(96, 64)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.7\.mlp"):
        load_checkpoint(folder)


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    edit_config(folder, intermediate_size=128)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder)
    # down_proj [hidden, intermediate] comes first in the file's order
    assert str(err.value) == (
        "shape mismatch for 'model.layers.0.mlp.down_proj.weight' in model.safetensors: "
        "config.json implies [64, 128], the checkpoint has [64, 96]"
    )


def test_missing_folder_files_and_shards_are_clear(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist; kvledger never downloads"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        load_checkpoint(tmp_path / "empty")
    folder = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", max_shard_size="40KB")
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard.name} named in"):
        load_checkpoint(folder)
    (folder / "model.safetensors.index.json").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="pickle weights: kvledger loads safetensors only"):
        load_checkpoint(folder)
