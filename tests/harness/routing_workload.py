"""A multi-tenant chat workload for routing, replayable from a seed.

Tenants share a few long system prompts (1-2k tokens) chosen with Zipf popularity; each
conversation opens with a short user message and may come back for more turns, each prompt
extending the previous one with the assistant's answer and a new user message. Every token is
fixed up front (the answers too, so a simulation can "sample" them and follow-ups extend what
the replica really cached). A conversation's first turn arrives by a Poisson process; a
follow-up arrives a think time after its previous turn finished.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


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
