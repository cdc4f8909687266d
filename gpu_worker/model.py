"""A Llama-architecture decoder (Llama, Mistral, Qwen2) with Hugging Face's parameter names.

`forward` runs flattened ragged tokens over the paged KV cache through `kernels`; `dense_logits`
runs one sequence with plain causal attention and no cache, the ground truth tests compare to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Slices,
    VocabParallelEmbedding,
)
from gpu_worker.parallel import SINGLE, TensorParallel, kv_head_start, local_heads
from kernels import AttentionPlan, KVCache

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelConfigError(ValueError):
    """A config.json this decoder cannot run exactly; the text says which field and why."""


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None, or {"rope_type": "linear"|"llama3", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias only
    mlp_bias: bool = False
    dtype: str = "float32"  # the checkpoint's own dtype
    sliding_window: int | None = None  # an active sliding window (see checkpoint.py), else None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json dict (transformers 4.x or 5.x layout)."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else "<none>"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"architecture {arch!r} is not supported; kvledger runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
        heads = int(hf["num_attention_heads"])
        theta, scaling = _rope_from_hf(hf)
        qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=not qwen2 and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
            sliding_window=_active_sliding_window(hf, arch),
        )


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 folds rope_theta into rope_parameters; 4.x keeps rope_theta + rope_scaling.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        supported = ", ".join(SUPPORTED_ROPE_TYPES)
        raise ModelConfigError(f"rope type {rope_type!r} is not supported (supported: {supported})")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelConfigError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    return theta, params


def _active_sliding_window(hf: dict[str, Any], arch: str) -> int | None:
    window = hf.get("sliding_window")
    if window is None:
        return None
    if arch == "Qwen2ForCausalLM" and not hf.get("use_sliding_window", False):
        return None  # Qwen2 configs carry a window they do not use unless use_sliding_window
    return int(window)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim // 2] in float32, with linear or llama3 scaling."""
    dim = cfg.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (cfg.rope_theta**exponent)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    return _llama3_inv_freq(inv_freq, scaling, factor, cfg.max_position_embeddings)


def _llama3_inv_freq(
    inv_freq: torch.Tensor, scaling: dict[str, Any], factor: float, max_positions: int
) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by factor, short ones kept, the band between blended.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling.get("original_max_position_embeddings", max_positions))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(in_band, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by position (Hugging Face's half-split layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One call where both are float32 (the CPU's serving dtype): the same arithmetic,
            # bit for bit (tests/gpu_worker/test_model.py), ~4 us less each of a step's 61 norms.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 and scale in the input dtype, as transformers does, so that
        # half-precision checkpoints round the same way.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class FusedLinear:
    """Linears that read the same input as one matmul over their weights stacked: q/k/v, and
    gate/up. Each linear's weight (and bias) becomes a view of its rows of the stack, so the
    model's parameters and `state_dict()` keep Hugging Face's names and share the memory; a
    decode step then runs 4 matmuls a layer instead of 7 (each a call's overhead and a pass over
    the input at batch 1). Made after the weights are loaded (`fuse_projections`): a later load
    into a linear's weight writes through its view into the stack."""

    def __init__(self, *linears: ColumnParallelLinear) -> None:
        self.sizes = [layer.weight.shape[0] for layer in linears]
        self.weight = torch.cat([layer.weight.detach() for layer in linears])
        biases = [layer.bias for layer in linears if layer.bias is not None]
        self.bias = torch.cat([b.detach() for b in biases]) if biases else None
        start = 0
        for layer, size in zip(linears, self.sizes, strict=True):
            layer.weight.data = self.weight[start : start + size]
            if layer.bias is not None and self.bias is not None:
                layer.bias.data = self.bias[start : start + size]
            start += size

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.matmul(x).split(self.sizes, dim=-1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The stacked outputs [T, sum(sizes)], unsplit."""
        return F.linear(x, self.weight, self.bias)


class LlamaAttention(nn.Module):
    """This rank's query heads and the KV heads they read (all of them at tensor-parallel size 1)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = local_heads(
            cfg.num_attention_heads, cfg.num_key_value_heads, tp
        )
        self.head_dim = d = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        q_start, kv_start = tp.rank * q_size, kv_head_start(cfg.num_key_value_heads, tp) * d
        hidden, bias = cfg.hidden_size, cfg.qkv_bias
        self.q_proj = ColumnParallelLinear(hidden, q_start, q_size, bias, tp)
        self.k_proj = ColumnParallelLinear(hidden, kv_start, kv_size, bias, tp)
        self.v_proj = ColumnParallelLinear(hidden, kv_start, kv_size, bias, tp)
        self.o_proj = RowParallelLinear(q_start, q_size, hidden, cfg.o_bias, tp)
        self.qkv: FusedLinear | None = None  # `fuse_projections`

    def fuse_projections(self) -> None:
        self.qkv = FusedLinear(self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache | None,
        plan: AttentionPlan | None,
    ) -> torch.Tensor:
        n, heads, d = x.shape[0], self.num_heads, self.head_dim
        if self.qkv is not None:
            # q and k side by side in the fused output: rotated by one apply_rope (half the
            # small ops a layer at batch 1, the same arithmetic element by element)
            qkv = self.qkv.matmul(x)
            qk = apply_rope(qkv[:, : (heads + self.num_kv_heads) * d].view(n, -1, d), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, (heads + self.num_kv_heads) * d :].view(n, self.num_kv_heads, d)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = apply_rope(q.view(n, heads, d), cos, sin)
            k = apply_rope(k.view(n, self.num_kv_heads, d), cos, sin)
            v = v.view(n, self.num_kv_heads, d)
        if kv_cache is None or plan is None:
            out = self._dense(q, k, v)
        else:
            plan.write_kv(k, v, kv_cache)
            out = plan.attention(q, kv_cache, self.scale)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))

    def _dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = self.num_heads // self.num_kv_heads  # query head h reads kv head h // group
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            scale=self.scale,
        )
        return out.transpose(0, 1)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if cfg.intermediate_size % tp.size:
            raise ModelConfigError(
                f"intermediate_size ({cfg.intermediate_size}) is not divisible by "
                f"tensor_parallel_size ({tp.size})"
            )
        size = cfg.intermediate_size // tp.size
        start, hidden, bias = tp.rank * size, cfg.hidden_size, cfg.mlp_bias
        self.gate_proj = ColumnParallelLinear(hidden, start, size, bias, tp)
        self.up_proj = ColumnParallelLinear(hidden, start, size, bias, tp)
        self.down_proj = RowParallelLinear(start, size, hidden, bias, tp)
        self.gate_up: FusedLinear | None = None  # `fuse_projections`

    def fuse_projections(self) -> None:
        self.gate_up = FusedLinear(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, tp)
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache | None,
        plan: AttentionPlan | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus its LM head; `state_dict()` keys are exactly Hugging Face's.

    With `tp` of size N this is one rank's shard: its query and KV heads, 1/N of each MLP and
    of the vocabulary (`full_slices` says which part of each checkpoint tensor)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = LlamaModel(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        # What this rank's KV cache and attention hold (the whole model's at size 1).
        heads = local_heads(cfg.num_attention_heads, cfg.num_key_value_heads, tp)
        self.num_local_heads: int = heads[0]
        self.num_local_kv_heads: int = heads[1]
        self.tie_weights()
        # Not a buffer: meta-device construction and to_empty() would leave it uninitialised.
        self._inv_freq = rope_inv_freq(cfg)

    def fuse_projections(self) -> None:
        """Stack each layer's q/k/v and gate/up weights for one matmul each (`FusedLinear`);
        after the weights are loaded."""
        for layer in self.model.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config ties them (again after to_empty)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache] | None = None,
        plan: AttentionPlan | None = None,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of flattened tokens; paged when kv_caches is given."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self._rope_tables(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, None if kv_caches is None else kv_caches[i], plan)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits on every rank (all-gathered under tensor parallelism)."""
        return self.lm_head(hidden)

    def full_slices(self, name: str) -> Slices | None:
        """The part of checkpoint tensor `name` this rank holds; None: the whole (norms)."""
        module_name, _, param = name.rpartition(".")
        module = self.get_submodule(module_name)
        slices = getattr(module, "full_slices", None)
        return None if slices is None else slices(param)

    @torch.inference_mode()
    def dense_logits(self, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] of one sequence at positions 0..T-1, plain causal attention."""
        device = self.lm_head.weight.device
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=device)
        positions = torch.arange(ids.shape[0], device=device)
        return self.compute_logits(self.forward(ids, positions))

    def _rope_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


# The default model: small enough for two CPU cores, big enough to attend over real contexts.
DEFAULT_LOGIT_STD = 4.0  # logits spread of the random LM head: greedy text that is not flat


def tiny_config(vocab_size: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        # head_dim 64 with a GQA group of 2: a shape the CUDA kernels serve, so the default
        # model runs them on a GPU; the projections have the sizes of 4 x 32 / 2 x 32 heads.
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=8192,
    )


@torch.no_grad()
def init_random_weights(
    model: LlamaForCausalLM, seed: int, muted_token_ids: list[int] | tuple[int, ...] = ()
) -> None:
    """Seeded weights that keep activations near unit scale through every layer.

    Rows of `muted_token_ids` in the LM head are zeroed: their logit stays 0 while the others
    spread with DEFAULT_LOGIT_STD, so greedy decoding never picks them (the default model uses
    this to emit printable text and not to stop on EOS by chance).
    """
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            values = torch.ones(param.shape)
        elif name.endswith(".bias"):
            values = torch.zeros(param.shape)
        elif name == "model.embed_tokens.weight":
            values = torch.randn(param.shape, generator=gen)
        elif name == "lm_head.weight":
            values = torch.randn(param.shape, generator=gen) * (DEFAULT_LOGIT_STD / hidden**0.5)
        else:  # a Linear weight [out, in]: unit-variance outputs for unit-variance inputs
            values = torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5
        param.copy_(values)
    if muted_token_ids and not model.config.tie_word_embeddings:
        model.lm_head.weight[list(muted_token_ids)] = 0.0
