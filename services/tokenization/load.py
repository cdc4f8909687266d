"""Which tokenizer a model value names: the byte tokenizer of `tiny`, a GGUF file's own
(`smollm2` is one), or a Hugging Face folder's (`model_source` says which the value is)."""

from __future__ import annotations

from pathlib import Path

from services.tokenization.gguf_tokenizer import GGUFTokenizer
from services.tokenization.model_source import resolve_model
from services.tokenization.tokenizer import (
    DEFAULT_MODEL_NAME,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
)


def load_tokenizer(model: str | Path, name: str | None = None) -> Tokenizer:
    """'tiny' gives the byte tokenizer of the seeded tiny model, a .gguf file (or 'smollm2',
    the default) the file's own, anything else a checkpoint folder's (services.tokenization.model_source)."""
    source = resolve_model(model)
    if source.kind == "tiny":
        return ByteTokenizer(name or DEFAULT_MODEL_NAME)
    if source.kind == "gguf":
        return GGUFTokenizer(source.path or model, name or source.name)
    return HFTokenizer(model, name)
