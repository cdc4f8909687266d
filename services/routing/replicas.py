"""Following every replica at once: its KV events (one subscriber each) and its ledger's status.

A replica is one ledger and its workers, known by name. `ReplicaSet` keeps, for each, a
`KVEventSubscriber` (snapshot, then the stream, resumed from a checkpoint when one is given)
whose index answers "how many leading blocks of this prompt does the replica hold", and the
ledger's status key (load: running, waiting, KV usage, what a load from each tier costs, the
shared tier's namespace; the block size and hash algorithm to hash prompts with). The same
subscriber's index holds the blocks of the replica's CPU tier (`cpu_blocks`). Its health comes from how far behind both are: the events (time since the
follower last read to the end of the stream) and the status (time since the ledger last wrote
it). The indexer (`kvledger indexer`) and the gateway's router both stand on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ledger.events import MEDIUM_CPU
from ledger.hashing import BlockHasher, resolve_none_hash_seed
from ledger.step_costs import StepCosts
from services.events.subscriber import KVEventSubscriber
from services.routing.costs import EvictionView
from services.routing.policy import HealthLimits, ReplicaHealth, ReplicaLoad, routable_block_hashes
from services.tiers.view import SharedTierViews
from services.transport.keys import StreamNames
from services.wire import codec
from services.wire.messages import EvictionHead, LedgerStatus

log = logging.getLogger(__name__)

POLL_BATCHES = 256
RETRY_S = 0.5


def parse_replicas(text: str, prefix: str) -> list[tuple[str, StreamNames]]:
    """Comma-separated replica names into (name, its keys under the stream prefix)."""
    replicas: list[tuple[str, StreamNames]] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name = item
        if any(c in name for c in "{}:*?[] "):
            raise ValueError(f"replicas: {name!r} is not a replica name (no {{}}:*?[] or spaces)")
        if any(name == seen for seen, _ in replicas):
            raise ValueError(f"replicas: {name!r} is given twice")
        replicas.append((name, StreamNames(prefix, name)))
    if not replicas:
        raise ValueError("replicas: give at least one replica name, e.g. 'default'")
    return replicas


@dataclass
class ReplicaState:
    name: str
    streams: StreamNames
    subscriber: KVEventSubscriber
    status: LedgerStatus | None = None
    # Monotonic times of the last read that reached the end of the events stream, and of the
    # last status read that found the ledger's key.
    caught_up_at: float | None = None
    status_seen_at: float | None = None
    errors: int = 0
    last_error: str | None = field(default=None)
    load: ReplicaLoad = field(default_factory=ReplicaLoad)  # from the status, built once per read
    eviction_view: EvictionView | None = None  # from the eviction head, built once per write

    def events_lag_s(self, now: float) -> float:
        return float("inf") if self.caught_up_at is None else now - self.caught_up_at

    def status_age_s(self, now_wall: float, now: float) -> float:
        """Seconds since the ledger last wrote its status (its own clock, as it wrote it, while
        the key is there; since we last saw the key once it is gone)."""
        if self.status is None or self.status_seen_at is None:
            return float("inf")
        return max(now_wall - self.status.updated_at, now - self.status_seen_at, 0.0)


class ReplicaSet:
    def __init__(
        self,
        r: aioredis.Redis,
        replicas: Sequence[tuple[str, StreamNames]],
        *,
        checkpoint_dir: str | Path | None = None,
        limits: HealthLimits | None = None,
        status_interval_s: float = 0.25,
        poll_block_ms: int = 250,
    ) -> None:
        if not replicas:
            raise ValueError("a replica set needs at least one replica")
        self.r = r
        self.limits = limits or HealthLimits()
        self.status_interval_s = status_interval_s
        self.poll_block_ms = poll_block_ms
        folder = Path(checkpoint_dir) if checkpoint_dir else None
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        self.replicas: dict[str, ReplicaState] = {
            name: ReplicaState(
                name,
                streams,
                KVEventSubscriber(
                    r,
                    streams.prefix,
                    checkpoint=folder / f"{name}.json" if folder else None,
                    replica=streams.replica,
                ),
            )
            for name, streams in replicas
        }
        self._hashers: dict[str, BlockHasher] = {}
        # The shared tiers the replicas' statuses name, each catalog followed once seen.
        prefixes = {streams.prefix for _, streams in replicas}
        self.shared_tiers = SharedTierViews(r, next(iter(prefixes)))
        self._tasks: list[asyncio.Task] = []
        self.started_at: float | None = None  # monotonic, when following began

    @property
    def names(self) -> list[str]:
        return list(self.replicas)

    async def start(self) -> None:
        self.started_at = time.monotonic()
        for state in self.replicas.values():
            self._tasks.append(
                asyncio.create_task(self._follow(state), name=f"follow-{state.name}")
            )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self.shared_tiers.stop()

    async def wait_caught_up(self, timeout_s: float = 10.0) -> None:
        """Until every replica's follower has read to the end of its stream once after now."""
        since = time.monotonic()
        deadline = since + timeout_s
        while any((s.caught_up_at or 0.0) < since for s in self.replicas.values()):
            if time.monotonic() > deadline:
                behind = [n for n, s in self.replicas.items() if (s.caught_up_at or 0.0) < since]
                raise TimeoutError(f"replicas not caught up with their KV events: {behind}")
            await asyncio.sleep(0.02)

    # --- what routers ask --------------------------------------------------------------------

    def health(self, name: str) -> ReplicaHealth:
        state = self.replicas[name]
        now = time.monotonic()
        lag = max(state.events_lag_s(now), state.status_age_s(time.time(), now))
        if state.status is not None and state.status.num_workers == 0:
            return ReplicaHealth.OUT  # a ledger without a worker cannot run a step
        return self.limits.health(lag)

    def unsettled(self) -> list[str]:
        """The replicas not heard from yet: no status since following began, and not silent for
        out_after_s either (then they are out, and settled). A router waits for none of them
        before it is ready: routing before every replica has spoken sends everything to the
        first that did."""
        if self.started_at is None:
            return list(self.replicas)
        if time.monotonic() - self.started_at >= self.limits.out_after_s:
            return []
        return [name for name, state in self.replicas.items() if state.status is None]

    def lags(self) -> dict[str, tuple[float, float]]:
        """Each replica's (events lag, status age) in seconds, rounded: what its health is from."""
        now, now_wall = time.monotonic(), time.time()
        return {
            name: (round(s.events_lag_s(now), 3), round(s.status_age_s(now_wall, now), 3))
            for name, s in self.replicas.items()
        }

    def healths(self) -> dict[str, ReplicaHealth]:
        return {name: self.health(name) for name in self.replicas}

    def loads(self) -> dict[str, ReplicaLoad]:
        """Each ledger's last status, measured at its `updated_at` (up to ~1.25 s old: written
        once a second, read every status_interval_s)."""
        return {name: state.load for name, state in self.replicas.items()}

    def cached_blocks(self, name: str, block_hashes: Sequence[int]) -> int:
        return self.replicas[name].subscriber.index.leading_blocks(block_hashes)

    def cpu_blocks(self, name: str) -> Container[int]:
        """The blocks the replica's CPU tier holds (its KV events of medium CPU)."""
        return self.replicas[name].subscriber.index.tier(MEDIUM_CPU)

    def block_hashes(
        self, name: str, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[int] | None:
        """The prompt's routable blocks as this replica's ledger hashes them (None until its
        status has told the block size and hash algorithm)."""
        status = self.replicas[name].status
        if status is None:
            return None
        return routable_block_hashes(
            token_ids, self.hasher(status.hash_algo), status.block_size, cache_salt
        )

    def hasher(self, algo: str) -> BlockHasher:
        if algo not in self._hashers:
            # The ledger's NONE_HASH comes from PYTHONHASHSEED (vLLM's rule): xxhash without it
            # is random per process, and no reader can match the ledger's hashes.
            self._hashers[algo] = BlockHasher(algo, seed=resolve_none_hash_seed(algo))
        return self._hashers[algo]

    # --- following ---------------------------------------------------------------------------

    async def _follow(self, state: ReplicaState) -> None:
        started = False
        next_status = 0.0
        while True:
            try:
                if not started:
                    await state.subscriber.start("snapshot")
                    started = True
                if time.monotonic() >= next_status:
                    await self._read_status(state)
                    next_status = time.monotonic() + self.status_interval_s
                polled_at = time.monotonic()
                applied = await state.subscriber.poll(
                    block_ms=self.poll_block_ms, count=POLL_BATCHES
                )
                if applied < POLL_BATCHES:
                    state.caught_up_at = polled_at
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                state.errors += 1
                state.last_error = str(exc)
                log.warning("replica_follow_failed replica=%s error=%s", state.name, exc)
                await asyncio.sleep(RETRY_S)

    async def _read_status(self, state: ReplicaState) -> None:
        """The ledger's status and eviction head (one round trip: both keys in its slot)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.get(state.streams.ledger_status)
        pipe.get(state.streams.ledger_eviction)
        data, head_data = cast("list[bytes | None]", await pipe.execute())
        if data is None:
            return  # no ledger now: the last status seen ages until it is OUT
        try:
            status = codec.decode(data, LedgerStatus)
            head = codec.decode(head_data, EvictionHead) if head_data is not None else None
        except codec.WireError as exc:
            log.warning(
                "ledger_status_unreadable replica=%s key=%s error=%s",
                state.name,
                state.streams.ledger_status,
                exc,
            )
            return
        state.status_seen_at = time.monotonic()
        if head is not None and head.epoch != status.epoch:
            head = None  # a previous ledger's: its blocks are gone
        view = state.eviction_view
        if head is None:
            view = None
        elif view is None or view.as_of != head.updated_at:  # built once per write
            view = EvictionView.of(
                head.positions, head.hashes, head.horizon, head.updated_at,
                head.queued_prefill_tokens,
            )  # fmt: skip
        state.eviction_view = view
        if state.status is None or status.updated_at != state.status.updated_at:
            state.load = load_of(status)  # read 4 times per write: built once per write
        state.load.eviction = view
        state.status = status
        shared = status.shared_tier
        if shared is not None and not shared.own_server:
            self.shared_tiers.ensure(shared.namespace)
        self.shared_tiers.retain(self._named_namespaces())  # a model changed: its old namespace

    def _named_namespaces(self) -> set[str]:
        named = set()
        for state in self.replicas.values():
            shared = state.status.shared_tier if state.status is not None else None
            if shared is not None and not shared.own_server:
                named.add(shared.namespace)
        return named


def load_of(status: LedgerStatus) -> ReplicaLoad:
    """A router's view of a ledger's status: its load and measured costs as of `updated_at`
    (the ledger's wall clock: what a router sent after it is not in these figures)."""
    usage = (status.metrics or {}).get("kv_cache_usage", 0.0)
    costs = status.costs
    return ReplicaLoad(
        running=status.num_running,
        waiting=status.num_waiting,
        kv_usage=float(usage),
        as_of=status.updated_at,
        costs=StepCosts(
            costs.prefill_tokens_per_s, costs.step_s_per_seq, costs.step_base_s,
            costs.queue_wait_s, costs.steps,
        ) if costs is not None else None,
        queued_prefill_tokens=costs.queued_prefill_tokens if costs is not None else 0,
        load_s_per_block=dict(costs.load_s_per_block or {}) if costs is not None else {},
        shared_tier=status.shared_tier.namespace if status.shared_tier is not None else None,
    )  # fmt: skip
