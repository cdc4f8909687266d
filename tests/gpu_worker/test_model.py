"""The decoder itself: Hugging Face parameter names and shapes, config parsing (transformers 4
and 5 layouts), RoPE scaling, and the seeded default model."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from gpu_worker.checkpoint import load_model
from gpu_worker.model import (
    LlamaForCausalLM,
    ModelConfig,
    ModelConfigError,
    RMSNorm,
    rope_inv_freq,
)
from services.tokenization.tokenizer import ByteTokenizer

HF_LLAMA = dict(
    vocab_size=258,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)


def test_parameter_names_and_shapes_are_hugging_faces():
    ours = LlamaForCausalLM(
        ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], **HF_LLAMA})
    )
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_LLAMA))
    assert shapes(ours) == shapes(theirs)


def shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def test_transformers4_config_layout_and_defaults():
    cfg = ModelConfig.from_hf(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": 10,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 1,
            "num_attention_heads": 8,
            "rope_theta": 5e5,
            "rope_scaling": {"type": "linear", "factor": 2.0},
            "torch_dtype": "bfloat16",
            "sliding_window": 4096,
            "use_sliding_window": False,
        }
    )
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.rope_theta) == (8, 8, 5e5)
    assert cfg.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert (cfg.qkv_bias, cfg.o_bias, cfg.dtype) == (True, False, "bfloat16")
    assert cfg.sliding_window is None  # Qwen2 carries a window it does not use
    plain = ModelConfig.from_hf({**_llama(), "rope_theta": 5e5})
    torch.testing.assert_close(rope_inv_freq(cfg), rope_inv_freq(plain) / 2)


def _llama(**extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        **HF_LLAMA,
        "head_dim": 8,
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        **extra,
    }


def test_llama3_rope_frequencies_match_transformers():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    params = dict(HF_LLAMA, head_dim=128, hidden_size=512, max_position_embeddings=131072)
    hf_cfg = transformers.LlamaConfig(**params, rope_scaling=dict(scaling), rope_theta=5e5)
    hf_freq = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_cfg).inv_freq
    ours = rope_inv_freq(
        ModelConfig.from_hf({**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})
    )
    torch.testing.assert_close(ours, hf_freq, rtol=0, atol=0)
    unscaled = rope_inv_freq(ModelConfig.from_hf(_llama(head_dim=128, rope_theta=5e5)))
    assert torch.equal(ours[:10], unscaled[:10])  # short wavelengths kept
    torch.testing.assert_close(ours[-10:], unscaled[-10:] / 8)  # long ones divided by factor


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"architectures": ["GemmaForCausalLM"]}, "architecture 'GemmaForCausalLM'"),
    ],
)
def test_unsupported_configs_are_named(bad, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf(_llama(**bad))


def test_default_model_is_seeded_by_kvledger_seed(monkeypatch):
    a, b = load_model("tiny", seed=0), load_model("tiny", seed=1)
    monkeypatch.setenv("KVLEDGER_SEED", "1")
    c = load_model("tiny")
    ids = [256, *b"seeded"]
    assert not torch.equal(a.dense_logits(ids), b.dense_logits(ids))
    assert torch.equal(b.dense_logits(ids), c.dense_logits(ids))


def test_default_model_greedy_text_is_printable_and_prompt_dependent(tiny_model):
    tok = ByteTokenizer()
    continuations = []
    for text in ["Hello, my name is", "The capital of France is", "def main():"]:
        ids = tok.encode(text)
        logits = tiny_model.dense_logits(ids)[-1]
        assert logits.std() > 1.0  # not flat
        for _ in range(16):
            ids.append(int(tiny_model.dense_logits(ids)[-1].argmax()))
        out = tok.decode(ids[-16:])
        assert all(c.isprintable() or c == "\n" for c in out)
        continuations.append(out)
    assert len(set(continuations)) == 3


@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_compute_the_same_and_keep_the_checkpoint_names(bias):
    cfg = {"architectures": ["Qwen2ForCausalLM" if bias else "LlamaForCausalLM"], **HF_LLAMA}
    model = LlamaForCausalLM(ModelConfig.from_hf(cfg))
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    ids = [5, 17, 99, 3, 42, 7, 250]
    before = model.dense_logits(ids)
    state = {name: t.clone() for name, t in model.state_dict().items()}
    model.fuse_projections()
    attention = model.model.layers[0].self_attn
    assert attention.qkv is not None and model.model.layers[0].mlp.gate_up is not None
    assert (attention.qkv.bias is not None) == bias
    after = model.dense_logits(ids)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert after[-1].argmax() == before[-1].argmax()
    fused_state = model.state_dict()
    assert list(fused_state) == list(state)  # Hugging Face's names, in their order
    for name, tensor in state.items():
        assert torch.equal(fused_state[name], tensor), name
    # A load into a linear's weight after fusing writes through its view into the stack.
    with torch.no_grad():
        attention.k_proj.weight.zero_()
    q_size = attention.q_proj.weight.shape[0]
    k_size = attention.k_proj.weight.shape[0]
    assert attention.qkv.weight[q_size : q_size + k_size].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_rounds_as_transformers_does(dtype):
    """float32 takes one fused call; every dtype must give transformers' LlamaRMSNorm bits."""
    torch.manual_seed(3)
    for size in (64, 576, 2048):
        norm = RMSNorm(size, 1e-5)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(size) * 0.5 + 1)
        norm = norm.to(dtype)
        theirs = LlamaRMSNorm(size, eps=1e-5).to(dtype)
        theirs.weight.data.copy_(norm.weight.data)
        for rows in (1, 7, 300):
            x = (torch.randn(rows, size) * torch.logspace(-2, 2, rows)[:, None]).to(dtype)
            assert torch.equal(norm(x), theirs(x)), (size, rows)
