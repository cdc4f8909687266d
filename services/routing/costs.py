"""What a replica costs a request, in seconds from what the replicas measure (the default) or in
prefill tokens from hand-set weights (`--routing-weights`, the override).

The router prices each replica as the time the request would wait there for its first token,
plus the time the replica spends prefilling what it does not hold:

    cost = wait + running + prefill
    wait    = (tokens queued to prefill there + tokens this router sent since) * s/token,
              at least the measured queue wait while requests are waiting
    running = (sequences running there + requests sent since) * step seconds per sequence
    prefill = 2 * (prompt tokens not cached there) * s/token

every figure from the replica's own ledger status (`LedgerStatus.costs`, measured from its step
timings by `ledger.step_costs`). Blocks the replica would load from a tier rather than compute
(its CPU tier, the shared tier) add their loads instead of their prefill:

    tiers   = 2 * sum over tiers of (blocks loaded from it) * (its seconds to load a block)

the load of a block measured by the replica (`RoutingCosts.load_s_per_block`: its workers at
start-up for the CPU tier, its backend for the shared tier), counted twice as a prefill is (a
load holds the replica's step as a prefill does). The prefill counts twice: once in this request's time to first
token, once in the replica's time, which every request queued after it waits (a prefill avoided
is capacity for everyone; a wait is one request's). That is llm-d's "sticky until saturated" in
measured units: a replica holding the prefix keeps the request until its queue outweighs twice
the prefill it saves. A replica that has not measured yet borrows the others' mean; before any
has, a token is a token (prefill token, queued token and running sequence cost alike), which
is the same trade in other units.

`RoutingWeights` is the override: costs in prefill tokens, `prefix * (tokens to prefill) +
cpu * (tokens loaded from the CPU tier) + shared * (tokens loaded from the shared tier) +
running * running + waiting * waiting + kv_usage * KV usage`, requests sent since the status
added as waiting.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ledger.step_costs import StepCosts
from services.wire.messages import TIER_CPU, TIER_SHARED

# Before any replica has measured a step: one prefill token, one queued token and one running
# sequence per step cost the same (any unit would do: only the ratio decides).
PRIOR_S_PER_TOKEN = 1e-4
# How many times a prefill token counts against a queued one (see the module's docstring).
PREFILL_FACTOR = 2.0
# A tier's load of a block before any replica has measured one: this share of the block's
# prefill (vLLM's CPU offloading reports 2-22x faster TTFT on cached prompts, so a load costs
# well under a prefill; what each replica measures at start-up replaces it).
LOAD_PRIOR_SHARE = 0.1


@dataclass(slots=True)
class EvictionView:
    """A replica's eviction head (`EvictionHead` on the wire), for lookups: event hash ->
    free-queue position as of `as_of` (None: now), when `queued_prefill_tokens` were queued to
    prefill there; every cached free block not listed lies at or beyond `horizon`."""

    positions: dict[int, int] = field(default_factory=dict)
    horizon: int = 0
    as_of: float | None = None
    queued_prefill_tokens: int = 0

    @classmethod
    def of(
        cls,
        positions: Sequence[int],
        hashes: Sequence[int],
        horizon: int,
        as_of: float | None = None,
        queued_prefill_tokens: int = 0,
    ) -> EvictionView:
        return cls(dict(zip(hashes, positions, strict=True)), horizon, as_of, queued_prefill_tokens)

    def allocations_before(self, sent_since_tokens: int, block_size: int) -> int:
        """New blocks the replica takes from the front of its free queue before admitting a
        request sent now: the prefills queued as of the head, and those sent since."""
        tokens = self.queued_prefill_tokens + sent_since_tokens
        return -(-tokens // block_size) if block_size else 0

    def surviving_blocks(self, block_hashes: Sequence[int], cached: int, allocations: int) -> int:
        """Of the `cached` leading blocks, those that outlive `allocations` new blocks: up to
        the first one that close to the front of the free queue."""
        if allocations <= 0 or not self.positions:
            return cached
        get = self.positions.get
        for index in range(cached):
            position = get(block_hashes[index])
            if position is not None and position < allocations:
                return index
        return cached


@dataclass(slots=True)
class ReplicaLoad:
    """What each ledger publishes about itself, and when it measured it (`as_of`, on the clock
    the router is given as `now`; None: current, nothing sent since is missing from it)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    as_of: float | None = None
    # Measured by the ledger (`LedgerStatus.costs`); None until it has published them.
    costs: StepCosts | None = None
    queued_prefill_tokens: int = 0  # to prefill before a request arriving at `as_of`, at most
    eviction: EvictionView | None = None
    # Seconds to load one block from each tier it has (TIER_CPU, TIER_SHARED), as measured.
    load_s_per_block: dict[str, float] = field(default_factory=dict)
    shared_tier: str | None = None  # the namespace of the shared tier it loads from (None: none)


@dataclass(slots=True)
class SentSince:
    """Requests sent to a replica after its load was measured: missing from that load."""

    requests: int = 0
    prefill_tokens: int = 0  # what the router expected them to prefill there


class CostModel(ABC):
    """Turns a replica's load and a request's uncached tokens into one comparable cost."""

    unit: str

    def prepare(self, loads: Mapping[str, ReplicaLoad]) -> None:  # noqa: B027 - optional hook
        """Once per decision, before the replicas are priced (a model may pool their figures)."""

    @abstractmethod
    def load_cost(self, load: ReplicaLoad, sent: SentSince) -> float: ...

    @abstractmethod
    def prefill_cost(self, tokens: int, load: ReplicaLoad) -> float: ...

    def tier_cost(self, blocks: Mapping[str, int], block_size: int, load: ReplicaLoad) -> float:
        """What loading `blocks[tier]` blocks from each tier costs (a model that does not price
        tiers: as their prefill, so a tier never wins what it did not price)."""
        return self.prefill_cost(sum(blocks.values()) * block_size, load)


class MeasuredCosts(CostModel):
    """Seconds, from each replica's measured step costs (the default)."""

    unit = "s"

    def __init__(
        self, prefill_factor: float = PREFILL_FACTOR, load_prior_share: float = LOAD_PRIOR_SHARE
    ) -> None:
        self.prefill_factor = prefill_factor
        self.load_prior_share = load_prior_share
        self._fleet = StepCosts()
        self._fleet_loads: dict[str, float] = {}  # tier -> the replicas' mean, where measured

    def prepare(self, loads: Mapping[str, ReplicaLoad]) -> None:
        by_tier: dict[str, list[float]] = {}
        for load in loads.values():
            for tier, seconds in load.load_s_per_block.items():
                if seconds > 0:
                    by_tier.setdefault(tier, []).append(seconds)
        self._fleet_loads = {tier: sum(v) / len(v) for tier, v in by_tier.items()}
        measured = [load.costs for load in loads.values() if load.costs is not None]
        per_token = [c.prefill_s_per_token for c in measured if c.prefill_tokens_per_s > 0]
        per_seq = [c.step_s_per_seq for c in measured if c.step_s_per_seq > 0]
        spt = sum(per_token) / len(per_token) if per_token else PRIOR_S_PER_TOKEN
        self._fleet = StepCosts(
            prefill_tokens_per_s=1.0 / spt,
            step_s_per_seq=sum(per_seq) / len(per_seq) if per_seq else spt,
        )

    def _per_token(self, load: ReplicaLoad) -> float:
        costs = load.costs
        if costs is not None and costs.prefill_tokens_per_s > 0:
            return costs.prefill_s_per_token
        return self._fleet.prefill_s_per_token

    def load_cost(self, load: ReplicaLoad, sent: SentSince) -> float:
        costs = load.costs
        per_seq = (
            costs.step_s_per_seq
            if costs is not None and costs.step_s_per_seq > 0
            else self._fleet.step_s_per_seq
        )
        wait = (load.queued_prefill_tokens + sent.prefill_tokens) * self._per_token(load)
        if costs is not None and load.waiting > 0:
            wait = max(wait, costs.queue_wait_s)
        return wait + (load.running + sent.requests) * per_seq

    def prefill_cost(self, tokens: int, load: ReplicaLoad) -> float:
        return self.prefill_factor * tokens * self._per_token(load)

    def load_s_per_block(self, tier: str, block_size: int, load: ReplicaLoad) -> float:
        """The replica's measured load of a block from `tier`; else the fleet's mean; else a
        share of the block's prefill there."""
        seconds = load.load_s_per_block.get(tier, 0.0)
        if seconds > 0:
            return seconds
        fleet = self._fleet_loads.get(tier)
        if fleet is not None:
            return fleet
        return self.load_prior_share * block_size * self._per_token(load)

    def tier_cost(self, blocks: Mapping[str, int], block_size: int, load: ReplicaLoad) -> float:
        return self.prefill_factor * sum(
            n * self.load_s_per_block(tier, block_size, load) for tier, n in blocks.items() if n
        )


@dataclass(slots=True)
class RoutingWeights(CostModel):
    """Costs in prefill tokens, set by hand (`--routing-weights`): the override of the
    measured costs."""

    prefix: float = 1.0
    running: float = 32.0
    waiting: float = 512.0
    kv_usage: float = 1024.0
    # A token loaded from a tier, in prefill tokens: a tenth of a prefill from the CPU tier,
    # a quarter from the shared tier (over the network or a filesystem).
    cpu: float = 0.1
    shared: float = 0.25
    unit = "tokens"

    NAMES = ("prefix", "running", "waiting", "kv_usage", "cpu", "shared")

    def __post_init__(self) -> None:
        for name in self.NAMES:
            if getattr(self, name) < 0:
                raise ValueError(f"routing weight {name} must be >= 0, got {getattr(self, name)}")

    def load_cost(self, load: ReplicaLoad, sent: SentSince) -> float:
        return (
            self.running * load.running
            + self.waiting * (load.waiting + sent.requests)
            + self.kv_usage * load.kv_usage
        )

    def prefill_cost(self, tokens: int, load: ReplicaLoad) -> float:
        return self.prefix * tokens

    def tier_cost(self, blocks: Mapping[str, int], block_size: int, load: ReplicaLoad) -> float:
        weight = {TIER_CPU: self.cpu, TIER_SHARED: self.shared}
        return sum(weight.get(tier, self.prefix) * n * block_size for tier, n in blocks.items())


def parse_weights(text: str | None) -> RoutingWeights | None:
    """'waiting=256,kv_usage=2048' over the default weights; None (measured costs) when empty.
    A bad item names itself."""
    if not text or not text.strip():
        return None
    weights = RoutingWeights()
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in RoutingWeights.NAMES:
            raise ValueError(
                f"routing weight {name!r} is unknown: use "
                f"{', '.join(RoutingWeights.NAMES[:-1])} or {RoutingWeights.NAMES[-1]}"
            )
        try:
            setattr(weights, name, float(value))
        except ValueError:
            raise ValueError(f"routing weight {name}={value!r} is not a number") from None
    weights.__post_init__()
    return weights
