"""The tokenizer and chat template of a GGUF file, from its `tokenizer.*` metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`, their
types and scores), the BPE merges, the special token ids, a pre-tokenizer name and the chat
template as metadata. This module rebuilds a Hugging Face `tokenizers.Tokenizer` from them, so
the gateway serves a `.gguf` with the same `Tokenizer` interface as a checkpoint folder.

Two vocabulary kinds (`tokenizer.ggml.model`):
  gpt2   byte-level BPE (SmolLM, Llama 3, Qwen2): tokens spelled in GPT-2's byte alphabet,
         merges in the file, text split first by the regexes llama.cpp names in
         `tokenizer.ggml.pre`;
  llama  SentencePiece BPE (Llama 2, Mistral): "▁" for spaces, byte-fallback tokens <0xNN>,
         merges in the file or ranked from the token scores.

Reads the file with the `gguf` package (numpy only): no torch, so the gateway may import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.tokenization.tokenizer import ChatOptions, ChatTemplateError, HFTokenizer

# llama.cpp's token types (gguf.TokenType): CONTROL tokens are specials, USER_DEFINED ones are
# matched whole in text but not special.
_CONTROL = 3
_USER_DEFINED = 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> the regexes llama.cpp splits text with, applied one after the other
# (each splits the pieces of the one before), as its llama-vocab.cpp does for these names.
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "gpt-2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),  # SmolLM, SmolLM2: digits one by one, then GPT-2's
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}

_SPECIAL_ID_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
# llama.cpp ends generation on any of these (its end-of-generation set), EOS first.
_END_ID_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)


class GGUFError(ValueError):
    """A GGUF file kvledger cannot serve; the text names the file and the field or tensor."""


def open_gguf(path: str | Path) -> Any:
    """A `gguf.GGUFReader` over `path` (memory-mapped), with a clear error for a bad file."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"GGUF file {path} does not exist")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise GGUFError(f"cannot read {path} as a GGUF file: {exc}") from None


def field(reader: Any, key: str, default: Any = None) -> Any:
    """The value of metadata `key` (a scalar, a str, or a list for arrays), else `default`."""
    entry = reader.fields.get(key)
    if entry is None:
        return default
    value = entry.contents()
    # numpy scalars -> Python ones, so the values compare and serialise plainly
    return value.item() if hasattr(value, "item") else value


class GGUFTokenizer(HFTokenizer):
    """The tokenizer a GGUF file describes, with its specials, EOS ids and chat template.

    Encoding, decoding and chat rendering are HFTokenizer's; only where the parts come from
    differs (the file's metadata, not tokenizer.json and its config files)."""

    def __init__(self, path: str | Path, name: str | None = None, reader: Any = None) -> None:
        path = Path(path)
        reader = reader if reader is not None else open_gguf(path)
        self.name = name or path.stem
        self.path = path
        kind = field(reader, "tokenizer.ggml.model")
        tokens = field(reader, "tokenizer.ggml.tokens")
        if kind is None or not tokens:
            raise GGUFError(
                f"{path} has no tokenizer (tokenizer.ggml.model and tokenizer.ggml.tokens): "
                "kvledger serves GGUF files that carry their vocabulary"
            )
        types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "gpt2":
            self._tok = _byte_level_bpe(reader, path, tokens)
            default_add_bos = False
        elif kind == "llama":
            self._tok = _sentencepiece_bpe(reader, path, tokens)
            default_add_bos = True  # llama.cpp's default for a SentencePiece vocabulary
        else:
            raise GGUFError(
                f"{path}: tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; "
                "kvledger builds 'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE) "
                "vocabularies"
            )
        _add_marked_tokens(self._tok, tokens, types)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_tokens = {}
        for key, id_key in _SPECIAL_ID_KEYS.items():
            token_id = field(reader, id_key)
            if token_id is not None and 0 <= token_id < len(tokens):
                self.special_tokens[key] = tokens[token_id]
        self.bos_token_id = field(reader, "tokenizer.ggml.bos_token_id")
        self.eos_token_ids = list(
            dict.fromkeys(i for key in _END_ID_KEYS if (i := field(reader, key)) is not None)
        )
        self.add_bos_token = bool(field(reader, "tokenizer.ggml.add_bos_token", default_add_bos))
        template = field(reader, "tokenizer.chat_template")
        self.chat_template = template if isinstance(template, str) else None

    def tokenizer_json(self) -> str:
        """The rebuilt tokenizer as tokenizer.json text (what llguidance reads)."""
        return str(self._tok.to_str())

    def render_chat(
        self, messages: list[dict[str, Any]], options: ChatOptions | None = None
    ) -> str:
        if self.chat_template is None:
            raise ChatTemplateError(
                f"model {self.name!r} has no chat template (GGUF metadata "
                "tokenizer.chat_template); use /v1/completions"
            )
        return super().render_chat(messages, options)


def _byte_level_bpe(reader: Any, path: Path, tokens: Sequence[str]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = field(reader, "tokenizer.ggml.pre", "gpt-2")
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        raise GGUFError(
            f"{path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not one kvledger knows; "
            f"known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}"
        )
    merges = field(reader, "tokenizer.ggml.merges")
    if not merges:
        raise GGUFError(f"{path}: a byte-level BPE vocabulary needs tokenizer.ggml.merges")
    bpe = models.BPE(vocab=_vocab(tokens), merges=_pairs(merges, path), fuse_unk=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(reader: Any, path: Path, tokens: Sequence[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = _vocab(tokens)
    merges = field(reader, "tokenizer.ggml.merges")
    if merges:
        pairs = _pairs(merges, path)
    else:
        scores = field(reader, "tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise GGUFError(
                f"{path}: a SentencePiece vocabulary needs tokenizer.ggml.merges or one "
                "tokenizer.ggml.scores entry per token"
            )
        pairs = merges_from_scores(tokens, scores)
    unk_id = field(reader, "tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    bpe = models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(bpe)
    prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's choice: at each step the adjacent pair whose
    joined token scores highest merges first. Every split of a token into two vocabulary tokens
    is a merge ranked by the joined token's score; among equal scores the longer left part, then
    the longer right part, then the lower ids go first."""
    ids = _vocab(tokens)
    ranked: list[tuple[float, int, int, int, int, str, str]] = []
    for token, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-score, -len(left), -len(right), ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _vocab(tokens: Sequence[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # a repeated spelling keeps its first id
    return vocab


def _pairs(merges: Sequence[str], path: Path) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise GGUFError(f"{path}: merge {merge!r} in tokenizer.ggml.merges is not 'a b'")
        pairs.append((parts[0], parts[1]))
    return pairs


def _add_marked_tokens(tok: Any, tokens: Sequence[str], types: Sequence[int]) -> None:
    """Control tokens become special added tokens and user-defined ones plain added tokens,
    so text containing them maps to their ids whole (as llama.cpp matches them)."""
    from tokenizers import AddedToken

    vocab = tok.get_vocab(with_added_tokens=False)
    control = [t for t, kind in zip(tokens, types, strict=False) if kind == _CONTROL and t in vocab]
    user = [
        t for t, kind in zip(tokens, types, strict=False) if kind == _USER_DEFINED and t in vocab
    ]
    if control:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
