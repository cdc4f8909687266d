"""Cache-aware routing across replicas: which replica should serve this prompt.

A replica is one ledger and its workers. A `Router` holds one policy (a `Scorer`) and one cost
model (`services.routing.costs`): for every replica it asks the scorer how many of the request's
leading blocks it expects there, adds what the router itself sent there and is not finished
(`PendingRequests`), keeps only the blocks that will survive until the request is admitted (the
replica's eviction head), prices the replica (the wait there plus the prefill of what it lacks,
in seconds measured by the replicas by default) and lets the scorer pick (the cheapest; ties go
round robin, so equal replicas share).

The policies, one `Scorer` each (`POLICIES`):

- `round_robin`: the next replica in turn, whatever it holds or does;
- `least_loaded`: the cheapest by load alone (every replica must prefill the whole prompt);
- `approx`: a router-local LRU of the blocks it sent where (llm-d's approximate scorer; it learns
  nothing about evictions and starts empty after a restart);
- `precise`: a `ReplicaPrefixIndex` fed by each replica's KV events (llm-d's precise prefix-cache
  scorer, Dynamo's KV router), less what the replica's eviction head says goes first;
- `oracle` (simulation only): each ledger's true prefix cache.

The prompt's blocks are hashed once, exactly as the ledger will (`routable_block_hashes`), and
only the blocks the ledger could hit count: never the last token.

Tiers: past the GPU prefix a replica can load blocks instead of computing them, from its CPU
tier (the blocks its KV events of medium "CPU" announce) or from a shared tier (one every
replica of the same namespace loads from: a `SharedTier` the router is given, keyed by the
namespace each replica's status names). The walk follows the prompt's blocks in order: the GPU
prefix, then each next block found in the CPU tier or else the shared tier, to the first found
nowhere (vLLM's connector lookup: consecutive hits from the end of the GPU's). The cost model
prices the loads beside the prefill of what is left (`CostModel.tier_cost`).

Between two looks at a replica the router counts what was sent there (`PendingRequests`, as
Dynamo's KV router counts its active requests and blocks; shared by every gateway through Redis,
`services.routing.shared`): a request not yet finished holds its blocks there (being prefilled,
or in use), so `precise` and the oracle count them as cached until the events can tell; and one
sent after the load the replica last published is not in that load yet, so every cost adds it.
Without either, a burst sharing one new prompt arrives before any event or status shows the
first copy, and spreads out.

A replica whose events fall behind or whose status is old is STALE: its events index may be
wrong, so only what was sent there counts as cached (precise's pending blocks, approx's LRU),
else load alone. One silent for longer is OUT: never chosen until it speaks again.
"""

from __future__ import annotations

import enum
import itertools
from abc import ABC
from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from ledger.events import KVEventBatch
from ledger.hashing import BlockHasher, to_event_hash
from services.events.subscriber import PrefixIndex
from services.routing.costs import (
    CostModel,
    EvictionView,
    MeasuredCosts,
    ReplicaLoad,
    RoutingWeights,
    SentSince,
)
from services.wire.messages import TIER_CPU, TIER_SHARED

__all__ = [
    "POLICIES",
    "Approx",
    "CostModel",
    "EvictionView",
    "HealthLimits",
    "LeastLoaded",
    "MeasuredCosts",
    "NoReplicaError",
    "Oracle",
    "PendingRequests",
    "Precise",
    "ReplicaHealth",
    "ReplicaLoad",
    "ReplicaPrefixIndex",
    "ReplicaScore",
    "RoundRobin",
    "RouteDecision",
    "RouteRequest",
    "Router",
    "RoutingWeights",
    "Scorer",
    "SentPrefixLRU",
    "SharedTier",
    "TierBlocks",
    "make_scorer",
    "routable_block_hashes",
    "walk_tiers",
]


class NoReplicaError(RuntimeError):
    """Every replica is out: nothing can serve the request now."""


class ReplicaHealth(enum.Enum):
    LIVE = "live"
    STALE = "stale"  # its events index is not trusted
    OUT = "out"  # never chosen


@dataclass(slots=True)
class HealthLimits:
    """Seconds behind (events) or silent (status) after which a replica is STALE, then OUT."""

    stale_after_s: float = 2.0
    out_after_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.stale_after_s <= self.out_after_s:
            raise ValueError(
                f"health limits need 0 < stale_after_s <= out_after_s, got "
                f"{self.stale_after_s} and {self.out_after_s}"
            )

    def health(self, lag_s: float) -> ReplicaHealth:
        if lag_s >= self.out_after_s:
            return ReplicaHealth.OUT
        if lag_s >= self.stale_after_s:
            return ReplicaHealth.STALE
        return ReplicaHealth.LIVE


@dataclass(slots=True)
class RouteRequest:
    num_tokens: int
    block_hashes: Sequence[int]  # routable blocks, KV-event form (see routable_block_hashes)
    block_size: int


@dataclass(slots=True)
class ReplicaScore:
    replica: str
    health: ReplicaHealth
    cached_blocks: int  # on its GPU at admission (pending and survival included)
    cached_tokens: int  # those blocks' tokens
    load_cost: float  # in the cost model's unit (`RouteDecision.unit`)
    cost: float  # load_cost + the prefill of what is found nowhere + tier_cost
    sent_since_status: int = 0  # requests sent there after its load was measured (in load_cost)
    evicted_blocks: int = 0  # leading blocks cached now that its next allocations evict
    # Past the GPU prefix, the blocks in a row it would load from its CPU tier, then (where the
    # CPU tier has none) from the shared tier; what those loads cost (in cost).
    cpu_blocks: int = 0
    shared_blocks: int = 0
    tier_cost: float = 0.0
    block_size: int = 0

    @property
    def cpu_tokens(self) -> int:
        return self.cpu_blocks * self.block_size

    @property
    def shared_tokens(self) -> int:
        return self.shared_blocks * self.block_size

    @property
    def hit_tokens(self) -> int:
        """The prompt tokens it would not compute: on its GPU or loaded from a tier (what the
        ledger reports as cached, as vLLM counts external hits)."""
        return self.cached_tokens + (self.cpu_blocks + self.shared_blocks) * self.block_size


@dataclass(slots=True)
class RouteDecision:
    replica: str
    policy: str
    scores: list[ReplicaScore] = field(default_factory=list)
    unit: str = "s"  # of every cost: seconds (measured) or tokens (hand-set weights)

    def score_of(self, replica: str) -> ReplicaScore:
        return next(s for s in self.scores if s.replica == replica)


def routable_block_hashes(
    token_ids: Sequence[int],
    hasher: BlockHasher,
    block_size: int,
    cache_salt: str | None = None,
    lora: tuple[str, str] | None = None,
) -> list[int]:
    """The prompt's blocks a ledger could hit, in KV-event form: the full blocks before the last
    token (the ledger always recomputes it), hashed with the ledger's algorithm, seed and salt."""
    limit = (len(token_ids) - 1) // block_size
    hashes = hasher.hash_blocks(
        token_ids[: limit * block_size], block_size, cache_salt=cache_salt, lora=lora
    )
    return [to_event_hash(h) for h in hashes]


class ReplicaPrefixIndex:
    """Block hash -> replicas, one `PrefixIndex` per replica, fed by that replica's KV events."""

    def __init__(self) -> None:
        self.replicas: dict[str, PrefixIndex] = {}

    def apply(self, replica: str, batch: KVEventBatch) -> None:
        self.replicas.setdefault(replica, PrefixIndex()).apply(batch)

    def load_snapshot(self, replica: str, counts: Mapping[int, int]) -> None:
        """Replace a replica's view with its ledger's snapshot (hash -> physical blocks)."""
        index = PrefixIndex()
        index.counts.update(counts)
        self.replicas[replica] = index

    def cached_blocks(self, replica: str, block_hashes: Sequence[int]) -> int:
        index = self.replicas.get(replica)
        return index.leading_blocks(block_hashes) if index is not None else 0


class SharedTier(Protocol):
    """A shared tier's contents, as its catalog follower knows them: whether a block (by its
    KV-event hash) can be loaded from it by a replica of its namespace."""

    def contains(self, event_hash: int) -> bool: ...


@dataclass(slots=True)
class TierBlocks:
    """Of a request's blocks past the GPU prefix, how many in a row load from each tier."""

    cpu: int = 0
    shared: int = 0

    def by_tier(self) -> dict[str, int]:
        return {TIER_CPU: self.cpu, TIER_SHARED: self.shared}


def walk_tiers(
    block_hashes: Sequence[int],
    start: int,
    cpu: Container[int] | None,
    shared: SharedTier | None,
) -> TierBlocks:
    """From block `start` on (the end of the GPU prefix), each block in the CPU tier or else
    the shared tier, to the first found in neither."""
    found = TierBlocks()
    if not cpu and shared is None:
        return found
    for index in range(start, len(block_hashes)):
        block_hash = block_hashes[index]
        if cpu and block_hash in cpu:
            found.cpu += 1
        elif shared is not None and shared.contains(block_hash):
            found.shared += 1
        else:
            break
    return found


class SentPrefixLRU:
    """approx: the blocks the router sent to each replica, least recently sent dropped first."""

    def __init__(self, capacity_blocks: int = 65536) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._sent: OrderedDict[tuple[str, int], None] = OrderedDict()

    def record(self, replica: str, block_hashes: Sequence[int]) -> None:
        sent = self._sent
        for block_hash in block_hashes:
            key = (replica, block_hash)
            sent[key] = None
            sent.move_to_end(key)
        while len(sent) > self.capacity_blocks:
            sent.popitem(last=False)

    def cached_blocks(self, replica: str, block_hashes: Sequence[int]) -> int:
        for index, block_hash in enumerate(block_hashes):
            if (replica, block_hash) not in self._sent:
                return index
        return len(block_hashes)

    def __len__(self) -> int:
        return len(self._sent)


@dataclass(slots=True)
class Pending:
    """One request sent and not finished."""

    replica: str
    block_hashes: Sequence[int]
    sent_at: float
    prefill_tokens: int  # what the router expected it to prefill there
    owner: str = ""  # the gateway that sent it ("" this one)


class PendingRequests:
    """The requests sent that have not finished, by replica: their blocks (counted per hash, so
    one finishing does not drop what another still holds), when each was sent and what it was
    expected to prefill. `release` when a request ends; past `capacity` the oldest is dropped,
    so a lost release costs memory only until then."""

    def __init__(self, capacity: int = 65536) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._requests: OrderedDict[str, Pending] = OrderedDict()
        self._sent_at: dict[str, OrderedDict[str, Pending]] = {}  # replica -> id -> entry
        self._blocks: dict[str, Counter[int]] = {}

    def add(
        self,
        request_id: str,
        replica: str,
        block_hashes: Sequence[int],
        at: float,
        prefill_tokens: int = 0,
        owner: str = "",
    ) -> None:
        self.release(request_id)
        entry = Pending(replica, block_hashes, at, prefill_tokens, owner)
        self._requests[request_id] = entry
        by_time = self._sent_at.setdefault(replica, OrderedDict())
        late = bool(by_time) and next(reversed(by_time.values())).sent_at > at
        by_time[request_id] = entry
        if late:  # another gateway's entry, read after newer ones: keep them in time order
            _reorder(by_time)
        self._blocks.setdefault(replica, Counter()).update(block_hashes)
        while len(self._requests) > self.capacity:
            self.release(next(iter(self._requests)))

    def release(self, request_id: str) -> bool:
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return False
        del self._sent_at[entry.replica][request_id]
        blocks = self._blocks[entry.replica]
        for block_hash in entry.block_hashes:
            blocks[block_hash] -= 1
            if blocks[block_hash] <= 0:
                del blocks[block_hash]
        return True

    def get(self, request_id: str) -> Pending | None:
        return self._requests.get(request_id)

    def ids(self, owner: str | None = None) -> list[str]:
        return [r for r, e in self._requests.items() if owner is None or e.owner == owner]

    def ids_on(self, replica: str, owner: str | None = None) -> list[str]:
        entries = self._sent_at.get(replica)
        if entries is None:
            return []
        return [r for r, e in entries.items() if owner is None or e.owner == owner]

    def cached_blocks(self, replica: str, block_hashes: Sequence[int]) -> int:
        blocks = self._blocks.get(replica)
        if not blocks:
            return 0
        for index, block_hash in enumerate(block_hashes):
            if block_hash not in blocks:
                return index
        return len(block_hashes)

    def sent_since(self, replica: str, as_of: float) -> SentSince:
        """Unfinished requests sent to the replica after `as_of` (newest last: a short walk)."""
        sent = SentSince()
        for entry in reversed(self._sent_at.get(replica, {}).values()):
            if entry.sent_at <= as_of:
                break
            sent.requests += 1
            sent.prefill_tokens += entry.prefill_tokens
        return sent

    def on(self, replica: str) -> int:
        return len(self._sent_at.get(replica, ()))

    def __len__(self) -> int:
        return len(self._requests)


def _reorder(entries: OrderedDict[str, Pending]) -> None:
    ordered = sorted(entries.items(), key=lambda item: item[1].sent_at)
    entries.clear()
    entries.update(ordered)


# A replica's cached prefix, in blocks, for the request's routable block hashes.
PrefixSource = Callable[[str, Sequence[int]], int]
# The blocks a replica's CPU tier holds (KV-event hashes), from its events.
TierSource = Callable[[str], Container[int]]


class Scorer(ABC):
    """One routing policy: what it expects each replica to hold, and how it picks.

    The interface the router (the gateway's, the indexer's, the simulation's) calls. A policy
    answers `cached_blocks`: how many of the request's leading routable blocks it believes the
    replica holds now (0 if it does not look); the router adds what was sent there and is not
    finished (when `counts_pending`), drops what the replica's eviction head says goes before
    admission (when `evictions_apply`: the blocks came from the replica's events), prices each
    replica and calls `pick` on the replicas that are not out, in rotation order. `routed`
    tells the policy where a request went.
    """

    name: ClassVar[str]
    counts_pending: ClassVar[bool] = False
    evictions_apply: ClassVar[bool] = False

    def cached_blocks(self, replica: str, request: RouteRequest, health: ReplicaHealth) -> int:
        return 0

    def tier_blocks(
        self,
        replica: str,
        request: RouteRequest,
        health: ReplicaHealth,
        start: int,
        load: ReplicaLoad,
    ) -> TierBlocks:
        """Of the request's blocks from `start` on (past what it expects on the GPU), how many
        in a row the replica would load from its CPU tier, then the shared tier (none: the
        policy does not look at tiers)."""
        return TierBlocks()

    def pick(self, scores: Sequence[ReplicaScore]) -> ReplicaScore:
        """The cheapest; of equals the first (the rotation's next)."""
        return min(scores, key=lambda s: s.cost)

    def routed(self, replica: str, request: RouteRequest) -> None:  # noqa: B027 - optional
        """The request went to `replica`."""


class RoundRobin(Scorer):
    name = "round_robin"

    def pick(self, scores: Sequence[ReplicaScore]) -> ReplicaScore:
        return scores[0]


class LeastLoaded(Scorer):
    name = "least_loaded"


class Approx(Scorer):
    """The blocks this router sent where; trusted while the replica is not out (they are the
    router's own knowledge, not the replica's)."""

    name = "approx"

    def __init__(self, lru: SentPrefixLRU | None = None) -> None:
        self.lru = lru or SentPrefixLRU()

    def cached_blocks(self, replica: str, request: RouteRequest, health: ReplicaHealth) -> int:
        return self.lru.cached_blocks(replica, request.block_hashes)

    def routed(self, replica: str, request: RouteRequest) -> None:
        self.lru.record(replica, request.block_hashes)


class Precise(Scorer):
    """The replica's own KV events (its prefix index, and its CPU tier's blocks), trusted while
    it is LIVE; the shared tier of its namespace (`shared_tiers`, the catalogs this router
    follows) while it is not OUT: that is not the replica's own word."""

    name = "precise"
    counts_pending = True
    evictions_apply = True

    def __init__(
        self,
        source: PrefixSource,
        tier_source: TierSource | None = None,
        shared_tiers: Mapping[str, SharedTier] | None = None,
    ) -> None:
        self.source = source
        self.tier_source = tier_source
        # namespace -> its shared tier; filled by whoever follows the tiers' catalogs.
        self.shared_tiers: Mapping[str, SharedTier] = (
            shared_tiers if shared_tiers is not None else {}
        )

    def cached_blocks(self, replica: str, request: RouteRequest, health: ReplicaHealth) -> int:
        if health is not ReplicaHealth.LIVE:
            return 0
        return self.source(replica, request.block_hashes)

    def tier_blocks(
        self,
        replica: str,
        request: RouteRequest,
        health: ReplicaHealth,
        start: int,
        load: ReplicaLoad,
    ) -> TierBlocks:
        cpu = (
            self.tier_source(replica)
            if self.tier_source is not None and health is ReplicaHealth.LIVE
            else None
        )
        namespace = load.shared_tier
        shared = self.shared_tiers.get(namespace) if namespace is not None else None
        return walk_tiers(request.block_hashes, start, cpu, shared)


class Oracle(Precise):
    """Simulation only: the source reads each ledger's prefix cache itself."""

    name = "oracle"


POLICIES: dict[str, type[Scorer]] = {
    cls.name: cls for cls in (RoundRobin, LeastLoaded, Approx, Precise)
}
SIMULATED_POLICIES: dict[str, type[Scorer]] = {**POLICIES, Oracle.name: Oracle}


def make_scorer(
    policy: str,
    prefix_source: PrefixSource | None = None,
    tier_source: TierSource | None = None,
    shared_tiers: Mapping[str, SharedTier] | None = None,
) -> Scorer:
    """The scorer named `policy`; precise and the oracle read `prefix_source` (and the CPU
    tiers' blocks from `tier_source`, the shared tiers from `shared_tiers`, when given)."""
    cls = SIMULATED_POLICIES.get(policy)
    if cls is None:
        raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if issubclass(cls, Precise):
        if prefix_source is None:
            raise ValueError(f"the {policy} policy needs a prefix source (the replicas' index)")
        return cls(prefix_source, tier_source, shared_tiers)
    return cls()


class Router:
    """One policy over a fixed set of replica names; `route` is the whole decision."""

    def __init__(
        self,
        policy: str | Scorer,
        replicas: Sequence[str],
        *,
        costs: CostModel | None = None,
        prefix_source: PrefixSource | None = None,
        pending: PendingRequests | None = None,
        eviction_aware: bool = True,
        rotation: int = 0,
        tier_source: TierSource | None = None,
        shared_tiers: Mapping[str, SharedTier] | None = None,
    ) -> None:
        if not replicas:
            raise ValueError("routing needs at least one replica")
        self.scorer = (
            policy
            if isinstance(policy, Scorer)
            else make_scorer(policy, prefix_source, tier_source, shared_tiers)
        )
        self.policy = self.scorer.name
        self.replicas = list(replicas)
        self.costs = costs or MeasuredCosts()
        # Every request sent and not yet released. Its blocks count as cached for precise and
        # the oracle, whose sources see only what was computed: a queue of requests sharing a
        # new prompt must follow the first copy, not spread before its prefill ends. A small
        # LRU of sent blocks did this before and, at 64 replicas, forgot a hot prompt still
        # queued behind others (precise hit 0.858 against approx's 0.920).
        self.pending = pending if pending is not None else PendingRequests()
        self.eviction_aware = eviction_aware
        # Round robin, and the tie-break of the cost policies. Several gateways start their
        # rotations apart (`rotation`): routing ties at once, they would pick alike.
        self._next = rotation % len(self.replicas)
        self._ids = itertools.count()

    def route(
        self,
        request: RouteRequest,
        loads: Mapping[str, ReplicaLoad],
        health: Mapping[str, ReplicaHealth] | None = None,
        *,
        request_id: str | None = None,
        now: float = 0.0,
    ) -> RouteDecision:
        """The cheapest replica; the request counts as pending there until `release`d. `now` is
        on the clock of the loads' `as_of`."""
        n = len(self.replicas)
        order = [self.replicas[(self._next + i) % n] for i in range(n)]
        self.costs.prepare(loads)
        scores = [self.score(name, request, loads, health, now) for name in order]
        candidates = [s for s in scores if s.health is not ReplicaHealth.OUT]
        if not candidates:
            raise NoReplicaError(
                f"no replica can take the request: all {n} are out (their ledgers stopped "
                "answering, have not reported yet, or their events fell behind); check "
                "`kvledger up` and Redis"
            )
        chosen = self.scorer.pick(candidates)
        self._next = (self.replicas.index(chosen.replica) + 1) % n
        self.scorer.routed(chosen.replica, request)
        if request_id is None:
            request_id = f"#{next(self._ids)}"  # never released: ages out past the capacity
        prefill = max(request.num_tokens - chosen.hit_tokens, 0)
        self.pending.add(request_id, chosen.replica, request.block_hashes, now, prefill)
        return RouteDecision(chosen.replica, self.policy, scores, self.costs.unit)

    def release(self, request_id: str) -> None:
        """The request ended (finished, aborted or failed): its replica's events and status
        speak for it from now on."""
        self.pending.release(request_id)

    def score(
        self,
        replica: str,
        request: RouteRequest,
        loads: Mapping[str, ReplicaLoad],
        health: Mapping[str, ReplicaHealth] | None,
        now: float,
    ) -> ReplicaScore:
        """One replica's score for the request, changing nothing (the indexer's /score)."""
        state = health.get(replica, ReplicaHealth.LIVE) if health else ReplicaHealth.LIVE
        load = loads.get(replica) or ReplicaLoad()
        # Sent since the replica measured its load: queued there, missing from its figures.
        sent = (
            self.pending.sent_since(replica, load.as_of) if load.as_of is not None else SentSince()
        )
        load_cost = self.costs.load_cost(load, sent)
        cached_blocks = evicted = 0
        tiers = TierBlocks()
        scorer = self.scorer
        if state is not ReplicaHealth.OUT:
            # STALE distrusts only what comes from the replica (its events index); what was
            # sent there (approx's LRU, precise's pending blocks) is still known. Dropping that
            # too made a loaded machine, where a ledger's 1 s status heartbeat runs late past
            # stale_after_s, scatter a hot prefix across replicas by load alone.
            cached_blocks = scorer.cached_blocks(replica, request, state)
            head = load.eviction
            if scorer.evictions_apply and self.eviction_aware and head is not None:
                since = (
                    self.pending.sent_since(replica, head.as_of).prefill_tokens
                    if head.as_of is not None
                    else 0
                )
                allocations = head.allocations_before(since, request.block_size)
                surviving = head.surviving_blocks(request.block_hashes, cached_blocks, allocations)
                evicted, cached_blocks = cached_blocks - surviving, surviving
            if scorer.counts_pending:
                cached_blocks = max(
                    cached_blocks, self.pending.cached_blocks(replica, request.block_hashes)
                )
            # Past the GPU prefix (what the eviction head spares and what was sent there), the
            # blocks it would load from a tier instead of computing them.
            tiers = scorer.tier_blocks(replica, request, state, cached_blocks, load)
        size = request.block_size
        cached_tokens = cached_blocks * size
        found = cached_tokens + (tiers.cpu + tiers.shared) * size
        prefill = self.costs.prefill_cost(max(request.num_tokens - found, 0), load)
        tier_cost = (
            self.costs.tier_cost(tiers.by_tier(), size, load) if tiers.cpu or tiers.shared else 0.0
        )
        return ReplicaScore(
            replica, state, cached_blocks, cached_tokens, load_cost,
            load_cost + prefill + tier_cost, sent.requests, evicted,
            tiers.cpu, tiers.shared, tier_cost, size,
        )  # fmt: skip
