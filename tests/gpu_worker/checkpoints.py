"""Tiny random Hugging Face checkpoints built with `transformers`, for tests anywhere.

`make_tiny_checkpoint(tmp_path, arch)` writes a folder exactly as `save_pretrained` does, plus a
byte-level BPE `tokenizer.json` trained in-test and a `tokenizer_config.json` with a chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
VOCAB_SIZE = 320  # the model's; the tokenizer uses at most TOKENIZER_VOCAB ids of it
TOKENIZER_VOCAB = 300
BOS, EOS = "<s>", "</s>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Héllo wörld, ça va? 世界你好, こんにちは 🙂 emoji and ünïcödé.",
    "def main():\n    return sum(range(10))\n",
] * 20


def make_tiny_checkpoint(
    tmp_path: Path,
    arch: str = "LlamaForCausalLM",
    *,
    max_shard_size: str | None = None,
    seed: int = 0,
    special_tokens: tuple[str, ...] = (),
    chat_template: str = CHAT_TEMPLATE,
    name: str | None = None,
    **config_overrides: Any,
) -> Path:
    """Save a random tiny `arch` model (float32, safetensors) and a tokenizer under tmp_path
    (with extra `special_tokens` and its own `chat_template` when given)."""
    import transformers

    folder = Path(tmp_path) / (name or f"tiny-{arch.removesuffix('ForCausalLM').lower()}")
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    model_cls = getattr(transformers, arch)
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    if arch == "LlamaForCausalLM":  # exercise llama3 RoPE scaling with all three bands
        kwargs["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    if arch == "MistralForCausalLM":
        kwargs["sliding_window"] = None
    kwargs.update(config_overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).float().eval()
    _spread_weights(model, seed)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **save_kwargs)
    write_tokenizer(folder, special_tokens, chat_template)
    return folder


@torch.no_grad()
def _spread_weights(model: torch.nn.Module, seed: int) -> None:
    # transformers' 0.02-std init gives nearly flat logits, where argmax near-ties would make
    # token comparisons flaky; unit-scale activations and logits spread ~3 avoid that.
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * noise)
        elif name.endswith(".bias"):
            param.copy_(0.1 * noise)
        elif "embed_tokens" in name:
            param.copy_(noise)
        elif name == "lm_head.weight":
            param.copy_(noise * 3.0 / param.shape[1] ** 0.5)
        else:
            param.copy_(noise / param.shape[1] ** 0.5)


def write_tokenizer(
    folder: Path, special_tokens: tuple[str, ...] = (), chat_template: str = CHAT_TEMPLATE
) -> None:
    """A byte-level BPE tokenizer.json (BOS added by the post-processor) and its config; extra
    special tokens take the ids after BOS (0) and EOS (1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=[BOS, EOS, *special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": {"content": EOS, "__type": "AddedToken"},
        "chat_template": chat_template,
        "model_max_length": 512,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
