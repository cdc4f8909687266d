"""Structured outputs on the worker: the grammar's bitmask masks the logits before sampling, the
matcher follows the request's outputs (through preemption), and rows without a grammar in the
same batch are untouched."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest
import torch

from gpu_worker.checkpoint import load_checkpoint
from gpu_worker.runner import ModelRunner
from gpu_worker.structured import GrammarRow, StructuredOutputs, unpack_bitmask, without_forcing
from services.tokenization.tokenizer import ByteTokenizer, HFTokenizer
from services.wire.messages import SamplingParams, StructuredOutput
from tests.gpu_worker.checkpoints import TOKENIZER_VOCAB, make_tiny_checkpoint
from tests.gpu_worker.driver import MiniLedger, generate

TOK = ByteTokenizer()
PROMPT = TOK.encode("Write it: ")
PLATE = r"[a-z]{3}-[0-9]{2}"
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green"]},
    },
    "required": ["id", "ok", "tag"],
    "additionalProperties": False,
}


def spec(kind: str, grammar: str) -> StructuredOutput:
    return StructuredOutput(kind=kind, grammar=grammar)


REGEX = spec("regex", llguidance.LLMatcher.grammar_from_regex(PLATE))
JSON = spec(
    "json",
    llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False}),
)


def text_until_eos(ids: list[int]) -> str:
    end = ids.index(ByteTokenizer.EOS_ID) if ByteTokenizer.EOS_ID in ids else len(ids)
    return TOK.decode(ids[:end])


def params(structured: StructuredOutput, seed: int | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=0.0 if seed is None else 1.0,
        seed=seed,
        max_tokens=64,
        eos_token_id=ByteTokenizer.EOS_ID,
        structured=structured,
    )


def test_unpacked_bitmask_allows_exactly_the_matchers_tokens():
    structured = StructuredOutputs("tiny", TOK.vocab_size)
    state = structured.new_state(REGEX)
    assert state is not None
    for prefix in ([], [*b"ab"], [*b"abc-1"]):
        state.sync([*PROMPT, *prefix], len(PROMPT))
        raw = state.matcher.compute_bitmask()
        want = [t for t in range(TOK.vocab_size) if raw[t // 8] >> (t % 8) & 1]
        logits = torch.zeros(2, TOK.vocab_size)
        structured.apply(logits, [_row(state, prefix), _row(None, [])])
        assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == want
        assert torch.isfinite(logits[1]).all()  # the row without a grammar is untouched
        state.matcher.reset()
        state.consumed = 0
    assert want == [*b"0123456789"]


def test_a_padded_vocabulary_masks_the_ids_past_the_tokenizer():
    words = torch.tensor([[-1, -1]], dtype=torch.int32)  # 64 ids allowed
    allowed = unpack_bitmask(words, 70)
    assert allowed[0, :64].all() and not allowed[0, 64:].any()


@pytest.mark.parametrize("seed", [None, 3, 11])
def test_regex_and_json_outputs_match_greedy_and_seeded(make_runner, seed):
    runner = make_runner()
    for plate in generate(runner, [PROMPT, PROMPT], 12, sampling=params(REGEX, seed)):
        assert re.fullmatch(PLATE, text_until_eos(plate)), text_until_eos(plate)
    record = generate(make_runner(), [PROMPT], 60, sampling=params(JSON, seed))[0]
    jsonschema.validate(json.loads(text_until_eos(record)), SCHEMA)


@pytest.mark.parametrize("seed", [None, 5])
def test_preemption_replays_the_matcher_over_the_output_so_far(make_runner, seed):
    sampling = params(JSON, seed)
    straight = generate(make_runner(), [PROMPT], 40, sampling=sampling)
    preempted = generate(
        make_runner(), [PROMPT], 40, sampling=sampling, preempt_after={0: 4}, max_chunk=8
    )
    assert preempted == straight
    jsonschema.validate(json.loads(text_until_eos(straight[0])), SCHEMA)


def test_unconstrained_rows_of_the_batch_sample_as_alone(make_runner):
    free = SamplingParams(temperature=0.0, max_tokens=16)
    alone = generate(make_runner(), [PROMPT], 16, sampling=free)[0]
    runner = make_runner()
    ledger = MiniLedger(runner)
    ledger.add("json", PROMPT, params(JSON))
    ledger.add("free", PROMPT, free)
    while len(ledger.seqs["free"].outputs) < 16:
        ledger.step()
    assert ledger.seqs["free"].outputs[:16] == alone
    assert text_until_eos(ledger.seqs["json"].outputs).startswith('{"id":')


def _row(state, output: list[int]) -> GrammarRow:
    return GrammarRow(state, [*PROMPT, *output], len(PROMPT))


def test_a_checkpoints_tokenizer_constrains_its_model(tmp_path):
    # llguidance reads the folder's tokenizer.json; the model's 20 ids past the tokenizer's
    # vocabulary are never allowed.
    folder = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    tok = HFTokenizer(folder)
    runner = ModelRunner(
        load_checkpoint(folder, dtype="float32"), 64, 4, tokenizer_model=str(folder)
    )
    regex = r"(fox|dog) [0-9]{2}"
    structured = spec("regex", llguidance.LLMatcher.grammar_from_regex(regex))
    eos = tok.eos_token_ids[0]
    for seed in (None, 2):
        sampling = SamplingParams(
            temperature=0.0 if seed is None else 1.0, seed=seed, eos_token_id=eos,
            structured=structured,
        )  # fmt: skip
        (out,) = generate(runner, [tok.encode("The")], 12, sampling=sampling)
        assert eos in out and max(out) < TOKENIZER_VOCAB
        assert re.fullmatch(regex, tok.decode(out[: out.index(eos)])), tok.decode(out)


@pytest.mark.parametrize("seed", [None, 7])
def test_min_tokens_past_a_finished_grammar_does_not_fail_the_step(make_runner, seed):
    # After "yes" the grammar allows only EOS, which min_tokens bans: nothing is left to
    # sample. The step goes on (EOS, as the masked logits allow), the other row unharmed.
    choice = spec("choice", llguidance.LLMatcher.grammar_from_lark('start: "yes" | "no"'))
    sampling = SamplingParams(
        temperature=0.0 if seed is None else 1.0, seed=seed, min_tokens=8,
        eos_token_id=ByteTokenizer.EOS_ID, structured=choice,
    )  # fmt: skip
    outs = generate(make_runner(), [PROMPT, PROMPT], 10, sampling=sampling)
    for out in outs:
        assert text_until_eos(out) in ("yes", "no")
        assert set(out[len(text_until_eos(out)) :]) == {ByteTokenizer.EOS_ID}


NEVER_ENDING = [
    ('start: "a" start', "a"),  # forces "aaaa..." for ever: llguidance's forcing hits its limit
    ('start: "ab" start', "ab"),
    ('start: "x" /[0-9]/ start', None),  # forced and free bytes in turn
]


@pytest.mark.parametrize(("grammar", "unit"), NEVER_ENDING)
@pytest.mark.parametrize("seed", [None, 9])
def test_a_grammar_that_never_ends_runs_to_max_tokens_with_text_it_accepts(
    make_runner, grammar, unit, seed
):
    # No string ends such a grammar: the request must run to its max_tokens (the ledger says
    # `length`) with every token one the grammar allows, never an EOS (`stop`) after text the
    # grammar refuses, which is what a matcher that failed on its own forced bytes produced.
    structured = spec("grammar", llguidance.grammar_from("grammar", grammar))
    sampling = SamplingParams(
        temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=40,
        eos_token_id=ByteTokenizer.EOS_ID, structured=structured,
    )  # fmt: skip
    for out in generate(make_runner(), [PROMPT, PROMPT], 40, sampling=sampling):
        assert ByteTokenizer.EOS_ID not in out, TOK.decode(out)
        assert len(out) == 40
        text = TOK.decode(out)
        if unit is not None:
            assert text == (unit * 40)[:40], text
        assert _grammar_accepts_prefix(grammar, out), text


def test_a_grammar_state_survives_the_forcing_limit_through_preemption(make_runner):
    sampling = SamplingParams(
        temperature=0.0, max_tokens=40, eos_token_id=ByteTokenizer.EOS_ID,
        structured=spec("grammar", 'start: "ab" start'),
    )  # fmt: skip
    straight = generate(make_runner(), [PROMPT], 40, sampling=sampling)
    preempted = generate(
        make_runner(), [PROMPT], 40, sampling=sampling, preempt_after={0: 6}, max_chunk=8
    )
    assert preempted == straight == [[*b"ab" * 20]]


def _grammar_accepts_prefix(grammar: str, tokens: list[int]) -> bool:
    """The tokens, one by one, never leave the grammar (forcing off: it is the check that
    would otherwise hit llguidance's limit)."""
    structured = StructuredOutputs("tiny", TOK.vocab_size)
    text = '%llguidance {"no_forcing": true}\n' + grammar
    matcher = llguidance.LLMatcher(structured.tokenizer, text, log_level=0)
    return matcher.consume_tokens(tokens) and not matcher.is_error()


@pytest.mark.parametrize(
    ("structured", "good", "bad"),
    [
        (REGEX, "abc-12", "abc-1x"),
        (JSON, '{"id":7,"ok":true,"tag":"red"}', '{"id":7,"ok":1'),
        (spec("grammar", 'start: "yes" | "no"'), "yes", "yex"),
    ],
)
def test_a_grammar_without_forcing_keeps_its_language(structured, good, bad):
    tokenizer = StructuredOutputs("tiny", TOK.vocab_size).tokenizer
    text = without_forcing(structured.grammar)
    for grammar in (structured.grammar, text):
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        assert matcher.consume_tokens([*good.encode()]) and matcher.is_accepting(), grammar
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        assert not matcher.consume_tokens([*bad.encode()]), grammar
