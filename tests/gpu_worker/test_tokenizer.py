"""Tokenizers: the byte tokenizer, the tokenizer.json wrapper against transformers' own, chat
templates, EOS ids from the checkpoint's configs, and streaming detokenization."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from services.tokenization.load import load_tokenizer
from services.tokenization.tokenizer import (
    ByteTokenizer,
    ChatTemplateError,
    HFTokenizer,
    IncrementalDetokenizer,
)
from tests.gpu_worker.checkpoints import write_tokenizer

TEXTS = ["The quick brown fox", "Héllo wörld, 世界 🙂!", "", " leading space", "a\nb\tc"]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Héllo 🙂 <b>"},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 9, "bos_token_id": 0}))
    return folder


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    pieces = [detok.push([i]) for i in ids]
    return [*pieces, detok.flush()]


def test_byte_tokenizer_round_trips_utf8_with_bos():
    tok = load_tokenizer("tiny")
    assert isinstance(tok, ByteTokenizer) and tok.name == "kvledger-tiny-llama"
    ids = tok.encode("é!")
    assert ids == [256, 0xC3, 0xA9, 0x21]
    assert tok.decode(ids) == "é!"
    assert tok.decode([*ids, 257], skip_special_tokens=False) == "<s>é!</s>"
    assert tok.vocab_size == 258 and tok.eos_token_ids == [257] and tok.bos_token_id == 256


def test_byte_tokenizer_chat_template():
    ids = ByteTokenizer().apply_chat_template(MESSAGES)
    assert ids[0] == 256
    text = bytes(ids[1:]).decode()
    assert text == "<|system|>\nBe brief.\n<|user|>\nHéllo 🙂 <b>\n<|assistant|>\n"


def test_streaming_never_splits_a_multibyte_character():
    tok = ByteTokenizer()
    ids = tok.encode("a€🙂b")[1:]  # 1 + 3 + 4 + 1 bytes, pushed one byte at a time
    assert stream(IncrementalDetokenizer(tok), ids) == ["a", "", "", "€", "", "", "", "🙂", "b", ""]


def test_hf_tokenizer_encodes_like_transformers(folder):
    ours, theirs = HFTokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids and ids[0] == 0  # BOS from the post-processor
        assert ours.decode(ids) == text
    assert ours.vocab_size == 300 and ours.name == folder.name


def test_hf_chat_template_matches_transformers(folder):
    ours, theirs = HFTokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    expected = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = ours.apply_chat_template(MESSAGES)
    assert ids == expected["input_ids"]
    assert ours.decode(ids, skip_special_tokens=False) == (
        "<s><|system|>Be brief.</s>\n<|user|>Héllo 🙂 <b></s>\n<|assistant|>"
    )


def test_chat_template_raise_exception_is_a_clear_error(folder):
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        HFTokenizer(folder).apply_chat_template([{"role": "tool", "content": "x"}])


def test_eos_ids_come_from_all_configs_tokenizer_first(folder):
    tok = HFTokenizer(folder)
    assert tok.eos_token_ids == [1, 7, 9] and tok.bos_token_id == 0


def test_hf_streaming_equals_full_decode_without_replacement_chars(folder):
    tok = HFTokenizer(folder)
    ids = tok.encode("Héllo wörld, ça va? 世界你好, こんにちは 🙂 and ünïcödé.")
    full, prompt = tok.decode(ids), tok.decode(ids[:3])
    pieces = stream(IncrementalDetokenizer(tok, ids[:3]), ids[3:])
    assert full.startswith(prompt) and "".join(pieces) == full[len(prompt) :]
    assert not any("\ufffd" in p for p in pieces)
    assert any(p == "" for p in pieces[:-1])  # some byte-level tokens end mid-character


def test_missing_tokenizer_json_is_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json not found"):
        HFTokenizer(tmp_path)
