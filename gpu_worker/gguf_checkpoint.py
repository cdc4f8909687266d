"""Load a GGUF checkpoint of the Llama family (Llama, Mistral, SmolLM: GGUF architecture 'llama';
Qwen2: 'qwen2') into kvledger's decoder.

The file's metadata is the config (llama.cpp's key names, read here into the fields of a
Hugging Face config.json); every tensor is dequantized at load with the `gguf` package
(`gguf.quants.dequantize`, float32) and cast to the serving dtype ('auto': float32 on the CPU,
bfloat16 on CUDA). The model then runs exactly as a safetensors checkpoint of the same weights.

One layout difference: llama.cpp's converter reorders the rows of each Q and K projection of a
'llama' model, head by head, from Hugging Face's rotary layout (the first half of a head's
dimensions rotates with the second half) to its own (even with odd dimensions). The rows are put
back here; 'qwen2' files keep Hugging Face's order.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpu_worker.layers import load_shard
from gpu_worker.loading import CheckpointError, resolve_dtype
from gpu_worker.model import LlamaForCausalLM, ModelConfig, ModelConfigError
from gpu_worker.parallel import SINGLE, TensorParallel
from services.tokenization.gguf_tokenizer import field, open_gguf

# GGUF architecture -> the Hugging Face architecture it is served as, and whether llama.cpp
# reordered its Q/K rows.
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
}

# Tensor types dequantized at load (names as gguf.GGMLQuantizationType spells them). The
# importance-matrix (IQ*) and ternary types are refused by name.
SUPPORTED_TYPES = (
    "F32", "F16", "BF16",
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor name; None when it has none."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _IN_BLOCK:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_IN_BLOCK[part]}.{kind}"


def read_gguf_config(
    reader: Any, path: str | Path, max_model_len: int | None = None
) -> tuple[ModelConfig, bool]:
    """The model config a GGUF file's metadata describes, and whether its Q/K rows are in
    llama.cpp's rotary order."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} (general.architecture) is not supported; "
            f"kvledger serves {', '.join(repr(a) for a in ARCHITECTURES)} (Llama, Mistral and "
            "SmolLM files are written as 'llama')"
        )
    hf_arch, permuted = ARCHITECTURES[arch]

    def key(name: str, default: Any = ...) -> Any:
        value = field(reader, f"{arch}.{name}")
        if value is None:
            if default is ...:
                raise CheckpointError(f"{path} lacks the metadata field {arch}.{name}")
            return default
        return value

    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise CheckpointError(
            f"{path} carries rope_freqs.weight (per-dimension RoPE frequency factors, as Llama "
            "3.1 files do), which kvledger does not apply; refusing rather than serving a "
            "model with the wrong positions"
        )
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{path} lacks the tensor token_embd.weight")
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rotary = int(key("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise CheckpointError(
            f"{path}: {arch}.rope.dimension_count is {rotary} but heads have {head_dim} "
            "dimensions; partial rotary embeddings are not supported"
        )
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise CheckpointError(f"{path}: value heads of another size than key heads")
    hf: dict[str, Any] = {
        "architectures": [hf_arch],
        "vocab_size": int(embed.shape[-1]),  # ggml order: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in names,
        "dtype": "float32",  # dequantized values: 'auto' serves float32 on CPU, bf16 on CUDA
    }
    scaling = key("rope.scaling.type", None)
    if scaling == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise CheckpointError(
            f"{path}: RoPE scaling {scaling!r} ({arch}.rope.scaling.type) is not supported "
            "(only linear)"
        )
    try:
        cfg = ModelConfig.from_hf(hf)
    except ModelConfigError as exc:
        raise CheckpointError(f"cannot serve {path}: {exc}") from None
    window = key("attention.sliding_window", None)
    if window is not None and (max_model_len is None or max_model_len > int(window)):
        raise CheckpointError(
            f"{path} uses sliding-window attention (window {window} tokens), which kvledger "
            f"does not implement; set max_model_len <= {window}"
        )
    return cfg, permuted


def load_gguf(
    path: str | Path,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    tp: TensorParallel = SINGLE,
) -> LlamaForCausalLM:
    """The model of a GGUF file, every tensor checked by name, type and shape (under tensor
    parallelism, this rank's shard of it)."""
    import gguf

    path = Path(path)
    reader = open_gguf(path)
    cfg, permuted = read_gguf_config(reader, path, max_model_len)
    with torch.device("meta"):
        net = LlamaForCausalLM(cfg, tp)
        full_shapes = {n: tuple(p.shape) for n, p in LlamaForCausalLM(cfg).named_parameters()}
    net = net.to(resolve_dtype(dtype, cfg.dtype, device)).to_empty(device=device)
    net.tie_weights()  # to_empty gives each module its own tensor
    params = dict(net.named_parameters())  # a tied lm_head.weight is deduplicated away
    loaded: set[str] = set()
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None or name not in full_shapes:
            raise CheckpointError(
                f"unexpected tensor {tensor.name!r} in {path.name}: it is not a parameter of "
                f"{cfg.architecture} as the file's metadata describes it"
            )
        qtype = tensor.tensor_type.name
        if qtype not in SUPPORTED_TYPES:
            raise CheckpointError(
                f"tensor {tensor.name!r} in {path.name} is {qtype}, a GGUF type kvledger does not "
                f"load; supported: {', '.join(SUPPORTED_TYPES)}"
            )
        if name not in params:  # lm_head.weight of a tied model: the embedding serves
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        expected = full_shapes[name]
        if tuple(values.shape) != expected:
            raise CheckpointError(
                f"shape mismatch for {tensor.name!r} ({name}) in {path.name}: the metadata "
                f"implies {list(expected)}, the file has {list(values.shape)}"
            )
        weight = torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the map is r/o
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_rotary_rows(weight, cfg.num_attention_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_rotary_rows(weight, cfg.num_key_value_heads)
        slices = net.full_slices(name)
        load_shard(params[name], weight if slices is None else weight[slices])
        loaded.add(name)
    missing = [name for name in params if name not in loaded]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(
            f"{path} lacks {len(missing)} tensor(s) the model needs: {', '.join(missing[:5])}{more}"
        )
    return net.eval()


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Hugging Face's row order of a Q or K projection (weight or bias) stored by llama.cpp.

    Within each head of d rows, llama.cpp stores row 2i as Hugging Face's row i and row 2i+1
    as Hugging Face's row d/2 + i (the two rotated halves interleaved); this undoes that."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise CheckpointError(
            f"a projection of {rows} rows does not split into {num_heads} heads of even size"
        )
    rest = weight.shape[1:]
    heads = weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
    return heads.transpose(1, 2).reshape(rows, *rest).contiguous()
