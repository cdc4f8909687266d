"""Seeded random manager-level traces with shared prefixes, cache salts and pool pressure.

The generator plays a small scheduler against our ledger (through replay.apply) so that it only
issues ops that make sense in the state it sees: admit the head of `waiting`, grow a running
request and preempt from the tail of `running` when it cannot grow, finish, abort, reset.
The ops it records are then replayed from scratch on each side.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tests.oracle.ledger_backend import LedgerBackend
from tests.oracle.replay import Op, apply

VOCAB = 32000
SALTS = (None, None, None, "tenant-a", "tenant-b")


@dataclass
class TraceSpec:
    seed: int
    hash_algo: str = "sha256"
    block_size: int = 16
    num_blocks: int = 40
    num_ops: int = 400
    max_model_len: int = 1024
    watermark: float = 0.0
    none_hash_seed: str | None = None  # None: vLLM's default, "vllm-none-hash"

    def config(self) -> dict[str, Any]:
        return {
            "hash_algo": self.hash_algo,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "max_model_len": self.max_model_len,
            "watermark": self.watermark,
            "none_hash_seed": self.none_hash_seed,
        }


@dataclass
class _Generator:
    spec: TraceSpec
    rng: random.Random
    backend: LedgerBackend
    ops: list[Op] = field(default_factory=list)
    requests: dict[str, Any] = field(default_factory=dict)
    waiting: deque[str] = field(default_factory=deque)
    running: list[str] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    prefixes: list[list[int]] = field(default_factory=list)
    next_id: int = 0

    def do(self, op: Op) -> dict[str, Any]:
        result = apply(self.backend, self.requests, op, len(self.ops))
        self.ops.append(op)
        return result

    def prompt(self) -> list[int]:
        rng, bs = self.rng, self.spec.block_size
        # Keep prompts well under the pool, so every request can be admitted eventually.
        cap = min((self.spec.num_blocks - 1) * bs // 3, self.spec.max_model_len // 2)
        kind = rng.random()
        if kind < 0.15 and self.prompts:  # an exact repeat: the hit stops at num_tokens - 1
            return list(rng.choice(self.prompts))
        head: list[int] = []
        if kind < 0.8:  # some of a shared system prompt, often cut mid-block
            prefix = rng.choice(self.prefixes)
            head = prefix[: rng.randrange(1, len(prefix) + 1)]
        tail_len = rng.choice((0, 1, bs - 1, bs, bs + 1, rng.randrange(1, 3 * bs)))
        prompt = (head + [rng.randrange(VOCAB) for _ in range(tail_len)])[:cap]
        return prompt or [rng.randrange(VOCAB)]

    def add(self) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = self.prompt()
        self.prompts.append(prompt)
        self.do({"op": "add", "rid": rid, "prompt": prompt, "salt": self.rng.choice(SALTS)})
        self.waiting.append(rid)

    def budget(self) -> int:
        return self.rng.choice((self.spec.block_size, 3 * self.spec.block_size, 1 << 20))

    def admit(self) -> None:
        rid = self.waiting[0]
        op = {
            "op": "admit",
            "rid": rid,
            "budget": self.budget(),
            "has_scheduled": bool(self.running),
        }
        if self.do(op)["ok"]:
            self.running.append(self.waiting.popleft())

    def grow(self) -> None:
        rid = self.rng.choice(self.running)
        request = self.requests[rid]
        append: list[int] = []
        if request.num_computed_tokens == request.num_tokens:  # decode: 1 token, or a burst
            count = (
                1 if self.rng.random() < 0.7 else self.rng.randrange(2, 2 * self.spec.block_size)
            )
            if request.num_tokens + count >= self.spec.max_model_len:
                return self.finish(rid)
            append = [self.rng.randrange(VOCAB) for _ in range(count)]
        budget = self.budget()
        while not self.do({"op": "step", "rid": rid, "append": append, "budget": budget})["ok"]:
            append = []  # the tokens are in; a retry only asks for slots
            victim = self.running.pop()  # the scheduler preempts from the tail of running
            self.do({"op": "preempt", "rid": victim})
            self.waiting.appendleft(victim)
            if victim == rid:
                break

    def finish(self, rid: str) -> None:
        self.running.remove(rid)
        self.do({"op": "free", "rid": rid})

    def abort_waiting(self) -> None:
        rid = self.rng.choice(self.waiting)
        self.waiting.remove(rid)
        self.do({"op": "free", "rid": rid})

    def reset(self) -> None:
        if self.rng.random() < 0.5:  # drain first, so the reset can succeed
            for rid in list(self.running):
                self.finish(rid)
        self.do({"op": "reset"})

    def run(self) -> list[Op]:
        bs, rng = self.spec.block_size, self.rng
        self.prefixes = [
            [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 7) * bs + rng.randrange(bs))]
            for _ in range(3)
        ]
        while len(self.ops) < self.spec.num_ops:
            roll = rng.random()
            if roll < 0.2 and len(self.waiting) < 6:
                self.add()
            elif roll < 0.45 and self.waiting:
                self.admit()
            elif roll < 0.85 and self.running:
                self.grow()
            elif roll < 0.95 and self.running:
                self.finish(rng.choice(self.running))
            elif roll < 0.97 and self.waiting:
                self.abort_waiting()
            elif roll >= 0.99:
                self.reset()
        return self.ops


def generate_trace(spec: TraceSpec) -> dict[str, Any]:
    config = spec.config()
    gen = _Generator(spec, random.Random(spec.seed), LedgerBackend(config))
    return {"config": config, "ops": gen.run()}
