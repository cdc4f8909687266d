"""A multi-tenant chat workload for routing, replayable from a seed.

Tenants share a few long system prompts (1-2k tokens) chosen with Zipf popularity; each
conversation opens with a short user message and may come back for more turns, each prompt
extending the previous one with the assistant's answer and a new user message. Every token is
fixed up front (the answers too, so a simulation can "sample" them and follow-ups extend what
the replica really cached). A conversation's first turn arrives by a Poisson process; a
follow-up arrives a think time after its previous turn finished.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    num_conversations: int = 800
    num_system_prompts: int = 32
    system_len: tuple[int, int] = (1024, 2048)
    zipf_s: float = 1.1
    user_len: tuple[int, int] = (32, 128)
    output_len: tuple[int, int] = (16, 64)
    max_turns: int = 4
    follow_up_p: float = 0.6  # chance that a conversation goes on after each turn
    rate: float = 40.0  # conversations per second, all tenants together
    think_s: float = 0.2  # mean pause between an answer and the next question
    vocab: int = 32000
    seed: int = 20261013


@dataclass(frozen=True, slots=True)
class Turn:
    request_id: str
    conversation: int
    turn: int
    system_prompt: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # what the replica will sample, in order
    arrival_s: float  # first turns: when it arrives; follow-ups: unused (see think_s)
    think_s: float  # follow-ups: the pause after the previous turn finished
    previous: int | None  # index of the previous turn in the workload

    @property
    def max_tokens(self) -> int:
        return len(self.output_token_ids)


def _tokens(rng: random.Random, bounds: tuple[int, int], vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab) for _ in range(rng.randint(*bounds)))


def multi_tenant_workload(config: WorkloadConfig = WorkloadConfig()) -> list[Turn]:
    """The turns in generation order: a follow-up always comes after the turn it extends."""
    rng = random.Random(config.seed)
    systems = [
        _tokens(rng, config.system_len, config.vocab) for _ in range(config.num_system_prompts)
    ]
    weights = [1.0 / (rank + 1) ** config.zipf_s for rank in range(config.num_system_prompts)]
    turns: list[Turn] = []
    clock = 0.0
    for conversation in range(config.num_conversations):
        clock += rng.expovariate(config.rate)
        system = rng.choices(range(config.num_system_prompts), weights)[0]
        history = systems[system]
        previous: int | None = None
        for turn in range(config.max_turns):
            if turn and rng.random() >= config.follow_up_p:
                break
            prompt = history + _tokens(rng, config.user_len, config.vocab)
            output = _tokens(rng, config.output_len, config.vocab)
            turns.append(
                Turn(
                    request_id=f"c{conversation}-t{turn}",
                    conversation=conversation,
                    turn=turn,
                    system_prompt=system,
                    prompt_token_ids=prompt,
                    output_token_ids=output,
                    arrival_s=clock,
                    think_s=rng.expovariate(1.0 / config.think_s),
                    previous=previous,
                )
            )
            previous = len(turns) - 1
            history = prompt + output
    return turns


# The Mooncake FAST'25 synthetic trace (kvcache-ai/Mooncake, Apache-2.0): ../shared/traces/.
MOONCAKE_TRACE = (
    Path(__file__).resolve().parents[3] / "shared" / "traces" / ("mooncake_synthetic_trace.jsonl")
)


@dataclass(frozen=True, slots=True)
class TraceReplay:
    """How every benchmark of this project replays the trace, so figures compare
    (../shared/traces/README.md): each hash id a fixed run of `tokens_per_id` token ids (one KV
    block), at most `max_ids` ids per prompt, `max_tokens` out, in arrival order."""

    tokens_per_id: int = 16
    max_ids: int = 32
    max_tokens: int = 4
    vocab: int = 32000
    first: int = 0  # a window: its first request and length (None: to the end)
    count: int | None = None
    path: Path = MOONCAKE_TRACE


def trace_turns(replay: TraceReplay = TraceReplay()) -> list[Turn]:
    """The trace's requests as turns, in arrival order: independent requests (a multi-turn
    conversation shows only as a shared prefix), each with `max_tokens` fixed outputs."""
    rows = []
    with open(replay.path) as trace:
        for number, line in enumerate(trace):
            if number < replay.first:
                continue
            if replay.count is not None and len(rows) >= replay.count:
                break
            rows.append(json.loads(line))
    runs: dict[int, tuple[int, ...]] = {}

    def run_of(hash_id: int) -> tuple[int, ...]:
        run = runs.get(hash_id)
        if run is None:
            rng = random.Random(hash_id * 1_000_003 + 17)
            run = tuple(rng.randrange(1, replay.vocab) for _ in range(replay.tokens_per_id))
            runs[hash_id] = run
        return run

    turns = []
    for index, row in enumerate(rows):
        ids = row["hash_ids"][: replay.max_ids]
        prompt = tuple(token for hash_id in ids for token in run_of(hash_id))
        rng = random.Random(replay.first + index)
        turns.append(
            Turn(
                request_id=f"m{replay.first + index}",
                conversation=replay.first + index,
                turn=0,
                system_prompt=ids[0] if ids else -1,
                prompt_token_ids=prompt,
                output_token_ids=tuple(
                    rng.randrange(1, replay.vocab) for _ in range(replay.max_tokens)
                ),
                arrival_s=row["timestamp"] / 1000.0,
                think_s=0.0,
                previous=None,
            )
        )
    return turns


def prefix_bound(turns: list[Turn], block_size: int) -> float:
    """The share of prompt tokens one infinite cache hits: every leading block already seen in
    an earlier prompt (the trace's bound, as the README counts it)."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for turn in turns:
        tokens = turn.prompt_token_ids
        total += len(tokens)
        leading = True
        for end in range(block_size, len(tokens) + 1, block_size):
            key = tokens[:end]
            if leading and key in seen:
                hit += block_size
            else:
                leading = False
            seen.add(key)
    return hit / max(total, 1)
