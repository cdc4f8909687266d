"""Many replicas in one process: the real ledger core of each, a step-time model, one router.

Each replica is a real `KVCacheManager` + `Scheduler` (vLLM 0.33's rules, prefix caching, KV
events). Time is simulated: a step lasts `StepModel.duration` of what it computed. The router
sees each replica's load as its ledger publishes it (running, waiting, KV usage): current at the
moment of routing by default, or, with `status_interval_s`, as last published at the end of a
step at least that long after the previous one (the real ledger writes its status once a
second, so a gateway's figures are up to ~1.25 s old). `precise` sees the KV events each replica
emitted up to the end of its last step, applied to a `ReplicaPrefixIndex` exactly as the
gateway's subscriber applies them. Every router is told when a request finishes (`release`), as
the gateway is. The `oracle` reads every ledger's prefix cache itself instead of the events (and,
as precise, counts what it sent and is not finished: a cache holds only what was computed). A
router restart replaces the router mid-run: `precise` comes back from each ledger's snapshot
(what the subscriber's checkpoint and stream id give it), `approx` with an empty LRU.
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from ledger.block import BlockHash
from ledger.block_pool import BlockPool
from ledger.events import KVEventBatch
from ledger.hashing import BlockHasher, to_event_hash
from ledger.kv_cache_manager import KVCacheManager
from ledger.request import Request
from ledger.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from services.routing.policy import (
    ReplicaLoad,
    ReplicaPrefixIndex,
    Router,
    RouteRequest,
    RoutingWeights,
    SentPrefixLRU,
)
from tests.harness.routing_workload import Turn

SIM_POLICIES = ("round_robin", "least_loaded", "approx", "precise", "oracle")


@dataclass(frozen=True, slots=True)
class StepModel:
    """Seconds per step. Defaults: a Llama-3-8B-class model on one H100-class GPU, about 20k
    prefill tokens/s, a decode step of 8 ms plus 0.1 ms per sequence (documented, not measured
    here; pass your own with --prefill-token-ms and friends)."""

    base_s: float = 0.008
    prefill_token_s: float = 0.00005
    decode_seq_s: float = 0.0001

    def duration(self, prefill_tokens: int, decode_seqs: int) -> float:
        return self.base_s + prefill_tokens * self.prefill_token_s + decode_seqs * self.decode_seq_s


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    num_blocks: int = 1600  # 25,600 tokens of KV cache: a slice of the whole working set
    block_size: int = 16
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


@dataclass(frozen=True, slots=True)
class StepSpan:
    """One step of one replica: when it ran and how many output tokens it returned."""

    replica: str
    start_s: float
    end_s: float
    output_tokens: int


@dataclass(frozen=True, slots=True)
class SaturatedWindow:
    start_s: float
    end_s: float
    output_tokens: float  # prorated: a step straddling an edge counts for its share inside

    @property
    def length_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def throughput_tok_s(self) -> float:
        return self.output_tokens / self.length_s if self.length_s > 0 else 0.0


def saturated_window(replicas: Sequence[str], steps: Sequence[StepSpan]) -> SaturatedWindow | None:
    """The longest stretch in which every replica had a step running, and the output tokens
    produced in it: the trace's capacity figure, free of its head and its tail.

    Throughput over the makespan counts the ramp-up (replicas waiting for their first requests)
    and the tail (the last conversations' turns, one after another with think times between,
    while most replicas sit idle): a bound of the trace, not of the replicas. A replica is busy
    from the start of a step to its end; a replica with unfinished requests steps back to back,
    so its busy time is the union of its steps and it is idle exactly when it has no request. The
    window opens when the last replica becomes busy and closes as soon as any replica goes idle
    (it ran out of work while others still had theirs: from then on the routing's balance and the
    trace's tail, not capacity, decide); of several such stretches the longest counts. Busy is
    not full: a replica stepping one sequence is busy, so the figure is a capacity only where the
    arrival rate keeps requests waiting at every replica through the window (see TTFT).
    A step's output tokens come back at its end; spread evenly over the step, the part of a step
    inside the window counts for its share, so the figure does not jump with where an edge cuts.
    None if the replicas were never all busy at once."""
    busy: dict[str, list[list[float]]] = {name: [] for name in replicas}
    for step in sorted(steps, key=lambda s: (s.replica, s.start_s)):
        spans = busy[step.replica]
        if spans and step.start_s <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], step.end_s)
        else:
            spans.append([step.start_s, step.end_s])
    # Sweep: at equal times an end comes before a start, so a hand-over is not a window.
    edges = sorted(
        (t, delta) for spans in busy.values() for a, b in spans for t, delta in ((a, 1), (b, -1))
    )
    stretches: list[tuple[float, float]] = []
    count, opened = 0, 0.0
    for at, delta in edges:
        count += delta
        if delta == 1 and count == len(busy):
            opened = at
        elif delta == -1 and count == len(busy) - 1 and at > opened:
            stretches.append((opened, at))
    if not stretches:
        return None
    start, end = max(stretches, key=lambda s: s[1] - s[0])
    tokens = 0.0
    for step in steps:
        inside = min(step.end_s, end) - max(step.start_s, start)
        if step.output_tokens and inside > 0:
            tokens += step.output_tokens * inside / (step.end_s - step.start_s)
    return SaturatedWindow(start, end, tokens)


@dataclass(slots=True)
class SimResult:
    policy: str
    replicas: int
    requests: int
    prompt_tokens: int
    prefill_tokens: int
    hit_tokens: int
    output_tokens: int
    makespan_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    preemptions: int
    saturated: SaturatedWindow | None = None
    restart_window_hit_rate: float | None = None
    restart_window: list[str] = field(default_factory=list, repr=False)
    hit_by_request: dict[str, float] = field(default_factory=dict, repr=False)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(self.prompt_tokens, 1)

    @property
    def throughput_tok_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s else 0.0

    @property
    def saturated_tok_s(self) -> float:
        return self.saturated.throughput_tok_s if self.saturated else 0.0

    def row(self) -> dict[str, object]:
        window = self.saturated
        return {
            "policy": self.policy,
            "replicas": self.replicas,
            "requests": self.requests,
            "prefill_tokens": self.prefill_tokens,
            "hit_rate": round(self.hit_rate, 4),
            "ttft_p50_s": round(self.ttft_p50_s, 4),
            "ttft_p99_s": round(self.ttft_p99_s, 4),
            "throughput_tok_s": round(self.throughput_tok_s, 1),
            "makespan_s": round(self.makespan_s, 2),
            "saturated_from_s": round(window.start_s, 2) if window else None,
            "saturated_s": round(window.length_s, 2) if window else 0.0,
            "saturated_tok_s": round(self.saturated_tok_s, 1),
            "preemptions": self.preemptions,
            "restart_window_hit_rate": self.restart_window_hit_rate,
        }


class Replica:
    def __init__(self, name: str, config: ReplicaConfig) -> None:
        self.name = name
        self.manager = KVCacheManager(
            config.num_blocks, config.block_size, config.max_model_len, enable_kv_cache_events=True
        )
        self.scheduler: Scheduler[Turn] = Scheduler(
            SchedulerConfig(
                max_model_len=config.max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
            ),
            self.manager,
        )
        self.busy = False

    def load(self) -> ReplicaLoad:
        s = self.scheduler
        return ReplicaLoad(s.num_running, s.num_waiting, self.manager.usage)

    def snapshot(self) -> dict[int, int]:
        """What the ledger writes as its events snapshot: event hash -> physical blocks."""
        return _snapshot_counts(self.manager.block_pool)


def _snapshot_counts(pool: BlockPool) -> dict[int, int]:
    counts: dict[int, int] = {}
    for block in pool.blocks:
        if block.block_hash is not None:
            key = to_event_hash(block.block_hash)
            counts[key] = counts.get(key, 0) + 1
    return counts


class HashedWorkload:
    """Each turn's block hashes, computed once per trace (every policy routes the same prompts)."""

    def __init__(self, turns: Sequence[Turn], hasher: BlockHasher, block_size: int) -> None:
        self.turns = list(turns)
        self.hasher = hasher
        self.block_size = block_size
        self.full: list[list[BlockHash]] = []
        self.routable: list[list[int]] = []
        for turn in self.turns:
            hashes = hasher.hash_blocks(turn.prompt_token_ids, block_size)
            self.full.append(hashes)
            limit = (len(turn.prompt_token_ids) - 1) // block_size
            self.routable.append([to_event_hash(h) for h in hashes[:limit]])


class RoutingSimulation:
    def __init__(
        self,
        workload: HashedWorkload,
        policy: str,
        num_replicas: int,
        *,
        replica: ReplicaConfig = ReplicaConfig(),
        steps: StepModel = StepModel(),
        weights: RoutingWeights | None = None,
        restart_at: int | None = None,
        restart_window: int = 200,
        status_interval_s: float = 0.0,
    ) -> None:
        if policy not in SIM_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SIM_POLICIES)}, got {policy!r}")
        self.workload = workload
        self.policy = policy
        self.config = replica
        self.steps = steps
        self.weights = weights
        self.replicas = {f"r{i}": Replica(f"r{i}", replica) for i in range(num_replicas)}
        self.index = ReplicaPrefixIndex()
        self._oracle_hashes: list[BlockHash] = []
        self.router = self._new_router()
        self.restart_at = restart_at
        self.restart_window = restart_window
        self._routed = 0
        self._window: set[str] = set()
        self.status_interval_s = status_interval_s
        self._published: dict[str, ReplicaLoad] = {}
        self._now = 0.0

    def _new_router(self) -> Router:
        names = list(self.replicas)
        if self.policy == "precise":
            return Router(
                "precise", names, weights=self.weights, prefix_source=self.index.cached_blocks
            )
        if self.policy == "oracle":
            return Router("oracle", names, weights=self.weights, prefix_source=self._oracle_blocks)
        if self.policy == "approx":
            return Router("approx", names, weights=self.weights, lru=SentPrefixLRU())
        return Router(self.policy, names, weights=self.weights)

    def _oracle_blocks(self, replica: str, _event_hashes: Sequence[int]) -> int:
        get = self.replicas[replica].manager.block_pool.cached_block_hash_to_block.get_one_block
        for count, block_hash in enumerate(self._oracle_hashes):
            if get(block_hash) is None:
                return count
        return len(self._oracle_hashes)

    def _restart_router(self) -> None:
        if self.policy == "precise":
            # The subscriber resumes from its checkpoint + stream id, or the ledgers' snapshots.
            self.index = ReplicaPrefixIndex()
            for name, replica in self.replicas.items():
                self.index.load_snapshot(name, replica.snapshot())
        self.router = self._new_router()

    def run(self) -> SimResult:
        turns = self.workload.turns
        queue: list[tuple[float, int, str, int | str]] = []
        seq = 0

        def push(at: float, kind: str, what: int | str) -> None:
            nonlocal seq
            seq += 1
            heapq.heappush(queue, (at, seq, kind, what))

        for i, turn in enumerate(turns):
            if turn.previous is None:
                push(turn.arrival_s, "arrive", i)
        follow_up = {t.previous: i for i, t in enumerate(turns) if t.previous is not None}
        index_of = {t.request_id: i for i, t in enumerate(turns)}
        arrival: dict[str, float] = {}
        ttft: dict[str, float] = {}
        hits: dict[str, int] = {}
        pending: dict[str, SchedulerOutput[Turn]] = {}
        started: dict[str, float] = {}
        spans: list[StepSpan] = []
        prefill_tokens = output_tokens = 0
        first, last = turns[0].arrival_s, 0.0
        while queue:
            now, _, kind, what = heapq.heappop(queue)
            self._now = now
            if kind == "arrive":
                i = int(what)
                turn = turns[i]
                arrival[turn.request_id] = now
                replica = self.replicas[self._route(i)]
                request: Request[Turn] = Request(
                    turn.request_id,
                    turn.prompt_token_ids,
                    turn.max_tokens,
                    block_size=self.config.block_size,
                    payload=turn,
                )
                # The ledger would hash the prompt itself: same hasher, same hashes.
                request.block_hasher = self.workload.hasher
                request.block_hashes = list(self.workload.full[i])
                replica.scheduler.add_request(request)
                if not replica.busy:
                    push(now, "step", replica.name)
                    replica.busy = True
            elif kind == "step":
                replica = self.replicas[str(what)]
                out = replica.scheduler.schedule()
                prefill = decode = 0
                for request_id, n in out.num_scheduled_tokens.items():
                    request = replica.scheduler.requests[request_id]
                    before = request.num_computed_tokens - n
                    if n == 1 and request.num_output_tokens and before == request.num_tokens - 1:
                        decode += 1
                    else:
                        prefill += n
                for admission in out.admissions:
                    if not admission.resumed:
                        hits[admission.request_id] = admission.num_hit_tokens
                prefill_tokens += prefill
                done_at = now + self.steps.duration(prefill, decode)
                pending[replica.name] = out
                started[replica.name] = now
                push(done_at, "done", replica.name)
            else:  # a step finished: tokens back, events out
                replica = self.replicas[str(what)]
                out = pending.pop(replica.name)
                sampled = {}
                for request_id in out.sampling_req_ids:
                    request = replica.scheduler.requests[request_id]
                    ttft.setdefault(request_id, now - arrival[request_id])
                    sampled[request_id] = request.payload.output_token_ids[
                        request.num_output_tokens
                    ]
                returned = 0
                for update in replica.scheduler.update_from_output(out, sampled):
                    returned += len(update.new_token_ids)
                    if update.finished:
                        last = now
                        self.router.release(update.request.request_id)
                        nxt = follow_up.get(index_of[update.request.request_id])
                        if nxt is not None:
                            push(now + turns[nxt].think_s, "arrive", nxt)
                output_tokens += returned
                spans.append(StepSpan(replica.name, started.pop(replica.name), now, returned))
                self._publish(replica, now)
                events = replica.manager.take_events()
                if events and self.policy == "precise":
                    self.index.apply(replica.name, KVEventBatch(now, events))
                if replica.scheduler.has_unfinished_requests():
                    push(now, "step", replica.name)
                else:
                    replica.busy = False
        result = self._result(turns, ttft, hits, prefill_tokens, output_tokens, last - first)
        result.saturated = saturated_window(list(self.replicas), spans)
        if result.saturated is not None:  # on the trace's clock, as the makespan
            window = result.saturated
            result.saturated = SaturatedWindow(
                window.start_s - first, window.end_s - first, window.output_tokens
            )
        return result

    def _route(self, i: int) -> str:
        if self.restart_at is not None and self._routed == self.restart_at:
            self._restart_router()
        if (
            self.restart_at is not None
            and 0 <= self._routed - self.restart_at < self.restart_window
        ):
            self._window.add(self.workload.turns[i].request_id)
        self._routed += 1
        turn = self.workload.turns[i]
        routable = self.workload.routable[i]
        self._oracle_hashes = self.workload.full[i][: len(routable)]
        if self.status_interval_s > 0:
            for replica in self.replicas.values():
                if not replica.busy:  # an idle ledger's status loop still ticks
                    self._publish(replica, self._now)
            loads = {
                name: self._published.get(name, ReplicaLoad(as_of=0.0)) for name in self.replicas
            }
        else:
            loads = {name: r.load() for name, r in self.replicas.items()}
        request = RouteRequest(len(turn.prompt_token_ids), routable, self.config.block_size)
        return self.router.route(request, loads, request_id=turn.request_id, now=self._now).replica

    def _publish(self, replica: Replica, now: float) -> None:
        """The ledger's status write: its load as of now, once per interval."""
        if self.status_interval_s <= 0:
            return
        last = self._published.get(replica.name)
        if last is None or last.as_of is None or now - last.as_of >= self.status_interval_s:
            load = replica.load()
            load.as_of = now
            self._published[replica.name] = load

    def _result(
        self,
        turns: Sequence[Turn],
        ttft: dict[str, float],
        hits: dict[str, int],
        prefill_tokens: int,
        output_tokens: int,
        makespan: float,
    ) -> SimResult:
        prompt_len = {t.request_id: len(t.prompt_token_ids) for t in turns}
        ttfts = sorted(ttft.values())
        window = None
        if self._window:
            window = sum(hits[r] for r in self._window) / sum(prompt_len[r] for r in self._window)
        return SimResult(
            policy=self.policy,
            replicas=len(self.replicas),
            requests=len(turns),
            prompt_tokens=sum(prompt_len.values()),
            prefill_tokens=prefill_tokens,
            hit_tokens=sum(hits.values()),
            output_tokens=output_tokens,
            makespan_s=makespan,
            ttft_p50_s=statistics.median(ttfts),
            ttft_p99_s=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            preemptions=sum(r.scheduler.num_preemptions for r in self.replicas.values()),
            restart_window_hit_rate=window,
            restart_window=sorted(self._window),
            hit_by_request={r: hits[r] / prompt_len[r] for r in hits},
        )
