"""The gateway's side of replicas: which replica's ledger gets each request, and reading back
the outputs of every replica it sends to.

One replica (the default): every request goes to it, nothing is followed. Several
(`--replicas r0,r1,...`): a `ReplicaSet` follows each replica's KV events and ledger status, and
a `Router` (services/routing/policy.py) picks one per request under `--routing` (precise by default:
the prompt's blocks hashed as the ledger will, scored against each replica's resident prefix
and traded against its load). External replicas (`--external-replica NAME=URL`: vLLM servers
whose KV events `kvledger bridge` writes to replica NAME's keys) are followed and scored the
same way, with the hash settings given at start-up, and their requests proxied
(`gateway.upstream`); one whose server does not answer, or hashes otherwise, is out. Each ledger writes a request's outputs to
`kvl:{replica}:outputs:{gateway_id}` (the replica's own slot in a Redis Cluster), so the gateway
tails one outputs stream per replica, all feeding the same per-request queues.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import redis.asyncio as aioredis
from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.fields import ApiError
from gateway.output_reader import OutputDispatcher
from gateway.protocol import Job
from gateway.upstream import Upstreams
from observability import Attr, SpanName, get_logger
from services.config import GatewayConfig
from services.environment import ConfigError, env
from services.routing.costs import CostModel, MeasuredCosts, parse_weights
from services.routing.policy import (
    HealthLimits,
    NoReplicaError,
    ReplicaHealth,
    RouteDecision,
    Router,
    RouteRequest,
    routable_block_hashes,
)
from services.routing.replicas import ReplicaSet, parse_replicas
from services.routing.shared import SharedPending
from services.tokenization.tokenizer import Tokenizer
from services.transport.keys import StreamNames
from services.wire import codec
from services.wire.messages import TIER_CPU, TIER_SHARED, LedgerStatus

log = get_logger("gateway.router")

RETRY_AFTER_S = 1


__all__ = ["GatewayRouting", "OneReplica", "Replicas", "Route", "parse_weights", "routing_for"]


class Route(NamedTuple):
    """Where a request goes, and the prompt tokens its router expects that replica to hold
    (None: nothing was decided, one replica)."""

    replica: str
    expected_cached_tokens: int | None = None


class GatewayRouting:
    """What every way of routing shares: the replicas' streams, one output reader per replica
    feeding the same per-request queues, and the routing counters. `routing_for` picks the
    subclass: `OneReplica` (nothing to decide or follow) or `Replicas` (a policy over the
    replicas' followed events and status)."""

    one_ledger = True  # the gateway mirrors the one ledger's counters on its own /metrics
    upstreams: Upstreams | None = None  # the external replicas, when there are any

    def __init__(
        self,
        config: GatewayConfig,
        replicas: dict[str, StreamNames],
        redis: aioredis.Redis,
        gateway_id: str,
        registry: CollectorRegistry,
        on_dead_letter: Callable[[str], None],
        on_outage: Callable[[str], None] | None = None,
    ) -> None:
        self.policy = config.routing
        self.replicas = replicas
        self.names = list(replicas)
        self.primary = replicas[self.names[0]]
        self.redis = redis
        # One reader per replica (their streams live in different cluster slots), one set of
        # per-request queues: a request's outputs reach it from whichever replica serves it.
        self.dispatchers = {
            name: OutputDispatcher(
                redis,
                streams.outputs(gateway_id),
                streams.dead_letters,
                on_dead_letter=on_dead_letter,
                marker=streams.gateway_marker(gateway_id),
                on_outage=on_outage,
                marker_ttl_s=config.gateway_lease_s,
            )
            for name, streams in replicas.items()
        }
        self.outputs = self.dispatchers[self.names[0]]
        for dispatcher in self.dispatchers.values():
            dispatcher.queues = self.outputs.queues
        self._routed = Counter(
            "kvledger:routed_requests",
            "Requests this gateway sent to each replica, by routing policy.",
            ("replica", "policy"),
            registry=registry,
        )
        self._routed_hit = Counter(
            "kvledger:routed_prefix_hit_tokens",
            "Prompt tokens the chosen replica was expected not to compute at routing time (on "
            "its GPU, or loaded from its CPU tier or the shared tier).",
            ("replica", "policy"),
            registry=registry,
        )
        pending = Gauge(
            "kvledger:routing_pending_requests",
            "Requests this gateway routed that have not ended: counted on their replica until "
            "its events and status show them.",
            registry=registry,
        )
        pending.set_function(self.num_pending)

    def requests_stream(self, replica: str | None) -> str:
        return self.replicas.get(replica or "", self.primary).requests

    def dispatcher(self, replica: str | None) -> OutputDispatcher:
        """The outputs reader of `replica` (None or unknown: the first)."""
        return self.dispatchers.get(replica or "", self.outputs)

    def route(self, job: Job, req_id: str) -> Route:
        """The replica that gets this request (503 when every replica is out); it counts as
        pending there until `release`."""
        raise NotImplementedError

    def pin(self, job: Job, req_id: str, replica: str) -> Route:
        """Send this request to `replica`, decided already (another sequence of the same
        request went there); it counts as pending there until `release`."""
        return Route(replica)

    def release(self, req_id: str) -> None:
        """The request ended: its replica's events and status account for it from now on."""

    def num_pending(self) -> int:
        return 0

    def describe(self) -> dict[str, dict[str, Any]]:
        """Each replica's health, why it is out and what its tiers cost, for /health (empty:
        one replica)."""
        return {}

    def any_routable(self) -> bool:
        return True

    def not_ready(self) -> str | None:
        """Why the gateway cannot route yet (None: it can)."""
        return None

    async def read_status(self) -> LedgerStatus | None:
        """The status of a ledger a request could go to (the model's limits, liveness)."""
        raise NotImplementedError

    async def start(self) -> None:
        """The primary reader is started by the gateway; the others here."""
        for dispatcher in self.dispatchers.values():
            if dispatcher is not self.outputs:
                await dispatcher.start()
        log.info("routing_started", policy=self.policy, replicas=self.names)

    async def stop(self) -> None:
        for dispatcher in self.dispatchers.values():
            if dispatcher is not self.outputs:
                await dispatcher.stop()


class OneReplica(GatewayRouting):
    """Every request goes to the one replica; nothing is followed."""

    def route(self, job: Job, req_id: str) -> Route:
        self._routed.labels(self.names[0], "single").inc()
        return Route(self.names[0])

    async def read_status(self) -> LedgerStatus | None:
        data = cast("bytes | None", await self.redis.get(self.primary.ledger_status))
        if data is None:
            return None
        try:
            return codec.decode(data, LedgerStatus)
        except codec.WireError as exc:
            log.warning("ledger_status_unreadable", key=self.primary.ledger_status, error=str(exc))
            return None


class Replicas(GatewayRouting):
    """Several replicas: a `ReplicaSet` follows each one's KV events and ledger status, and a
    `Router` picks one per request under the policy."""

    one_ledger = False

    def __init__(
        self,
        config: GatewayConfig,
        replicas: dict[str, StreamNames],
        redis: aioredis.Redis,
        gateway_id: str,
        registry: CollectorRegistry,
        on_dead_letter: Callable[[str], None],
        on_outage: Callable[[str], None] | None,
        tracer: Tracer,
        costs: CostModel,
        limits: HealthLimits,
        upstreams: Upstreams | None = None,
    ) -> None:
        self.replica_set = ReplicaSet(redis, list(replicas.items()), limits=limits)
        self.upstreams = upstreams
        # With external replicas, every prompt is hashed with the settings given at start-up
        # (theirs cannot be read from a server); a replica whose status says otherwise is out.
        self.hashing = (config.hash_algo, config.block_size) if upstreams is not None else None
        self._out_logged: dict[str, str] = {}
        # The shared tiers this gateway can see into, by namespace (a catalog follower each,
        # started when a replica's status names one): such a replica is scored on them too.
        self.shared_tiers = self.replica_set.shared_tiers
        self.router = Router(
            config.routing,
            list(replicas),
            costs=costs,
            prefix_source=self.replica_set.cached_blocks,
            tier_source=self.replica_set.cpu_blocks,
            shared_tiers=self.shared_tiers,
        )
        # What every gateway sent where and is pending there, through the replicas' routing
        # streams: several gateways route as one.
        self.shared = SharedPending(
            redis, replicas, self.router.pending, gateway_id, on_outage=on_outage
        )
        self.tracer = tracer
        super().__init__(config, replicas, redis, gateway_id, registry, on_dead_letter, on_outage)
        shared = Gauge(
            "kvledger:routing_shared_pending_requests",
            "Requests other gateways routed that have not ended, as their routing streams say: "
            "counted on their replica by this gateway's router too.",
            registry=registry,
        )
        shared.set_function(self.shared.num_remote)

    def health(self, name: str) -> ReplicaHealth:
        """The replica's health from its events and status; out while `out_reason` says why."""
        reason = self.out_reason(name)
        if reason is not None and self._out_logged.get(name) != reason:
            log.warning("replica_out", replica=name, reason=reason)
        if reason is None:
            self._out_logged.pop(name, None)
            return self.replica_set.health(name)
        self._out_logged[name] = reason
        return ReplicaHealth.OUT

    def healths(self) -> dict[str, ReplicaHealth]:
        return {name: self.health(name) for name in self.names}

    def out_reason(self, name: str) -> str | None:
        """Why a replica is out whatever its events and status say: its server does not answer
        (an external one), or it hashes prompts otherwise than the start-up settings."""
        if self.upstreams is not None and name in self.upstreams:
            reason = self.upstreams.out_reason(name)
            if reason is not None:
                return reason
        status = self.replica_set.replicas[name].status
        if self.hashing is None or status is None:
            return None
        if status.num_workers == 0 and status.capacity_line.startswith("out:"):
            return status.capacity_line.removeprefix("out:").strip()  # the bridge's verdict
        if (status.hash_algo, status.block_size) != self.hashing:
            return (
                f"its blocks are {status.block_size} tokens hashed with {status.hash_algo}, the "
                f"gateway hashes {self.hashing[1]} with {self.hashing[0]} (--block-size, "
                "--prefix-caching-hash-algo): its KV events could never match a prompt"
            )
        return None

    def _block_hashes(self, job: Job) -> tuple[list[int], int]:
        """The prompt's routable blocks and the block size: the start-up settings' with
        external replicas, else as the first replica that reported hashes them."""
        if self.hashing is not None:
            algo, block_size = self.hashing
            hasher = self.replica_set.hasher(algo)
            return (
                routable_block_hashes(job.prompt_token_ids, hasher, block_size, job.cache_salt),
                block_size,
            )
        for name in self.names:
            found = self.replica_set.block_hashes(name, job.prompt_token_ids, job.cache_salt)
            status = self.replica_set.replicas[name].status
            if found is not None and status is not None:
                return found, status.block_size
        return [], 0

    def route(self, job: Job, req_id: str) -> Route:
        replicas = self.replica_set
        hashes, block_size = self._block_hashes(job)
        request = RouteRequest(len(job.prompt_token_ids), hashes, block_size)
        with self.tracer.start_as_current_span(SpanName.ROUTE) as span:
            try:
                decision = self.router.route(
                    request, replicas.loads(), self.healths(), request_id=req_id,
                    now=time.time(),  # the clock of the ledgers' status updated_at
                )  # fmt: skip
            except NoReplicaError as exc:
                log.warning("route_refused", policy=self.policy, error=str(exc))
                raise ApiError(
                    503, str(exc),
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                ) from None  # fmt: skip
            if span.is_recording():  # a trace the sampler left out costs nothing here
                span.set_attributes(_span_attributes(decision))
        chosen = decision.score_of(decision.replica)
        self._routed.labels(decision.replica, self.policy).inc()
        self._routed_hit.labels(decision.replica, self.policy).inc(chosen.hit_tokens)
        log.debug(
            "routed", replica=decision.replica, policy=self.policy,
            cached_tokens=chosen.cached_tokens, cpu_tokens=chosen.cpu_tokens,
            shared_tokens=chosen.shared_tokens, cost=round(chosen.cost, 4), unit=decision.unit,
            healths={score.replica: score.health.value for score in decision.scores},
            # replica -> [GPU, CPU, shared tokens, load cost, cost, evicted blocks]
            scores={s.replica: [s.cached_tokens, s.cpu_tokens, s.shared_tokens,
                                round(s.load_cost, 4), round(s.cost, 4), s.evicted_blocks]
                    for s in decision.scores},
            lags=replicas.lags(), prompt_tokens=request.num_tokens,
        )  # fmt: skip
        self.shared.routed(req_id)
        # What it expects the ledger to report as cached: loaded blocks count, as vLLM's do.
        return Route(decision.replica, chosen.hit_tokens)

    def pin(self, job: Job, req_id: str, replica: str) -> Route:
        hashes, block_size = self._block_hashes(job)
        cached = self.router.pending.cached_blocks(replica, hashes)
        prefill = max(len(job.prompt_token_ids) - cached * block_size, 0)
        self.router.pending.add(req_id, replica, hashes, time.time(), prefill)
        self.shared.routed(req_id)
        self._routed.labels(replica, self.policy).inc()
        return Route(replica)

    def release(self, req_id: str) -> None:
        entry = self.router.pending.get(req_id)
        self.router.release(req_id)
        if entry is not None:
            self.shared.ended(req_id, entry.replica)

    def num_pending(self) -> int:
        return len(self.router.pending) - self.shared.num_remote()

    def describe(self) -> dict[str, dict[str, Any]]:
        return {
            name: {
                "health": self.health(name).value,
                "url": self.upstreams.urls[name]
                if self.upstreams is not None and name in self.upstreams
                else None,
                "out_reason": self.out_reason(name),
                **tier_costs_of(self.replica_set.replicas[name].status),
            }
            for name in self.names
        }

    def any_routable(self) -> bool:
        """At least one replica that is not out."""
        return any(h is not ReplicaHealth.OUT for h in self.healths().values())

    def not_ready(self) -> str | None:
        """Not before every replica has published a status or been silent past the out limit,
        nor while every one is out."""
        waiting = self.replica_set.unsettled()
        started = self.replica_set.started_at
        out_after_s = self.replica_set.limits.out_after_s
        if self.upstreams is not None and time.monotonic() - (started or 0.0) < out_after_s:
            waiting += [n for n in self.upstreams.urls if n not in self.upstreams.probed]
        if waiting:
            return (
                f"routing waits for the first status of replica(s) {', '.join(waiting)} (at most "
                f"{self.replica_set.limits.out_after_s:g}s, --route-out-after-s, after the "
                "gateway started)"
            )
        if not self.any_routable():
            return "every replica is out: their ledgers stopped answering or have no worker" + (
                "; " + "; ".join(f"{n}: {r}" for n in self.names if (r := self.out_reason(n)))
            )
        return None

    async def read_status(self) -> LedgerStatus | None:
        """The newest status of a replica that is not out and has a worker (the model's limits
        are the same on all), else the newest of any."""
        states = self.replica_set.replicas.values()
        seen = [s.status for s in states if s.status is not None]
        usable = [
            s.status
            for s in states
            if s.status is not None
            and s.status.num_workers > 0
            and self.health(s.name) is not ReplicaHealth.OUT
        ]
        pool = usable or seen
        return max(pool, key=lambda status: status.updated_at) if pool else None

    async def start(self) -> None:
        await super().start()
        await self.replica_set.start()
        await self.shared.start()
        if self.upstreams is not None:
            await self.upstreams.start()

    async def stop(self) -> None:
        await super().stop()
        await self.replica_set.stop()
        await self.shared.stop()
        if self.upstreams is not None:
            await self.upstreams.stop()


def routing_for(
    config: GatewayConfig,
    redis: aioredis.Redis,
    gateway_id: str,
    registry: CollectorRegistry,
    tracer: Tracer,
    on_dead_letter: Callable[[str], None],
    on_outage: Callable[[str], None] | None = None,
    tokenizer: Tokenizer | None = None,
) -> GatewayRouting:
    """One replica (the default), several (`--replicas r0,r1,...`), or external ones beside
    (`--external-replica NAME=URL`: then only `--replicas` names kvledger replicas)."""
    externals = dict(config.external_replicas)
    try:
        own = config.replicas or ("" if externals else config.replica)
        replicas = dict(parse_replicas(own, config.stream_prefix)) if own else {}
        for name in externals:
            if name in replicas:
                raise ValueError(f"{name!r} is both a kvledger replica and an external one")
        if externals:
            replicas |= dict(parse_replicas(",".join(externals), config.stream_prefix))
        costs = parse_weights(config.routing_weights) or MeasuredCosts()
        limits = HealthLimits(config.route_stale_after_s, config.route_out_after_s)
    except ValueError as exc:
        raise ConfigError(f"gateway: {exc}") from None
    if not externals and len(replicas) == 1:
        return OneReplica(config, replicas, redis, gateway_id, registry, on_dead_letter, on_outage)
    upstreams = None
    if externals:
        check_hash_settings(config)
        assert tokenizer is not None, "external replicas need the gateway's tokenizer"
        upstreams = Upstreams(externals, tokenizer, tracer, registry, config.request_timeout_s)
    return Replicas(
        config, replicas, redis, gateway_id, registry, on_dead_letter, on_outage, tracer,
        costs, limits, upstreams,
    )  # fmt: skip


def tier_costs_of(status: LedgerStatus | None) -> dict[str, Any]:
    """What a replica's tiers cost, for /health: its measured prefill seconds per token beside
    each tier's seconds to load a block (None where not measured), and the tiers' sizes."""
    if status is None:
        return {}
    costs = status.costs
    per_token = (
        1.0 / costs.prefill_tokens_per_s if costs is not None and costs.prefill_tokens_per_s > 0
        else None
    )  # fmt: skip
    loads = (costs.load_s_per_block if costs is not None else None) or {}
    return {
        "prefill_s_per_token": per_token,
        "load_s_per_block": {tier: loads.get(tier) for tier in (TIER_CPU, TIER_SHARED)},
        "num_cpu_blocks": status.num_cpu_blocks,
        "shared_tier": status.shared_tier.namespace if status.shared_tier is not None else None,
    }


def check_hash_settings(config: GatewayConfig) -> None:
    """External replicas' prompts are hashed as their servers hash them, from settings given
    at start-up; refused when one cannot be known."""
    if config.routing not in ("precise", "approx"):
        return  # nothing is hashed to route
    if config.hash_algo.startswith("xxhash") and env("PYTHONHASHSEED") is None:
        raise ConfigError(
            f"gateway: --prefix-caching-hash-algo {config.hash_algo} with external replicas "
            "needs PYTHONHASHSEED: without it each vLLM server seeds its xxhash block hashes "
            "with random bytes no router can know. Start `vllm serve` and this gateway with "
            "the same PYTHONHASHSEED (or use sha256, vLLM's default)"
        )


def _span_attributes(decision: RouteDecision) -> dict:
    chosen = decision.score_of(decision.replica)
    return {
        Attr.ROUTE_POLICY: decision.policy,
        Attr.ROUTE_REPLICA: decision.replica,
        Attr.ROUTE_CACHED_TOKENS: chosen.cached_tokens,
        Attr.ROUTE_REPLICAS: [s.replica for s in decision.scores],
        Attr.ROUTE_HEALTH: [s.health.value for s in decision.scores],
        Attr.ROUTE_REPLICA_CACHED_TOKENS: [s.cached_tokens for s in decision.scores],
        Attr.ROUTE_LOAD_COSTS: [float(s.load_cost) for s in decision.scores],
        Attr.ROUTE_COSTS: [float(s.cost) for s in decision.scores],
        Attr.ROUTE_COST_UNIT: decision.unit,
        Attr.ROUTE_EVICTED_BLOCKS: [s.evicted_blocks for s in decision.scores],
        Attr.ROUTE_CPU_TOKENS: chosen.cpu_tokens,
        Attr.ROUTE_SHARED_TOKENS: chosen.shared_tokens,
        Attr.ROUTE_REPLICA_CPU_TOKENS: [s.cpu_tokens for s in decision.scores],
        Attr.ROUTE_REPLICA_SHARED_TOKENS: [s.shared_tokens for s in decision.scores],
        Attr.ROUTE_TIER_COSTS: [float(s.tier_cost) for s in decision.scores],
    }
