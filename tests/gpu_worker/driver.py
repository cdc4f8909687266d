"""A tiny in-process ledger for tests: drives a ModelRunner through real StepMessages.

Naive block allocation (block 0 stays the null block), a prefix cache of full computed blocks
that outlive their requests until reallocated (as vLLM's), chunked prefill and preemption by
recompute. No admission control: the cache must be big enough for the test.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from gpu_worker.runner import ModelRunner, StepOutput
from services.wire.messages import CachedRequestData, NewRequestData, SamplingParams, StepMessage

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Seq:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    on_worker: bool = False
    unsent_tokens: list[int] = field(default_factory=list)
    unsent_blocks: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prefix-cache hit at the last admission

    @property
    def outputs(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class MiniLedger:
    def __init__(self, runner: ModelRunner, prefix_caching: bool = True, epoch: str = "e0") -> None:
        self.runner, self.bs = runner, runner.block_size
        self.prefix_caching, self.epoch = prefix_caching, epoch
        self.free = deque(range(1, runner.num_blocks))
        self.ref: Counter[int] = Counter()
        self.cached: dict[tuple[int, ...], int] = {}  # token prefix of a full block -> block id
        self.prefix_of: dict[int, tuple[int, ...]] = {}
        self.seqs: dict[str, Seq] = {}
        self.finished: list[str] = []
        self.preempted: list[str] = []
        self.step_id = 0
        self.num_prefix_hit_tokens = 0
        self.num_preemptions = 0

    def add(self, req_id: str, prompt: list[int], sampling: SamplingParams = GREEDY) -> Seq:
        seq = Seq(req_id, list(prompt), len(prompt), sampling)
        self.seqs[req_id] = seq
        return seq

    def step(self, max_chunk: int | None = None, only: list[str] | None = None) -> StepOutput:
        """Schedule every request (or `only` these) for up to max_chunk tokens, run, apply."""
        news, cached, scheduled = [], [], {}
        for seq in self.seqs.values():
            if only is not None and seq.req_id not in only:
                continue
            admitted = not seq.on_worker
            if admitted:
                self._admit(seq)
            remaining = len(seq.token_ids) - seq.num_computed_tokens
            n = min(remaining, max_chunk or remaining)
            self._allocate(seq, seq.num_computed_tokens + n)
            scheduled[seq.req_id] = n
            if admitted:
                news.append(
                    NewRequestData(
                        seq.req_id,
                        list(seq.token_ids),
                        seq.num_prompt_tokens,
                        list(seq.block_ids),
                        seq.num_computed_tokens,
                        seq.sampling,
                    )
                )
            else:
                cached.append(
                    CachedRequestData(
                        seq.req_id, seq.unsent_tokens, seq.unsent_blocks, seq.num_computed_tokens
                    )
                )
            seq.on_worker, seq.unsent_tokens, seq.unsent_blocks = True, [], []
        self.step_id += 1
        step = StepMessage(
            self.step_id,
            self.epoch,
            news,
            cached,
            scheduled,
            self.finished,
            self.preempted,
            self.bs,
        )
        self.finished, self.preempted = [], []
        out = self.runner.run_step(step)
        for req_id, n in scheduled.items():
            seq = self.seqs[req_id]
            seq.num_computed_tokens += n
            self._cache_full_blocks(seq)
            if req_id in out.sampled:  # the worker keeps what it sampled: nothing to send back
                seq.token_ids.append(out.sampled[req_id])
        return out

    def preempt(self, req_id: str) -> None:
        seq = self.seqs[req_id]
        self._free(seq)
        seq.num_computed_tokens, seq.on_worker = 0, False
        seq.unsent_tokens, seq.unsent_blocks = [], []
        self.preempted.append(req_id)
        self.num_preemptions += 1

    def finish(self, req_id: str) -> Seq:
        seq = self.seqs.pop(req_id)
        self._free(seq)
        self.finished.append(req_id)
        return seq

    def _admit(self, seq: Seq) -> None:
        hits: list[int] = []
        if self.prefix_caching:  # at most len - 1 tokens: the last one must be computed
            for j in range((len(seq.token_ids) - 1) // self.bs):
                block = self.cached.get(tuple(seq.token_ids[: (j + 1) * self.bs]))
                if block is None:
                    break
                hits.append(block)
        for block in hits:
            if self.ref[block] == 0:
                self.free.remove(block)  # a cached free block comes back into use
            self.ref[block] += 1
        seq.block_ids = hits
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.bs
        self.num_prefix_hit_tokens += seq.num_cached_tokens

    def _allocate(self, seq: Seq, num_tokens: int) -> None:
        while len(seq.block_ids) * self.bs < num_tokens:
            block = self.free.popleft()
            self._evict(block)
            self.ref[block] = 1
            seq.block_ids.append(block)
            seq.unsent_blocks.append(block)

    def _cache_full_blocks(self, seq: Seq) -> None:
        if not self.prefix_caching:
            return
        for j in range(seq.num_computed_tokens // self.bs):
            key = tuple(seq.token_ids[: (j + 1) * self.bs])
            if key not in self.cached:
                self.cached[key] = seq.block_ids[j]
                self.prefix_of[seq.block_ids[j]] = key

    def _evict(self, block: int) -> None:
        key = self.prefix_of.pop(block, None)
        if key is not None:
            del self.cached[key]

    def _free(self, seq: Seq) -> None:
        for block in reversed(seq.block_ids):  # tail first, as vLLM frees
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free.append(block)  # still cached until _allocate takes it again
        seq.block_ids = []


def generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    sampling: SamplingParams = GREEDY,
    max_chunk: int | None = None,
    preempt_after: dict[int, int] | None = None,
    ledger: MiniLedger | None = None,
) -> list[list[int]]:
    """All prompts in one batch until each has max_tokens outputs (EOS does not stop them).

    preempt_after {prompt index: n}: preempt that request once it has n outputs; it resumes
    (recomputing prompt + outputs) in the next step.
    """
    ledger = ledger or MiniLedger(runner)
    ids = [f"r{i}-{ledger.step_id}" for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts, strict=True):
        ledger.add(req_id, prompt, sampling)
    pending = dict(preempt_after or {})
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        ledger.step(max_chunk, only=[r for r in ids if r not in done])
        for i, req_id in enumerate(ids):
            seq = ledger.seqs.get(req_id)
            if seq is None:
                continue
            if len(seq.outputs) >= max_tokens:
                done[req_id] = ledger.finish(req_id).outputs
            elif pending.get(i) == len(seq.outputs):
                del pending[i]
                ledger.preempt(req_id)
    return [done[r] for r in ids]


def generate_greedy(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    max_chunk: int | None = None,
    preempt_after: dict[int, int] | None = None,
    ledger: MiniLedger | None = None,
) -> list[list[int]]:
    return generate(
        runner,
        prompts,
        max_tokens,
        sampling=GREEDY,
        max_chunk=max_chunk,
        preempt_after=preempt_after,
        ledger=ledger,
    )
