"""Structured outputs on the worker: one llguidance matcher per request, and the step's token
bitmask applied to the logits before sampling.

The gateway compiled and validated each request's grammar (`gateway.structured`); here a
request's matcher is built from that text when the request arrives. A matcher is brought up to
date lazily, from the request's own output tokens, just before its next mask: so a token the
worker sampled, a token the ledger sent, and a whole output replayed after a preemption (the
request comes back as new, with a fresh matcher) all take the same path. The masks of a step are
computed together (llguidance's executor, in parallel threads, into one int32 bitmask) and
applied with one masked_fill over the rows that have a grammar.

Forcing: where the grammar allows one byte only, llguidance computes the whole forced run ahead
and masks to its canonical token. A grammar that forces bytes for ever (`start: "a" start`)
makes that run endless: llguidance stops at its item limit and puts the matcher in an error
state, although the token it had allowed was fine. Such a matcher is rebuilt with forcing off
(`%llguidance {"no_forcing": true}`: the same language, the model picks the tokenization) and
replayed over the output so far, so the request goes on under its grammar to max_tokens
(`length`) instead of ending on an EOS (`stop`) after text the grammar does not accept.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import llguidance
import torch

from services.tokenization.gguf_tokenizer import GGUFTokenizer
from services.tokenization.load import load_tokenizer
from services.tokenization.tokenizer import ByteTokenizer
from services.wire.messages import StructuredOutput


class GrammarError(ValueError):
    """A structured-output grammar this worker cannot build a matcher for."""


NO_FORCING = '%llguidance {"no_forcing": true}\n'


def without_forcing(grammar: str) -> str:
    """The same grammar with llguidance's forcing off: a Lark text gets the option line; the
    JSON form (regex, JSON schema) has each of its grammars written as Lark with it."""
    if not grammar.lstrip().startswith("{"):
        return NO_FORCING + grammar
    top = json.loads(grammar)
    for item in top.get("grammars", []):
        if item.get("lark_grammar") is not None:
            item["lark_grammar"] = NO_FORCING + item["lark_grammar"]
        elif item.get("json_schema") is not None:
            item["lark_grammar"] = NO_FORCING + "start: %json " + json.dumps(item["json_schema"])
            item["json_schema"] = None
    return json.dumps(top)


@dataclass(slots=True)
class GrammarState:
    """One request's matcher and how many of its output tokens the matcher has consumed."""

    matcher: llguidance.LLMatcher
    consumed: int = 0
    # To rebuild the matcher without forcing (None: it already is, or cannot be rebuilt).
    tokenizer: llguidance.LLTokenizer | None = None
    grammar: str | None = None

    def sync(self, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Consume the output tokens the matcher has not seen yet."""
        start = num_prompt_tokens + self.consumed
        if start < len(token_ids):
            new = list(token_ids[start:])
            # A token the grammar refuses (it cannot be sampled under the mask, but a ledger
            # could send one) leaves the matcher in its error state: see mask_row.
            self.matcher.consume_tokens(new)
            self.consumed += len(new)
            if self.matcher.is_error():
                self.unforce(token_ids[num_prompt_tokens:])

    def unforce(self, output: Sequence[int]) -> bool:
        """A matcher in its error state, rebuilt with forcing off and replayed over `output`
        (the tokens it consumed): True when that one is sound, so the error was forcing's
        limit, not a token the grammar refuses. Done at most once per request."""
        if self.tokenizer is None or self.grammar is None:
            return False
        matcher = llguidance.LLMatcher(self.tokenizer, without_forcing(self.grammar), log_level=0)
        self.tokenizer = self.grammar = None
        if matcher.is_error() or not matcher.consume_tokens(list(output)):
            return False
        self.matcher, self.consumed = matcher, len(output)
        return True


@dataclass(slots=True)
class GrammarRow:
    """What apply() needs about one row of the step's logits."""

    grammar: GrammarState | None
    token_ids: Sequence[int]  # prompt plus output so far
    num_prompt_tokens: int


class StructuredOutputs:
    """The worker's llguidance tokenizer (built on first use: about a second for a checkpoint's
    vocabulary) and its mask computation."""

    def __init__(self, model: str | Path, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = ll_tokenizer(self.model, self.vocab_size)
        return self._tokenizer

    def new_state(self, spec: StructuredOutput | None) -> GrammarState | None:
        if spec is None:
            return None
        matcher = llguidance.LLMatcher(self.tokenizer, spec.grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"structured output ({spec.kind}): {matcher.get_error()}")
        return GrammarState(matcher, tokenizer=self.tokenizer, grammar=spec.grammar)

    def apply(self, logits: torch.Tensor, rows: Sequence[GrammarRow]) -> None:
        """Mask, in place, every token the row's grammar does not allow next."""
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if not constrained:
            return
        # llguidance.torch has these two helpers, but importing it costs seconds (torch._dynamo).
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(constrained), words), -1, dtype=torch.int32)
        matchers: list[tuple[llguidance.LLMatcher, int]] = []
        for j, i in enumerate(constrained):
            row = rows[i]
            state = row.grammar
            assert state is not None
            state.sync(row.token_ids, row.num_prompt_tokens)
            if state.matcher.is_error():
                # Nothing it could emit is valid any more: allow only EOS so that it ends.
                bitmask[j] = 0
                _set_bits(bitmask[j], self.tokenizer.eos_tokens)
            else:
                matchers.append((state.matcher, j))
        if matchers:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(
                matchers, bitmask.data_ptr(), words * 4, len(constrained)
            )
            # A mask can hit forcing's limit too (the row then allows EOS only): rebuilt
            # without forcing, that row is computed again.
            again = []
            for matcher, j in matchers:
                if matcher.is_error():
                    i = constrained[j]
                    state = rows[i].grammar
                    assert state is not None
                    output = rows[i].token_ids[rows[i].num_prompt_tokens :]
                    if state.unforce(output):
                        bitmask[j] = -1
                        again.append((state.matcher, j))
            if again:
                self._executor.unsafe_compute_mask_ptr(
                    again, bitmask.data_ptr(), words * 4, len(constrained)
                )
        allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])
        index = torch.tensor(constrained, dtype=torch.long, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 (bit b of word w allows token 32 * w + b) -> [rows, vocab] bool;
    tokens past the bitmask's width (a model vocabulary padded beyond the tokenizer's) are not
    allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    pad = torch.zeros(bits.shape[0], vocab - bits.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)


def _set_bits(words: torch.Tensor, token_ids: Sequence[int]) -> None:
    for t in token_ids:
        word, bit = divmod(t, 32)
        if word < words.shape[0]:
            value = int(words[word]) | (1 << bit)
            words[word] = value - (1 << 32) if value >= 1 << 31 else value


def ll_tokenizer(model: str | Path, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of the served tokenizer: the byte tokenizer's 256 bytes and its two
    specials, or a checkpoint's tokenizer.json (with the EOS ids the gateway stops on)."""
    tokenizer = load_tokenizer(model)
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer)), n_vocab=vocab_size
        )
    if isinstance(tokenizer, GGUFTokenizer):
        text = tokenizer.tokenizer_json()  # rebuilt from the file's metadata
    else:
        text = (Path(model) / "tokenizer.json").read_text()
    eos = tokenizer.eos_token_ids or None
    return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)


class _ByteVocabulary:
    """The attributes llguidance.TokenizerWrapper reads, for the byte tokenizer."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.eos_token_id = tokenizer.EOS_ID
        self.bos_token_id = tokenizer.BOS_ID
        self.tokens = [bytes([i]) for i in range(256)] + [b"<s>", b"</s>"]
        self.special_token_ids = [tokenizer.BOS_ID, tokenizer.EOS_ID]
        self._encode: Callable[[str], list[int]] = lambda s: tokenizer.encode(s, False)

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text) if isinstance(text, bytes) else self._encode(text)
