"""Many replicas in one process: the real ledger core of each, a step-time model, the routers.

Each replica is a real `KVCacheManager` + `Scheduler` (vLLM 0.33's rules, prefix caching, KV
events). Time is simulated: a step lasts `StepModel.duration` of what it computed. Each replica
measures its own step costs from those durations and its requests' queue waits, with the
ledger's own estimator (`ledger.step_costs`), and the router sees them as its ledger publishes
them in its status (with its load, its queued prefill and its eviction head): current at the
moment of routing by default, or, with `status_interval_s`, as last published at the end of a
step at least that long after the previous one (the real ledger writes its status once a
second, so a gateway's figures are up to ~1.25 s old). `precise` sees the KV events each replica
emitted up to its last step's dispatch (the ledger publishes them while the workers compute)
and end, applied to a `ReplicaPrefixIndex` exactly as the gateway's subscriber applies them. Every router is told when a request finishes (`release`), as
the gateway is. The `oracle` reads every ledger's prefix cache itself instead of the events (and,
as precise, counts what it sent and is not finished: a cache holds only what was computed). A
router restart replaces the router mid-run: `precise` comes back from each ledger's snapshot
(what the subscriber's checkpoint and stream id give it), `approx` with an empty LRU.

Arrivals are open loop (each conversation's first turn at its time, a follow-up a think time
after its previous turn) or, with `concurrency`, closed loop: that many requests in flight, the
next in order sent as one ends (the public trace's replay). With `gateways` > 1 the requests go
to the gateways in turn, each its own router; with `share_pending` (the default) what each sent
and is not finished reaches the others `share_delay_s` later, as through Redis
(`services.routing.shared`). Every admission is checked against what the router expected the
replica to hold (`shortfall_*`: the ledger's kvledger:routed_hit_shortfall_* counters).
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ledger.block import BlockHash
from ledger.block_pool import BlockPool
from ledger.events import KVEventBatch
from ledger.hashing import BlockHasher, to_event_hash
from ledger.kv_cache_manager import KVCacheManager
from ledger.request import Request
from ledger.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from ledger.step_costs import EVICTION_INTERVAL_S, StepCostEstimator, eviction_horizon
from services.routing.costs import CostModel, EvictionView
from services.routing.policy import (
    PendingRequests,
    ReplicaLoad,
    ReplicaPrefixIndex,
    Router,
    RouteRequest,
    make_scorer,
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
    routed_hit_blocks: int = 0  # blocks the routers expected the chosen replicas to hold
    shortfall_requests: int = 0  # admitted with fewer cached tokens than expected
    shortfall_blocks: int = 0  # expected and not found, in blocks
    evicted_blocks: int = 0  # cached blocks the routers set aside as about to be evicted

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(self.prompt_tokens, 1)

    @property
    def shortfall_share(self) -> float:
        return self.shortfall_blocks / max(self.routed_hit_blocks, 1)

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
            "shortfall_pct": round(100 * self.shortfall_share, 3),
        }


class Replica:
    def __init__(self, name: str, config: ReplicaConfig) -> None:
        self.name = name
        self.config = config
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
        self.costs = StepCostEstimator()  # the ledger's own, fed by the simulated steps
        self.expected_hits: dict[str, int] = {}  # request -> tokens its router expected here
        self.version = 0  # bumped whenever the free queue may have changed
        self._eviction: tuple[int, int, EvictionView] | None = None

    def queued_prefill_tokens(self) -> int:
        expected = self.expected_hits
        return self.scheduler.queued_prefill_tokens(lambda r: expected.get(r.request_id, 0))

    def load(self) -> ReplicaLoad:
        """What the ledger's status says (engine.Engine.status): the same figures, current."""
        s = self.scheduler
        queued = self.queued_prefill_tokens()
        return ReplicaLoad(
            s.num_running, s.num_waiting, self.manager.usage, None, self.costs.estimate(),
            queued, self.eviction(queued),
        )  # fmt: skip

    def eviction(self, queued_prefill_tokens: int, as_of: float | None = None) -> EvictionView:
        """What the ledger's eviction key says (engine.Engine.eviction_head)."""
        horizon = eviction_horizon(
            queued_prefill_tokens, self.config.max_num_batched_tokens, self.config.block_size
        )
        cached = self._eviction
        if cached is None or cached[0] != self.version or cached[1] < horizon:
            positions, hashes, walked = self.manager.block_pool.eviction_head(horizon)
            cached = (self.version, horizon, EvictionView.of(positions, hashes, walked))
            self._eviction = cached
        view = cached[2]
        return EvictionView(view.positions, view.horizon, as_of, queued_prefill_tokens)

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

    @property
    def distinct_blocks(self) -> int:
        """The working set: every distinct full block of every prompt."""
        return len({h for hashes in self.full for h in hashes})


class RoutingSimulation:
    def __init__(
        self,
        workload: HashedWorkload,
        policy: str,
        num_replicas: int,
        *,
        replica: ReplicaConfig = ReplicaConfig(),
        steps: StepModel = StepModel(),
        costs: CostModel | None = None,
        restart_at: int | None = None,
        restart_window: int = 200,
        status_interval_s: float = 0.0,
        eviction_interval_s: float | None = None,
        concurrency: int | None = None,
        gateways: int = 1,
        share_pending: bool = True,
        share_delay_s: float = 0.001,
        eviction_aware: bool = True,
    ) -> None:
        if policy not in SIM_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SIM_POLICIES)}, got {policy!r}")
        self.workload = workload
        self.policy = policy
        self.config = replica
        self.steps = steps
        self.costs = costs
        self.replicas = {f"r{i}": Replica(f"r{i}", replica) for i in range(num_replicas)}
        self.index = ReplicaPrefixIndex()
        self._oracle_hashes: list[BlockHash] = []
        self.concurrency = concurrency
        self.num_gateways = gateways
        self.share_pending = share_pending and gateways > 1
        self.share_delay_s = share_delay_s
        self.eviction_aware = eviction_aware
        self.routers = [self._new_router(g) for g in range(gateways)]
        self.restart_at = restart_at
        self.restart_window = restart_window
        self._routed = 0
        self._window: set[str] = set()
        self.status_interval_s = status_interval_s
        # The ledger writes its eviction head more often than its status (EVICTION_INTERVAL_S).
        self.eviction_interval_s = (
            min(status_interval_s, EVICTION_INTERVAL_S)
            if eviction_interval_s is None
            else eviction_interval_s
        )
        self._published: dict[str, ReplicaLoad] = {}
        self._published_eviction: dict[str, EvictionView] = {}
        self._now = 0.0
        self._gateway_of: dict[str, int] = {}
        self._expected: dict[str, int] = {}  # request -> cached tokens its router expected
        self._evicted_blocks = 0
        self._shared: list[tuple[float, int, str, tuple]] = []  # (at, gateway, op, args)

    @property
    def router(self) -> Router:
        return self.routers[0]

    def _new_router(self, gateway: int = 0) -> Router:
        names = list(self.replicas)
        source = self.index.cached_blocks if self.policy == "precise" else self._oracle_blocks
        scorer = make_scorer(self.policy, source)
        return Router(
            scorer, names, costs=self.costs, pending=PendingRequests(),
            eviction_aware=self.eviction_aware,
            rotation=gateway * len(names) // self.num_gateways,
        )  # fmt: skip

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
        self.routers = [self._new_router(g) for g in range(self.num_gateways)]

    def run(self) -> SimResult:
        turns = self.workload.turns
        queue: list[tuple[float, int, str, int | str]] = []
        seq = 0

        def push(at: float, kind: str, what: int | str) -> None:
            nonlocal seq
            seq += 1
            heapq.heappush(queue, (at, seq, kind, what))

        next_turn = 0
        if self.concurrency is None:
            for i, turn in enumerate(turns):
                if turn.previous is None:
                    push(turn.arrival_s, "arrive", i)
        else:  # closed loop: the first `concurrency` now, then one as each ends
            next_turn = min(self.concurrency, len(turns))
            for i in range(next_turn):
                push(turns[0].arrival_s, "arrive", i)
        follow_up = {t.previous: i for i, t in enumerate(turns) if t.previous is not None}
        index_of = {t.request_id: i for i, t in enumerate(turns)}
        arrival: dict[str, float] = {}
        ttft: dict[str, float] = {}
        hits: dict[str, int] = {}
        pending: dict[str, SchedulerOutput[Turn]] = {}
        started: dict[str, float] = {}
        spans: list[StepSpan] = []
        prefill_tokens = output_tokens = 0
        routed_hit_blocks = shortfall_requests = shortfall_blocks = 0
        block_size = self.config.block_size
        first, last = turns[0].arrival_s, 0.0
        while queue:
            now, _, kind, what = heapq.heappop(queue)
            self._now = now
            if kind == "arrive":
                i = int(what)
                turn = turns[i]
                arrival[turn.request_id] = now
                replica = self.replicas[self._route(i)]
                expected = self._expected[turn.request_id]
                replica.expected_hits[turn.request_id] = expected
                routed_hit_blocks += expected // block_size
                request: Request[Turn] = Request(
                    turn.request_id,
                    turn.prompt_token_ids,
                    turn.max_tokens,
                    block_size=block_size,
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
                replica.version += 1
                # The ledger publishes a step's KV events as it dispatches the step, while the
                # workers compute it (engine.Engine._while_workers_compute).
                self._publish_events(replica, now)
                prefill = decode = 0
                for request_id, n in out.num_scheduled_tokens.items():
                    request = replica.scheduler.requests[request_id]
                    before = request.num_computed_tokens - n
                    if n == 1 and request.num_output_tokens and before == request.num_tokens - 1:
                        decode += 1
                    else:
                        prefill += n
                for admission in out.admissions:
                    if admission.resumed:
                        continue
                    rid = admission.request_id
                    hits[rid] = admission.num_hit_tokens
                    replica.costs.observe_queue_wait(now - arrival[rid])
                    expected = replica.expected_hits.pop(rid, 0)
                    if admission.num_hit_tokens < expected:
                        shortfall_requests += 1
                        shortfall_blocks += (expected - admission.num_hit_tokens) // block_size
                prefill_tokens += prefill
                duration = self.steps.duration(prefill, decode)
                replica.costs.observe_step(prefill, decode, duration)
                pending[replica.name] = out
                started[replica.name] = now
                push(now + duration, "done", replica.name)
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
                        self._release(update.request.request_id)
                        nxt = follow_up.get(index_of[update.request.request_id])
                        if nxt is not None:
                            push(now + turns[nxt].think_s, "arrive", nxt)
                        if self.concurrency is not None and next_turn < len(turns):
                            push(now, "arrive", next_turn)
                            next_turn += 1
                replica.version += 1
                output_tokens += returned
                spans.append(StepSpan(replica.name, started.pop(replica.name), now, returned))
                self._publish(replica, now)
                self._publish_events(replica, now)
                if replica.scheduler.has_unfinished_requests():
                    push(now, "step", replica.name)
                else:
                    replica.busy = False
        result = self._result(turns, ttft, hits, prefill_tokens, output_tokens, last - first)
        result.routed_hit_blocks = routed_hit_blocks
        result.shortfall_requests = shortfall_requests
        result.shortfall_blocks = shortfall_blocks
        result.evicted_blocks = self._evicted_blocks
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
        gateway = self._routed % self.num_gateways
        self._routed += 1
        self._sync(gateway)
        turn = self.workload.turns[i]
        routable = self.workload.routable[i]
        self._oracle_hashes = self.workload.full[i][: len(routable)]
        if self.status_interval_s > 0:
            for replica in self.replicas.values():
                if not replica.busy:  # an idle ledger's status loop still ticks
                    self._publish(replica, self._now)
            loads = {}
            for name in self.replicas:
                load = self._published.get(name, ReplicaLoad(as_of=0.0))
                head = self._published_eviction.get(name)
                loads[name] = replace(load, eviction=head) if head is not None else load
        else:
            loads = {name: r.load() for name, r in self.replicas.items()}
        request = RouteRequest(len(turn.prompt_token_ids), routable, self.config.block_size)
        router = self.routers[gateway]
        decision = router.route(request, loads, request_id=turn.request_id, now=self._now)
        chosen = decision.score_of(decision.replica)
        self._expected[turn.request_id] = chosen.cached_tokens
        self._evicted_blocks += chosen.evicted_blocks
        self._gateway_of[turn.request_id] = gateway
        if self.share_pending:
            entry = router.pending.get(turn.request_id)
            assert entry is not None
            args = (turn.request_id, entry.replica, entry.block_hashes, entry.sent_at,
                    entry.prefill_tokens)  # fmt: skip
            self._share(gateway, "add", args)
        return decision.replica

    def _release(self, request_id: str) -> None:
        gateway = self._gateway_of.pop(request_id, 0)
        self.routers[gateway].release(request_id)
        if self.share_pending:
            self._share(gateway, "release", (request_id,))

    def _share(self, sender: int, op: str, args: tuple) -> None:
        """What one gateway wrote reaches the others `share_delay_s` later."""
        at = self._now + self.share_delay_s
        for gateway in range(self.num_gateways):
            if gateway != sender:
                self._shared.append((at, gateway, op, args))

    def _sync(self, gateway: int) -> None:
        """Apply what the gateway has read of the others' writes by now."""
        if not self._shared:
            return
        keep = []
        for item in self._shared:
            at, target, op, args = item
            if target != gateway or at > self._now:
                keep.append(item)
                continue
            pending = self.routers[gateway].pending
            if op == "add":
                rid, replica, hashes, sent_at, prefill = args
                pending.add(rid, replica, hashes, sent_at, prefill, owner="other")
            else:
                pending.release(args[0])
        self._shared = keep

    def _publish_events(self, replica: Replica, now: float) -> None:
        events = replica.manager.take_events()
        if events and self.policy == "precise":
            self.index.apply(replica.name, KVEventBatch(now, events))

    def _publish(self, replica: Replica, now: float) -> None:
        """The ledger's status write: its load as of now, once per interval; its eviction
        head, once per (shorter) interval."""
        if self.status_interval_s <= 0:
            return
        last = self._published.get(replica.name)
        if last is None or last.as_of is None or now - last.as_of >= self.status_interval_s:
            load = replica.load()
            load.as_of = now
            self._published[replica.name] = load
        head = self._published_eviction.get(replica.name)
        if head is None or head.as_of is None or now - head.as_of >= self.eviction_interval_s:
            self._published_eviction[replica.name] = replica.eviction(
                replica.queued_prefill_tokens(), as_of=now
            )

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
