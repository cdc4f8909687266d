"""Replayable workloads: the paged-allocator blog's lognormal mix, and a shared-prefix mix.

`blog_workload` reproduces `../shared/seeds/004_*.txt` exactly (seed 20261013: 400 requests,
276,007 tokens); token ids are derived per request from the same seed so the real ledger can
hash them. `shared_prefix_workload` puts a few long system prompts in front of unique questions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

BLOG_SEED = 20261013


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def blog_lengths(n: int = 400, seed: int = BLOG_SEED) -> list[tuple[int, int]]:
    """(prompt, output) lengths: lognormal long tails, prompts 8..1800, outputs 8..900."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(n):
        prompt = min(int(rng.lognormvariate(6.0, 0.7)), 1800)
        output = min(int(rng.lognormvariate(4.8, 0.9)), 900)
        lengths.append((max(prompt, 8), max(output, 8)))
    return lengths


def _unique_tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab) for _ in range(n))


def blog_workload(n: int = 400, seed: int = BLOG_SEED, vocab: int = 32000) -> list[SimRequest]:
    rng = random.Random(seed + 1)
    return [
        SimRequest(f"blog-{i}", _unique_tokens(rng, prompt, vocab), output)
        for i, (prompt, output) in enumerate(blog_lengths(n, seed))
    ]


def shared_prefix_workload(
    n: int = 400,
    num_prefixes: int = 8,
    prefix_len: int = 1000,
    seed: int = BLOG_SEED,
    vocab: int = 32000,
) -> list[SimRequest]:
    """The blog's lengths, each prompt led by one of `num_prefixes` shared system prompts."""
    rng = random.Random(seed + 2)
    prefixes = [_unique_tokens(rng, prefix_len, vocab) for _ in range(num_prefixes)]
    out = []
    for i, (prompt, output) in enumerate(blog_lengths(n, seed)):
        prefix = prefixes[rng.randrange(num_prefixes)]
        out.append(SimRequest(f"shared-{i}", prefix + _unique_tokens(rng, prompt, vocab), output))
    return out


def synthetic_token(request_index: int, position: int, vocab: int = 32000) -> int:
    """The 'sampled' token of a simulated request: deterministic, different per request."""
    return (request_index * 7919 + position * 104729) % vocab
