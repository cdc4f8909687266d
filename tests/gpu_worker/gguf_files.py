"""Tiny GGUF files written in-test with the `gguf` package's writer, and the weights they hold.

`write_tiny_gguf(path, arch, qtype)` takes a random transformers model (Llama or Qwen2), stores
every matrix as `qtype` (quantized with `gguf.quants.quantize` where the package has a
quantizer; K-quant types, which it can only dequantize, get random blocks with small scales)
and the norms and biases as F32, with a byte-level BPE vocabulary. It returns the Hugging Face
state dict the file holds once dequantized: what a correct loader must produce.

Q and K rows are written in llama.cpp's order for 'llama' files: within each head of d rows,
GGUF row 2i is Hugging Face row i and GGUF row 2i+1 is Hugging Face row d/2 + i.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN = 256, 4, 2, 2, 512  # rows of 256: K-quant super-blocks
HEAD_DIM = HIDDEN // HEADS

# Byte offsets of the float16 super-block scales in each K-quant block (gguf/quants.py layouts).
K_QUANT_SCALES = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}

BOS, EOS = "<s>", "</s>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>"
    "{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MERGES = ["t h", "th e", "Ġ th", "Ġ a", "i n", "Ġth e", "e r", "o n", "Ġ b", "l o", "c k"]


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 byte values, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    spelled, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[int]]:
    """Tokens and their llama.cpp types: BOS and EOS (control), bytes, merge results."""
    tokens = [BOS, EOS, *byte_alphabet()]
    tokens += [m.replace(" ", "") for m in MERGES]
    return tokens, [3, 3] + [1] * (len(tokens) - 2)


def llama_cpp_rows(rows: int, heads: int) -> np.ndarray:
    """GGUF row r holds Hugging Face row order[r] (llama.cpp's Q/K permutation)."""
    d = rows // heads
    order = np.empty(rows, dtype=np.int64)
    for h in range(heads):
        for i in range(d // 2):
            order[h * d + 2 * i] = h * d + i
            order[h * d + 2 * i + 1] = h * d + d // 2 + i
    return order


def hf_model(arch: str, vocab_size: int, seed: int, tie: bool) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    config_cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    model_cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape))
            else:  # unit-scale activations: out = W x with W ~ N(0, 1/in)
                param.copy_(torch.randn(param.shape) / param.shape[-1] ** 0.5)
    return model


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, *rest = hf.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def encode(values: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """`values` [rows, cols] float32 stored as `qtype`: quantized, or random K-quant blocks."""
    kind = gguf.GGMLQuantizationType[qtype]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = values.shape
    blocks = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    if qtype not in K_QUANT_SCALES:
        try:
            return gguf.quants.quantize(values, kind)
        except NotImplementedError:  # a type without a quantizer: random blocks as they come
            return blocks.reshape(rows, -1)
    # Scales that give weights of about 1/sqrt(cols), like the float weights they replace.
    peak = float(np.abs(gguf.quants.dequantize(_unit_scaled(blocks, qtype), kind)).max())
    target = 3.0 / cols**0.5
    for offset in K_QUANT_SCALES[qtype]:
        scale = rng.uniform(0.5, 1.0, size=blocks.shape[:2]) * target / peak
        blocks[..., offset : offset + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def _unit_scaled(blocks: np.ndarray, qtype: str) -> np.ndarray:
    unit = blocks.copy()
    for offset in K_QUANT_SCALES[qtype]:
        unit[..., offset : offset + 2] = np.array([1.0], np.float16).view(np.uint8)
    return unit.reshape(blocks.shape[0], -1)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    qtype: str = "Q8_0",
    *,
    seed: int = 0,
    tie: bool = False,
    extra_tensors: dict[str, np.ndarray] | None = None,
    drop: frozenset[str] | set[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """Write the file; return the float32 Hugging Face state dict it holds (see module doc).
    `extra_tensors` are written as they are, tensors named in `drop` (GGUF names) are not."""
    tokens, types = vocabulary()
    model = hf_model(arch, len(tokens), seed, tie)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_context_length(1024)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)
    expected: dict[str, torch.Tensor] = {}
    for name, param in model.state_dict().items():
        if tie and name == "lm_head.weight":
            continue
        values = param.detach().numpy().astype(np.float32)
        if gguf_name(name) in drop:
            continue
        heads = {"q_proj": HEADS, "k_proj": KV_HEADS}.get(name.split(".")[-2])
        order = llama_cpp_rows(values.shape[0], heads) if arch == "llama" and heads else None
        stored = values if order is None else values[order]  # GGUF order
        if values.ndim == 1:
            writer.add_tensor(gguf_name(name), stored)
            held = stored
        else:
            data = encode(stored, qtype, rng)
            writer.add_tensor(gguf_name(name), data, raw_dtype=gguf.GGMLQuantizationType[qtype])
            with np.errstate(invalid="ignore", over="ignore"):  # random blocks of refused types
                held = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])
        if order is not None:
            back = np.empty_like(held)
            back[order] = held  # Hugging Face row order[r] is GGUF row r
            held = back
        expected[name] = torch.from_numpy(np.array(held, dtype=np.float32))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
