"""Cache-aware routing across replicas: which replica should serve this prompt.

A replica is one ledger and its workers. Every policy turns each replica into a cost in tokens
of prefill-equivalent work and picks the cheapest (ties go round robin, so equal replicas share):

    cost = prefix * (prompt tokens the replica must prefill)
         + running * its running requests + waiting * its waiting requests
         + kv_usage * its KV usage (0..1)

`round_robin` ignores the cost; `least_loaded` counts load only (every replica must prefill the
whole prompt); `precise` takes the cached prefix from a `ReplicaPrefixIndex` fed by each
replica's KV events (llm-d's precise prefix-cache scorer, Dynamo's KV router); `approx` from a
router-local LRU of the blocks it sent where (llm-d's approximate scorer; it learns nothing
about evictions and starts empty after a restart); an `oracle` (simulation only) reads each
ledger's true prefix cache. The prompt's blocks are hashed once, exactly as the ledger will
(`routable_block_hashes`), and only the blocks the ledger could hit count: never the last token.

Between two looks at a replica the router counts what it sent there itself (`PendingRequests`,
as Dynamo's KV router counts its active requests and blocks): a request not yet finished holds
its blocks there (being prefilled, or in use), so `precise` and the oracle count them as cached
until the events can tell; and one sent after the load the replica last published is not in
that load yet, so every cost policy adds it as waiting. Without either, a burst sharing one new
prompt arrives before any event or status shows the first copy, and spreads out.

A replica whose events fall behind or whose status is old is STALE: its events index may be
wrong, so only what this router itself sent there counts as cached (precise's pending blocks,
approx's LRU), else load alone. One silent for longer is OUT: never chosen until it speaks again.
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ledger.events import KVEventBatch
from ledger.hashing import BlockHasher, to_event_hash
from services.events.subscriber import PrefixIndex

POLICIES = ("round_robin", "least_loaded", "approx", "precise")


class NoReplicaError(RuntimeError):
    """Every replica is out: nothing can serve the request now."""


@dataclass(slots=True)
class RoutingWeights:
    """Costs in prefill tokens. The defaults: a waiting request is a prefill queued ahead (about
    half a typical 1-2k prompt); a running one slows every step a little; a full KV cache evicts
    cached prefixes to make room, which costs about one prompt later."""

    prefix: float = 1.0
    running: float = 32.0
    waiting: float = 512.0
    kv_usage: float = 1024.0

    def __post_init__(self) -> None:
        for name in ("prefix", "running", "waiting", "kv_usage"):
            if getattr(self, name) < 0:
                raise ValueError(f"routing weight {name} must be >= 0, got {getattr(self, name)}")


@dataclass(slots=True)
class ReplicaLoad:
    """What each ledger publishes about itself, and when it measured it (`as_of`, on the clock
    the router is given as `now`; None: current, nothing sent since is missing from it)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    as_of: float | None = None


class ReplicaHealth(enum.Enum):
    LIVE = "live"
    STALE = "stale"  # scored by load alone
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
    cached_blocks: int
    cached_tokens: int
    load_cost: float
    cost: float
    sent_since_status: int = 0  # requests sent there after its load was measured (in load_cost)


@dataclass(slots=True)
class RouteDecision:
    replica: str
    policy: str
    scores: list[ReplicaScore] = field(default_factory=list)

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


class PendingRequests:
    """The requests this router sent that have not finished, by replica: their blocks (counted
    per hash, so one finishing does not drop what another still holds) and when each was sent.
    `release` when a request ends; past `capacity` the oldest is dropped, so a lost release
    costs memory only until then."""

    def __init__(self, capacity: int = 65536) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._requests: OrderedDict[str, tuple[str, Sequence[int]]] = OrderedDict()
        self._sent_at: dict[str, OrderedDict[str, float]] = {}  # replica -> id -> time, in order
        self._blocks: dict[str, Counter[int]] = {}

    def add(self, request_id: str, replica: str, block_hashes: Sequence[int], at: float) -> None:
        self.release(request_id)
        self._requests[request_id] = (replica, block_hashes)
        self._sent_at.setdefault(replica, OrderedDict())[request_id] = at
        self._blocks.setdefault(replica, Counter()).update(block_hashes)
        while len(self._requests) > self.capacity:
            self.release(next(iter(self._requests)))

    def release(self, request_id: str) -> bool:
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return False
        replica, block_hashes = entry
        del self._sent_at[replica][request_id]
        blocks = self._blocks[replica]
        for block_hash in block_hashes:
            blocks[block_hash] -= 1
            if blocks[block_hash] <= 0:
                del blocks[block_hash]
        return True

    def cached_blocks(self, replica: str, block_hashes: Sequence[int]) -> int:
        blocks = self._blocks.get(replica)
        if not blocks:
            return 0
        for index, block_hash in enumerate(block_hashes):
            if block_hash not in blocks:
                return index
        return len(block_hashes)

    def sent_since(self, replica: str, as_of: float) -> int:
        """Unfinished requests sent to the replica after `as_of` (newest last: a short walk)."""
        count = 0
        for at in reversed(self._sent_at.get(replica, {}).values()):
            if at <= as_of:
                break
            count += 1
        return count

    def __len__(self) -> int:
        return len(self._requests)


# A replica's cached prefix, in blocks, for the request's routable block hashes.
PrefixSource = Callable[[str, Sequence[int]], int]


class Router:
    """One policy over a fixed set of replica names; `route` is the whole decision."""

    def __init__(
        self,
        policy: str,
        replicas: Sequence[str],
        *,
        weights: RoutingWeights | None = None,
        prefix_source: PrefixSource | None = None,
        lru: SentPrefixLRU | None = None,
        pending_capacity: int = 65536,
    ) -> None:
        if not replicas:
            raise ValueError("routing needs at least one replica")
        if policy == "approx" and lru is None:
            lru = SentPrefixLRU()
        if policy in ("precise", "oracle") and prefix_source is None:
            raise ValueError(f"the {policy} policy needs a prefix source (the replicas' index)")
        if policy not in (*POLICIES, "oracle"):
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.replicas = list(replicas)
        self.weights = weights or RoutingWeights()
        self.lru = lru
        self.prefix_source = lru.cached_blocks if lru is not None else prefix_source
        # Every request sent and not yet released. Its blocks count as cached for precise and
        # the oracle, whose sources see only what was computed: a queue of requests sharing a
        # new prompt must follow the first copy, not spread before its prefill ends. A small
        # LRU of sent blocks did this before and, at 64 replicas, forgot a hot prompt still
        # queued behind others (precise hit 0.858 against approx's 0.920).
        self.pending = PendingRequests(pending_capacity)
        self._prefix_from_pending = policy in ("precise", "oracle")
        self._next = 0  # round robin, and the tie-break of the cost policies
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
        scores = [self._score(name, request, loads, health, now) for name in order]
        candidates = [s for s in scores if s.health is not ReplicaHealth.OUT]
        if not candidates:
            raise NoReplicaError(
                f"no replica can take the request: all {n} are out (their ledgers stopped "
                "answering or their events fell behind); check `kvledger up` and Redis"
            )
        if self.policy == "round_robin":
            chosen = candidates[0]
        else:
            chosen = min(candidates, key=lambda s: s.cost)  # the first of equals: rotating
        self._next = (self.replicas.index(chosen.replica) + 1) % n
        if self.lru is not None:
            self.lru.record(chosen.replica, request.block_hashes)
        if request_id is None:
            request_id = f"#{next(self._ids)}"  # never released: ages out past the capacity
        self.pending.add(request_id, chosen.replica, request.block_hashes, now)
        return RouteDecision(chosen.replica, self.policy, scores)

    def release(self, request_id: str) -> None:
        """The request ended (finished, aborted or failed): its replica's events and status
        speak for it from now on."""
        self.pending.release(request_id)

    def _score(
        self,
        replica: str,
        request: RouteRequest,
        loads: Mapping[str, ReplicaLoad],
        health: Mapping[str, ReplicaHealth] | None,
        now: float,
    ) -> ReplicaScore:
        state = health.get(replica, ReplicaHealth.LIVE) if health else ReplicaHealth.LIVE
        load = loads.get(replica) or ReplicaLoad()
        w = self.weights
        # Sent since the replica measured its load: queued there, missing from its waiting.
        unseen = self.pending.sent_since(replica, load.as_of) if load.as_of is not None else 0
        load_cost = (
            w.running * load.running
            + w.waiting * (load.waiting + unseen)
            + w.kv_usage * load.kv_usage
        )
        cached_blocks = 0
        if self.policy != "least_loaded" and state is not ReplicaHealth.OUT:
            # STALE distrusts only what comes from the replica (its events index); what this
            # router itself sent there (approx's LRU, precise's pending blocks) is still known.
            # Dropping that too made a loaded machine, where a ledger's 1 s status heartbeat runs
            # late past stale_after_s, scatter a hot prefix across replicas by load alone.
            if self.lru is not None:
                cached_blocks = self.lru.cached_blocks(replica, request.block_hashes)
            elif self.prefix_source is not None and state is ReplicaHealth.LIVE:
                cached_blocks = self.prefix_source(replica, request.block_hashes)
            if self._prefix_from_pending:
                cached_blocks = max(
                    cached_blocks, self.pending.cached_blocks(replica, request.block_hashes)
                )
        cached_tokens = cached_blocks * request.block_size
        cost = w.prefix * (request.num_tokens - cached_tokens) + load_cost
        return ReplicaScore(replica, state, cached_blocks, cached_tokens, load_cost, cost, unseen)
