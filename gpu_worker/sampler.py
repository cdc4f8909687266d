"""Sampling one token per request from its last logits: greedy, or temperature/top-k/top-p.

The filters run batched; the random draw runs per request with that request's own generator,
so a seeded request samples the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.messages import SamplingParams


@dataclass(slots=True)
class SampleRequest:
    """What the sampler needs about one row of the logits."""

    params: SamplingParams
    generator: torch.Generator | None = None  # None: greedy, or the caller's shared generator
    banned_token_ids: Sequence[int] = ()  # e.g. EOS while fewer than min_tokens were generated


def sample(
    logits: torch.Tensor,
    requests: Sequence[SampleRequest],
    default_generator: torch.Generator | None = None,
) -> list[int]:
    """One token id per row of logits [num_reqs, vocab]."""
    logits = logits.float()
    if any(r.banned_token_ids for r in requests):
        logits = logits.clone()
        for row, r in enumerate(requests):
            if r.banned_token_ids:
                logits[row, list(r.banned_token_ids)] = float("-inf")
    tokens = logits.argmax(dim=-1).tolist()
    random_rows = [i for i, r in enumerate(requests) if r.params.temperature > 0]
    if random_rows:
        chosen = [requests[i] for i in random_rows]
        sorted_probs, sorted_ids = filtered_probs(logits[random_rows], [r.params for r in chosen])
        for j, (row, r) in enumerate(zip(random_rows, chosen, strict=True)):
            gen = r.generator if r.generator is not None else default_generator
            pick = torch.multinomial(sorted_probs[j], 1, generator=gen)
            tokens[row] = int(sorted_ids[j, pick])
    return tokens


def filtered_probs(
    logits: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities after temperature, top-k then top-p, in descending order, with their ids.

    Works in sorted order: top-k keeps the first k ranks, top-p keeps the shortest prefix whose
    mass reaches p (always at least the top token); the rest get probability 0.
    """
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    sorted_logits, sorted_ids = torch.sort(logits / temperature[:, None], dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p = 1 cuts nothing, even where float rounding pushes the running mass past 1.
    cut = (mass_before >= top_p[:, None]) & (ranks[None, :] > 0) & (top_p[:, None] < 1.0)
    probs = probs.masked_fill(cut, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), sorted_ids


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
