"""Sampling one token per request from its last logits, in vLLM 0.33's order: allowed tokens,
banned tokens (min_tokens' stops, bad words), logit bias and penalties on the raw logits; greedy
rows take the argmax; the others get temperature, min-p, top-k and top-p and one draw.

Every logits transform runs batched over the rows in torch; only the draw runs per request, with
that request's own generator, so a seeded request samples the same tokens whatever else is in
the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.wire.messages import SamplingParams, is_greedy


@dataclass(slots=True)
class SampleRequest:
    """What the sampler needs about one row of the logits."""

    params: SamplingParams
    generator: torch.Generator | None = None  # None: greedy, or the caller's shared generator
    banned_token_ids: Sequence[int] = ()  # e.g. EOS while fewer than min_tokens were generated
    prompt_token_ids: Sequence[int] = ()  # for the repetition penalty
    output_token_ids: Sequence[int] = ()  # for the penalties and bad words

    @property
    def greedy(self) -> bool:
        return is_greedy(self.params.temperature)


def sample(
    logits: torch.Tensor,
    requests: Sequence[SampleRequest],
    default_generator: torch.Generator | None = None,
) -> list[int]:
    """One token id per row of logits [num_reqs, vocab]."""
    processed = process_logits(logits, requests)
    dead = ~torch.isfinite(processed).any(dim=-1)
    if bool(dead.any()):
        # Every token masked (a finished grammar allows only EOS, which min_tokens bans): the
        # logits as they came decide, rather than a softmax of NaNs failing the whole step.
        processed[dead] = logits[dead].float()
    logits = processed
    tokens = logits.argmax(dim=-1).tolist()
    random_rows = [i for i, r in enumerate(requests) if not r.greedy]
    if random_rows:
        chosen = [requests[i] for i in random_rows]
        sorted_probs, sorted_ids = filtered_probs(logits[random_rows], [r.params for r in chosen])
        for j, (row, r) in enumerate(zip(random_rows, chosen, strict=True)):
            gen = r.generator if r.generator is not None else default_generator
            pick = torch.multinomial(sorted_probs[j], 1, generator=gen)
            tokens[row] = int(sorted_ids[j, pick])
    return tokens


def process_logits(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
    """The logits after every request's masks, bias and penalties (a float32 copy)."""
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    _apply_allowed(logits, requests)
    rows, cols = _flat(
        (row, t)
        for row, r in enumerate(requests)
        for t in (*r.banned_token_ids, *bad_words_to_ban(r))
        if 0 <= t < vocab
    )
    if rows:
        logits[_long(rows, logits), _long(cols, logits)] = float("-inf")
    biased = [
        (row, t, b)
        for row, r in enumerate(requests)
        for t, b in (r.params.logit_bias or {}).items()
        if 0 <= t < vocab
    ]
    if biased:
        index = (_long([b[0] for b in biased], logits), _long([b[1] for b in biased], logits))
        values = torch.tensor([b[2] for b in biased], dtype=logits.dtype, device=logits.device)
        logits.index_put_(index, values, accumulate=True)
    _apply_penalties(logits, requests)
    return logits


def bad_words_to_ban(request: SampleRequest) -> list[int]:
    """vLLM's bad words: a word's last token is banned when the output ends with the rest of it
    (a one-token word is always banned)."""
    out = request.output_token_ids
    banned = []
    for word in request.params.bad_words_token_ids or ():
        prefix = word[:-1]
        if not prefix or (
            len(out) >= len(prefix) and list(out[len(out) - len(prefix) :]) == prefix
        ):
            banned.append(word[-1])
    return banned


def _apply_allowed(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> None:
    rows = [i for i, r in enumerate(requests) if r.params.allowed_token_ids]
    if not rows:
        return
    vocab = logits.shape[-1]
    keep = torch.zeros(len(rows), vocab, dtype=torch.bool, device=logits.device)
    r_idx, t_idx = _flat(
        (j, t)
        for j, row in enumerate(rows)
        for t in requests[row].params.allowed_token_ids or ()
        if 0 <= t < vocab
    )
    keep[_long(r_idx, logits), _long(t_idx, logits)] = True
    index = _long(rows, logits)
    logits[index] = logits[index].masked_fill(~keep, float("-inf"))


def _apply_penalties(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> None:
    """vLLM's apply_penalties: repetition over prompt and output tokens, frequency and presence
    over output tokens, all rows at once from padded token tensors."""
    rows = [
        i
        for i, r in enumerate(requests)
        if r.params.presence_penalty != 0
        or r.params.frequency_penalty != 0
        or r.params.repetition_penalty != 1
    ]
    if not rows:
        return
    chosen = [requests[i] for i in rows]
    vocab = logits.shape[-1]
    index = _long(rows, logits)
    sub = logits[index]
    output_counts = _bin_counts([r.output_token_ids for r in chosen], vocab, logits.device)
    output_mask = output_counts > 0
    prompt_mask = _bin_counts([r.prompt_token_ids for r in chosen], vocab, logits.device) > 0

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=sub.dtype, device=sub.device)[:, None]

    repetition = column([r.params.repetition_penalty for r in chosen]).expand_as(sub)
    repetition = torch.where(prompt_mask | output_mask, repetition, torch.ones_like(repetition))
    sub = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub -= column([r.params.frequency_penalty for r in chosen]) * output_counts
    sub -= column([r.params.presence_penalty for r in chosen]) * output_mask
    logits[index] = sub


def _bin_counts(
    token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """[rows, vocab] occurrence counts, from one padded tensor (the pad column is dropped)."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), max(width, 1)), vocab, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        if tokens:
            padded[i, : len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.long)
    padded = padded.to(device)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def filtered_probs(
    logits: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities after temperature, top-k, min-p then top-p, in descending order, with ids.

    Works in sorted order: top-k keeps the first k ranks; min-p drops tokens less likely than
    min_p times the top token (a ratio, so its place among the cuts does not matter); top-p keeps
    the shortest prefix whose mass reaches p (always at least the top token).
    """
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    sorted_logits, sorted_ids = torch.sort(logits / temperature[:, None], dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    probs = probs.masked_fill(probs < probs[:, :1] * min_p[:, None], 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p = 1 cuts nothing, even where float rounding pushes the running mass past 1.
    cut = (mass_before >= top_p[:, None]) & (ranks[None, :] > 0) & (top_p[:, None] < 1.0)
    probs = probs.masked_fill(cut, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), sorted_ids


def _flat(pairs) -> tuple[list[int], list[int]]:
    rows: list[int] = []
    cols: list[int] = []
    for row, col in pairs:
        rows.append(row)
        cols.append(col)
    return rows, cols


def _long(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, index: int) -> int:
    """The seed of a request's draw for its token at `index` (splitmix64 of seed and index).

    Reseeding per token, not keeping one running generator, makes a seeded request draw the
    same tokens after a preemption, when it comes back as a new request with a fresh generator.
    """
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # torch seeds must fit in a signed 64-bit int
