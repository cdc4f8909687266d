"""The tokenizer rebuilt from a GGUF's metadata encodes, decodes and renders chats as
transformers' tokenizer for the same file (`AutoTokenizer.from_pretrained(..., gguf_file=)`).

SmolLM2's byte-level BPE (the shipped file), a byte-level vocabulary written in-test, and a
SentencePiece vocabulary without merges (ranked from scores, byte fallback) written in-test.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import transformers
from tokenizers import Tokenizer as RawTokenizer

from gpu_worker.structured import ll_tokenizer
from services.tokenization.gguf_tokenizer import GGUFError, GGUFTokenizer, merges_from_scores
from services.tokenization.load import load_tokenizer
from services.tokenization.model_source import default_model_path
from services.tokenization.tokenizer import ChatTemplateError
from tests.gpu_worker.gguf_files import write_tiny_gguf

TEXTS = [
    "Hello world 2024, it's 3.14159!",
    "  leading spaces\n\nand newlines\tand tabs   ",
    "héllo wörld — “quotes” 日本語 🙂",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "def f(a, b):\n    return a+b  # I'm, we'll, THEY'RE",
    "the theory of the bath and the ant",
    "",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


def hf_tokenizer(path: Path):
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def assert_same_as_transformers(ours: GGUFTokenizer, hf, texts: list[str]) -> None:
    for text in texts:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert (
            ours.encode(text, add_special_tokens=False)
            == hf(text, add_special_tokens=False)["input_ids"]
        )
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)
        assert ours.token_pieces(ids) == hf.convert_ids_to_tokens(ids)


@pytest.fixture(scope="module")
def smollm2() -> tuple[GGUFTokenizer, object]:
    path = default_model_path()
    ours = load_tokenizer("smollm2")
    assert isinstance(ours, GGUFTokenizer)
    return ours, hf_tokenizer(path)


def test_smollm2_encodes_and_decodes_as_transformers(smollm2):
    ours, hf = smollm2
    assert_same_as_transformers(ours, hf, TEXTS)
    assert ours.vocab_size == 49152 and ours.name == "SmolLM2-135M-Instruct.Q4_1"
    assert ours.bos_token_id == 1 and ours.eos_token_ids == [2] and not ours.add_bos_token
    assert ours.special_tokens["eos_token"] == "<|im_end|>"
    assert ours.encode("2024", add_special_tokens=False) == [34, 32, 34, 36]  # digit by digit


def test_smollm2_chat_template_comes_from_the_file(smollm2):
    ours, hf = smollm2
    for messages in (MESSAGES[1:2], MESSAGES):
        expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours.render_chat(messages) == expected
        ids = hf.apply_chat_template(messages, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert ours.apply_chat_template(messages) == list(ids)
    assert ours.render_chat(MESSAGES[1:2]).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
    )


def test_a_written_byte_level_vocabulary_matches_transformers(tmp_path):
    path = tmp_path / "bpe.gguf"
    write_tiny_gguf(path, "llama", "Q8_0")
    ours = GGUFTokenizer(path)
    hf = hf_tokenizer(path)
    assert_same_as_transformers(ours, hf, TEXTS)
    assert ours.encode("the")[0] == 0  # add_bos_token is set in this file
    # "t h" then "th e" merge first (in the file's order), so "Ġ th" never applies here.
    assert ours.token_pieces(ours.encode(" the", add_special_tokens=False)) == ["Ġ", "the"]
    assert ours.token_pieces(ours.encode(" a", add_special_tokens=False)) == ["Ġa"]
    # The JSON handed to llguidance is the same tokenizer, and llguidance accepts it.
    again = RawTokenizer.from_str(ours.tokenizer_json())
    assert again.encode(TEXTS[0], add_special_tokens=False).ids == ours.encode(TEXTS[0], False)
    assert ll_tokenizer(str(path), ours.vocab_size).vocab_size == ours.vocab_size


def write_sentencepiece_gguf(path: Path, pieces: list[str], **metadata: object) -> list[str]:
    """A tokenizer-only GGUF with a SentencePiece vocabulary: <unk>, <s>, </s>, the 256 byte
    tokens, then `pieces` scored best-first; no merges (the loader ranks them from scores)."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(metadata.get("model", "llama"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokens


SPM_PIECES = [
    "▁", "t", "h", "e", "a", "n", "d", "o", "r", "y", "b", "i", "s", "l", "w",
    "th", "▁t", "he", "▁th", "▁the", "an", "▁a", "nd", "and", "▁and", "or", "▁or",
    "ry", "eo", "▁b", "at", "ath", "▁bath", "is", "▁is", "ll", "lo", "▁w", "wor", "ld",
]  # fmt: skip


def test_a_sentencepiece_vocabulary_without_merges_matches_transformers(tmp_path):
    path = tmp_path / "spm.gguf"
    write_sentencepiece_gguf(path, SPM_PIECES)
    ours = GGUFTokenizer(path)
    hf = hf_tokenizer(path)
    texts = [
        "the theory and the bath",
        "the bath is world",
        " two  spaces and a tab\t",
        "théâtre 🙂",  # not in the vocabulary: byte fallback
        "",
    ]
    assert_same_as_transformers(ours, hf, texts)
    assert ours.add_bos_token and ours.encode("the")[0] == 1
    assert ours.decode(ours.encode("théâtre 🙂")) == "théâtre 🙂"


def test_merges_from_scores_rank_by_the_joined_token():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -3.0, -1.0, -2.0]
    # bc (score -1) before abc (-2: ab+c, then a+bc) before ab (-3)
    assert merges_from_scores(tokens, scores) == [("b", "c"), ("ab", "c"), ("a", "bc"), ("a", "b")]


def test_refusals_name_what_is_wrong(tmp_path):
    unknown_pre = tmp_path / "pre.gguf"
    writer = gguf.GGUFWriter(str(unknown_pre), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("some-new-model")
    writer.add_token_list(["a", "b"])
    writer.add_token_merges(["a b"])
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file):
        step()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="pre-tokenizer 'some-new-model'"):
        GGUFTokenizer(unknown_pre)
    other = tmp_path / "bert.gguf"
    write_sentencepiece_gguf(other, ["▁"], model="bert")
    with pytest.raises(GGUFError, match="tokenizer model 'bert'"):
        GGUFTokenizer(other)
    spm = tmp_path / "spm.gguf"
    write_sentencepiece_gguf(spm, SPM_PIECES)
    with pytest.raises(ChatTemplateError, match=r"no chat template .*tokenizer\.chat_template"):
        GGUFTokenizer(spm).apply_chat_template(MESSAGES)


def test_the_gateway_reads_a_gguf_tokenizer_without_torch(tmp_path):
    """The gateway ships without torch: loading a GGUF's tokenizer must not import it."""
    import subprocess
    import sys

    path = tmp_path / "spm.gguf"
    write_sentencepiece_gguf(path, SPM_PIECES)
    code = (
        "import sys, gateway.app; from services.tokenization.load import load_tokenizer;"
        f"tok = load_tokenizer({str(path)!r}); print(tok.encode('the bath'));"
        "print('torch' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.split("\n")[:2] == [str(GGUFTokenizer(path).encode("the bath")), "False"], (
        done.stderr
    )
