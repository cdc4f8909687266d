"""The step runner: per-request state, the paged KV cache tensors, and `execute(step)`.

The ledger decides every block; the runner only turns a `StepMessage` into one forward pass
(slot mapping, block tables, seq_lens) and samples where a request's chunk reaches its end.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from gpu_worker.checkpoint import load_model, model_name
from gpu_worker.devices import resolve_device
from gpu_worker.logprobs import gather_logprobs
from gpu_worker.model import LlamaForCausalLM
from gpu_worker.offload import HostKVTier, TransferError
from gpu_worker.parallel import TensorParallel
from gpu_worker.profile import (
    MemoryProfile,
    ProfileSettings,
    check_cuda_free_memory,
    cuda_snapshot,
    profile_memory,
)
from gpu_worker.sampler import SampleRequest, position_seed, sample
from gpu_worker.structured import GrammarError, GrammarRow, GrammarState, StructuredOutputs
from kernels import (
    AttentionBackend,
    AttentionPlan,
    AttentionSpec,
    KVCache,
    kv_cache_shape,
    select_backend,
)
from ledger.capacity import cdiv
from services.tokenization.model_source import TINY_MODEL
from services.wire.messages import (
    CachedRequestData,
    KVTransfers,
    NewRequestData,
    PromptLogprobs,
    SamplingParams,
    StepMessage,
    TokenLogprobs,
    is_greedy,
)


class StepError(ValueError):
    """A step the runner refuses before touching any state or tensor; names request and problem."""


class RequestsFailed(RuntimeError):
    """The step failed because of these requests alone (req_id -> the error each one raised):
    sampled one at a time, every other request of the batch went through."""

    def __init__(self, errors: dict[str, str]) -> None:
        super().__init__("; ".join(f"request {r}: {e}" for r, e in errors.items()))
        self.errors = errors


@dataclass(slots=True)
class RunnerConfig:
    model: str = (
        TINY_MODEL  # services.tokenization.model_source: tiny, smollm2, a .gguf file or a folder
    )
    dtype: str = "auto"
    device: str = "auto"  # auto: cuda when available, else cpu
    block_size: int = 16
    max_model_len: int = 2048
    seed: int | None = None  # default model's weights (None: KVLEDGER_SEED) and unseeded sampling
    kernels: str = "auto"  # attention backend: auto, cuda or reference (kernels.select_backend)
    profile: ProfileSettings = field(default_factory=ProfileSettings)
    tp: TensorParallel = field(default_factory=TensorParallel)  # this worker's rank and group


@dataclass(slots=True)
class RequestState:
    token_ids: list[int]  # prompt plus the outputs the ledger has sent back
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    generator: torch.Generator | None  # seeded random sampling only
    grammar: GrammarState | None = None  # structured outputs: the request's matcher


class _CopyClock:
    """Times a step's copies before and after its forward pass: marks at the start, after the
    loads, after the forward pass and after the stores; `seconds` is [loads, stores]. On CUDA
    the marks are events on the stream (read once the step's results are in, so they are done),
    elsewhere the wall clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        start, loaded, computed, stored = self.marks
        if self.cuda:
            stored.synchronize()
            return [start.elapsed_time(loaded) / 1e3, computed.elapsed_time(stored) / 1e3]
        return [loaded - start, stored - computed]


@dataclass(slots=True)
class StepOutput:
    sampled: dict[str, int]  # req_id -> token, for requests whose chunk reached their end
    logits: torch.Tensor | None  # [len(sampled), vocab] in sampled's order, before sampling
    num_tokens: int  # tokens the forward pass computed (prefix-cache hits excluded)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # of the sampled tokens
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    transfers_done: list[int] | None = None  # the step's CPU-tier copies, all run
    transfer_seconds: list[float] | None = None  # [the copies before the forward, after it]


@dataclass(slots=True)
class _Chunk:
    """One scheduled request of a step, validated, before its state changes are applied."""

    req_id: str
    state: RequestState
    new_token_ids: list[int]
    new_block_ids: list[int]
    start: int  # num_computed_tokens: first position computed this step
    num_tokens: int


class ModelRunner:
    """The model, its paged KV cache, and what the worker knows of each running request."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        *,
        seed: int = 0,
        name: str = "",
        profile: MemoryProfile | None = None,
        backend: AttentionBackend | None = None,
        tokenizer_model: str = TINY_MODEL,  # whose tokenizer structured outputs mask over
    ) -> None:
        self.model = model
        model.fuse_projections()  # one matmul for q/k/v and one for gate/up (names unchanged)
        self.config = model.config
        self.name = name
        self.profile = profile
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.num_blocks, self.block_size = num_blocks, block_size
        # Chosen once for the worker's life; reported in its hello (WorkerHello.attention_backend).
        self.backend = backend or select_backend(attention_spec(model, block_size))
        shape = kv_cache_shape(
            num_blocks, block_size, model.num_local_kv_heads, self.config.head_dim
        )  # this rank's KV heads for every block id (all of them at tensor-parallel size 1)
        self.kv_caches: list[KVCache] = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.config.num_hidden_layers)
        ]
        self.requests: dict[str, RequestState] = {}
        self.epoch: str | None = None
        # The CPU tier's host buffer, made at the first step that names the tier's size.
        self.host_tier: HostKVTier | None = None
        self._generator = torch.Generator(self.device).manual_seed(seed)  # unseeded requests
        self._seed = seed
        self.structured = StructuredOutputs(tokenizer_model, self.config.vocab_size)
        # Decode steps replay CUDA graphs where the backend has them (the CUDA kernels).
        max_blocks = min(num_blocks, cdiv(self.config.max_position_embeddings, block_size))
        self.backend.use_cuda_graphs(self._forward, block_size, max_blocks)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, plan)

    @classmethod
    def create(cls, cfg: RunnerConfig) -> ModelRunner:
        """Load the model, profile memory, and allocate the KV cache the profile allows."""
        device = resolve_device(cfg.device)
        start = None
        if device.type == "cuda" and cfg.profile.kv_cache_memory_bytes is None:
            start = cuda_snapshot(device)
            check_cuda_free_memory(start, cfg.profile.gpu_memory_utilization)
        model = load_model(
            cfg.model,
            dtype=cfg.dtype,
            device=device,
            seed=cfg.seed,
            max_model_len=cfg.max_model_len,
            tp=cfg.tp,
        )
        backend = select_backend(attention_spec(model, cfg.block_size), cfg.kernels)
        settings = dataclasses.replace(cfg.profile, block_size=cfg.block_size)
        profile = profile_memory(model, settings, start, backend=backend)
        return cls(
            model,
            profile.num_gpu_blocks,
            cfg.block_size,
            seed=cfg.seed or 0,
            name=model_name(cfg.model),
            profile=profile,
            backend=backend,
            tokenizer_model=cfg.model,
        )

    def reset(self) -> None:
        self.requests.clear()
        if self.model.tp.size > 1:
            # Every rank samples the same full logits: a re-formed group (one rank restarted)
            # must draw the same unseeded tokens on every rank, so all start over together.
            self._generator.manual_seed(self._seed)

    def execute(self, step: StepMessage) -> dict[str, int]:
        """Run one scheduler step; returns req_id -> sampled token for requests that sample."""
        return self.run_step(step).sampled

    @torch.inference_mode()
    def run_step(self, step: StepMessage) -> StepOutput:
        """execute(), also returning the logits the tokens were sampled from.

        Token ranges of one scheduled request (p = position, bs = block_size):

            | in the cache        | computed this step   | known, computed later |
            0         num_computed_tokens      +num_scheduled_tokens        len(token_ids)

        The step's K/V go to slot block_ids[p // bs] * bs + p % bs; attention reads positions
        0..p from the cache; the request samples only if its chunk ends at len(token_ids).
        """
        if step.epoch != self.epoch:
            self.reset()  # a new ledger: none of our requests or block ids mean anything now
            self.epoch = step.epoch
        if step.block_size != self.block_size:
            raise StepError(f"step block_size {step.block_size} != the cache's {self.block_size}")
        transfers = step.kv_transfers
        tier = self._host_tier(transfers) if transfers is not None else None
        for req_id in (*step.finished_req_ids, *step.preempted_req_ids):
            self.requests.pop(req_id, None)
        chunks = self._plan(step)
        for c in chunks:  # validated: apply the step's changes to the request states
            c.state.token_ids.extend(c.new_token_ids)
            c.state.block_ids.extend(c.new_block_ids)
            self.requests[c.req_id] = c.state
        if tier is None or transfers is None:
            running = [c for c in chunks if c.num_tokens > 0]
            return self._run(running) if running else StepOutput({}, None, 0)
        # The CPU tier's copies around the forward pass (KVTransfers says why in this order),
        # timed on the device's own clock (CUDA events: a load is queued, not waited for).
        clock = _CopyClock(self.device)
        done = tier.before_forward(transfers, self.kv_caches)
        clock.mark()
        running = [c for c in chunks if c.num_tokens > 0]
        output = self._run(running) if running else StepOutput({}, None, 0)
        clock.mark()
        output.transfers_done = done + tier.after_forward(transfers, self.kv_caches)
        clock.mark()
        output.transfer_seconds = clock.seconds()
        return output

    def _host_tier(self, transfers: KVTransfers) -> HostKVTier:
        """The buffer the step's copies use, made (or remade at another size: a new ledger's
        tier, empty in its books too) before anything changes; the copies checked against it."""
        tier = self.host_tier
        if tier is None or tier.num_chunks != transfers.num_cpu_chunks:
            if transfers.num_cpu_chunks < 1:
                raise StepError(f"a CPU tier of {transfers.num_cpu_chunks} chunks")
            self.host_tier = tier = None  # the old buffer goes before the new one is pinned
            tier = self.host_tier = HostKVTier(self.kv_caches, transfers.num_cpu_chunks)
        try:
            tier.check(transfers, self.num_blocks)
            tier.check_shared(transfers)
        except TransferError as exc:
            raise StepError(f"CPU tier: {exc}") from None
        return tier

    def _plan(self, step: StepMessage) -> list[_Chunk]:
        """Check the whole step against the cache and the model; change nothing.

        Returns one chunk per request the step mentions; those not scheduled have 0 tokens.
        """
        news = {r.req_id: r for r in step.new_reqs}
        cached = {r.req_id: r for r in step.cached_reqs}
        scheduled = step.num_scheduled_tokens
        chunks = []
        # A grammar this worker cannot build is that request's fault alone: the others of the
        # step are checked on, and the step fails naming only those requests.
        grammar_errors: dict[str, str] = {}
        for req_id in dict.fromkeys([*news, *cached, *scheduled]):
            num_tokens = scheduled.get(req_id, 0)
            if req_id in news:
                try:
                    chunk = self._new_chunk(news[req_id], num_tokens)
                except GrammarError as exc:
                    grammar_errors[req_id] = f"GrammarError: {exc}"
                    continue
            elif req_id in self.requests:
                chunk = self._cached_chunk(req_id, cached.get(req_id), num_tokens)
            elif req_id in cached:
                raise StepError(
                    f"request {req_id}: sent as cached but this worker holds no state for it "
                    "(a request it has not seen must come in new_reqs, with all tokens and blocks)"
                )
            else:
                raise StepError(f"request {req_id}: scheduled but unknown to this worker")
            if req_id in scheduled and num_tokens < 1:
                raise StepError(f"request {req_id}: scheduled with {num_tokens} tokens")
            self._check_chunk(chunk)
            chunks.append(chunk)
        if grammar_errors:
            raise RequestsFailed(grammar_errors)
        return chunks

    def _new_chunk(self, req: NewRequestData, num_tokens: int) -> _Chunk:
        generator = None
        if req.sampling.seed is not None and not is_greedy(req.sampling.temperature):
            generator = torch.Generator(self.device)
        state = RequestState(
            [], req.num_prompt_tokens, [], req.num_computed_tokens, req.sampling, generator
        )
        state.grammar = self.structured.new_state(req.sampling.structured)
        return _Chunk(
            req.req_id,
            state,
            list(req.token_ids),
            list(req.block_ids),
            req.num_computed_tokens,
            num_tokens,
        )

    def _cached_chunk(self, req_id: str, req: CachedRequestData | None, num_tokens: int) -> _Chunk:
        state = self.requests[req_id]
        if req is None:  # scheduled without news: it continues where our own count says
            return _Chunk(req_id, state, [], [], state.num_computed_tokens, num_tokens)
        return _Chunk(
            req_id,
            state,
            list(req.new_token_ids),
            list(req.new_block_ids),
            req.num_computed_tokens,
            num_tokens,
        )

    def _check_chunk(self, c: _Chunk) -> None:
        num_known = len(c.state.token_ids) + len(c.new_token_ids)
        end = c.start + c.num_tokens
        if c.start < 0 or end > num_known:
            raise StepError(
                f"request {c.req_id}: cannot compute tokens {c.start}..{end - 1}: it has "
                f"{num_known} known tokens"
            )
        bad = _first_outside(c.new_token_ids, self.config.vocab_size)
        if bad is not None:
            raise StepError(
                f"request {c.req_id}: token id {bad} is outside the vocabulary "
                f"0..{self.config.vocab_size - 1}"
            )
        bad = _first_outside(c.new_block_ids, self.num_blocks)
        if bad is not None:
            raise StepError(
                f"request {c.req_id}: block id {bad} is outside the cache 0..{self.num_blocks - 1}"
            )
        num_blocks = len(c.state.block_ids) + len(c.new_block_ids)
        if num_blocks * self.block_size < end:
            raise StepError(
                f"request {c.req_id}: block table of {num_blocks} blocks holds "
                f"{num_blocks * self.block_size} tokens, the step writes position {end - 1}"
            )

    def _run(self, chunks: list[_Chunk]) -> StepOutput:
        input_ids, positions, plan = self._prepare(chunks)
        hidden = self.backend.execute(self._forward, input_ids, positions, plan)
        for c in chunks:
            c.state.num_computed_tokens = c.start + c.num_tokens
        prompt_logprobs = self._prompt_logprobs(chunks, hidden, plan.query_start_loc.tolist())
        # Only a chunk that reaches the end of its known tokens samples; a prefill chunk that
        # stops short has no next token to predict yet.
        rows = [i for i, c in enumerate(chunks) if c.start + c.num_tokens == len(c.state.token_ids)]
        if not rows:
            return StepOutput({}, None, len(input_ids), prompt_logprobs=prompt_logprobs)
        last = plan.query_start_loc[1:].long() - 1
        logits = self.model.compute_logits(hidden[last[rows]])
        sampling = [chunks[i] for i in rows]
        self.structured.apply(
            logits,
            [
                GrammarRow(c.state.grammar, c.state.token_ids, c.state.num_prompt_tokens)
                for c in sampling
            ],
        )
        requests = [self._sample_request(c.state) for c in sampling]
        try:
            tokens = sample(logits, requests, self._generator)
        except Exception as exc:
            culprits = self._culprits(logits, sampling, requests)
            if not culprits:
                raise
            raise RequestsFailed(culprits) from exc
        asking = [j for j, c in enumerate(sampling) if c.state.sampling.logprobs is not None]
        logprobs = gather_logprobs(
            logits[asking],
            [tokens[j] for j in asking],
            [sampling[j].state.sampling.logprobs or 0 for j in asking],
        )
        # The worker keeps what it sampled: the next step computes that token without waiting
        # for the ledger to send it back (which is what lets the ledger run a step ahead).
        for c, token in zip(sampling, tokens, strict=True):
            c.state.token_ids.append(token)
        sampled = {c.req_id: t for c, t in zip(sampling, tokens, strict=True)}
        by_req = {sampling[j].req_id: lp for j, lp in zip(asking, logprobs, strict=True)}
        return StepOutput(sampled, logits, len(input_ids), by_req, prompt_logprobs)

    def _culprits(
        self, logits: torch.Tensor, sampling: list[_Chunk], requests: list[SampleRequest]
    ) -> dict[str, str]:
        """Which rows fail when sampled alone (the step is lost anyway: the ledger re-runs it,
        so drawing from the generators here changes no result the client sees)."""
        errors = {}
        for j, (chunk, request) in enumerate(zip(sampling, requests, strict=True)):
            try:
                sample(logits[j : j + 1], [request], self._generator)
            except Exception as exc:
                errors[chunk.req_id] = f"{type(exc).__name__}: {exc}"
        return errors

    def _prompt_logprobs(
        self, chunks: list[_Chunk], hidden: torch.Tensor, query_start: list[int]
    ) -> dict[str, PromptLogprobs]:
        """Logprobs of the prompt tokens this step's chunks predict: the hidden state at position
        p scores prompt token p + 1. Only before the first output (a resumed request sent them
        already); the ledger keeps the prompt's positions uncached for such requests."""
        rows: list[int] = []
        targets: list[int] = []
        spans: list[tuple[_Chunk, int, int]] = []  # chunk, first prompt position, count
        for i, c in enumerate(chunks):
            state = c.state
            if state.sampling.prompt_logprobs is None or len(state.token_ids) > (
                state.num_prompt_tokens
            ):
                continue
            end = min(c.start + c.num_tokens, state.num_prompt_tokens - 1)
            if end <= c.start:
                continue
            rows += range(query_start[i], query_start[i] + end - c.start)
            targets += state.token_ids[c.start + 1 : end + 1]
            spans.append((c, c.start + 1, end - c.start))
        if not rows:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        num_top = [c.state.sampling.prompt_logprobs or 0 for c, _, n in spans for _ in range(n)]
        entries = gather_logprobs(logits, targets, num_top)
        out, offset = {}, 0
        for c, start, n in spans:
            out[c.req_id] = PromptLogprobs(start=start, positions=entries[offset : offset + n])
            offset += n
        return out

    def _prepare(self, chunks: list[_Chunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionPlan]:
        """Flattened input ids and positions, and the step's attention plan."""
        bs = self.block_size
        ids, pos, slots, lens = [], [], [], []
        max_blocks = max(cdiv(c.start + c.num_tokens, bs) for c in chunks)
        tables = np.zeros((len(chunks), max_blocks), dtype=np.int32)
        for i, c in enumerate(chunks):
            end = c.start + c.num_tokens
            table = np.asarray(c.state.block_ids[: cdiv(end, bs)], dtype=np.int64)
            tables[i, : len(table)] = table
            p = np.arange(c.start, end, dtype=np.int64)
            ids.append(np.asarray(c.state.token_ids[c.start : end], dtype=np.int64))
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            lens.append(end)
        query_lens = [c.num_tokens for c in chunks]
        qsl = np.zeros(len(chunks) + 1, dtype=np.int32)
        qsl[1:] = np.cumsum(query_lens)
        dev = self.device
        plan = self.backend.plan(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.from_numpy(qsl).to(dev),
            max_query_len=max(query_lens),
            max_seq_len=max(lens),
        )
        input_ids = torch.from_numpy(np.concatenate(ids)).to(dev)
        return input_ids, torch.from_numpy(np.concatenate(pos)).to(dev), plan

    def _sample_request(self, state: RequestState) -> SampleRequest:
        params = state.sampling
        if state.generator is not None and params.seed is not None:
            # Index-keyed reseeding: the same draw after a preemption (see position_seed).
            state.generator.manual_seed(position_seed(params.seed, len(state.token_ids)))
        banned: list[int] = []
        if len(state.token_ids) - state.num_prompt_tokens < params.min_tokens:
            stops = (params.eos_token_id, *(params.stop_token_ids or ()))
            banned = [t for t in stops if t is not None and 0 <= t < self.config.vocab_size]
        prompt = state.token_ids[: state.num_prompt_tokens]
        output = state.token_ids[state.num_prompt_tokens :]
        return SampleRequest(params, state.generator, banned, prompt, output)


def attention_spec(model: LlamaForCausalLM, block_size: int) -> AttentionSpec:
    """What the attention backend must cover for this model, dtype and device."""
    cfg = model.config
    param = next(model.parameters())
    return AttentionSpec(
        device=param.device,
        dtype=param.dtype,
        num_heads=model.num_local_heads,
        num_kv_heads=model.num_local_kv_heads,
        head_dim=cfg.head_dim,
        block_size=block_size,
    )


def _first_outside(ids: list[int], limit: int) -> int | None:
    """The first id not in 0..limit-1 (one min/max pass in the common case that all are)."""
    if not ids or (min(ids) >= 0 and max(ids) < limit):
        return None
    return next(i for i in ids if not 0 <= i < limit)
