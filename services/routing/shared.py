"""Gateways that route as one: what each sent where and is pending there, shared through Redis.

Each replica has a routing stream (`StreamNames.routing`, `kvl:{r0}:routing`: the replica's hash
tag, so it lives in the replica's slot beside its requests stream). Every gateway writes there
what it sends the replica (`Routed`: the request's routable blocks, when it was sent, what it
was expected to prefill) and what ended (`RoutedEnded`), and every couple of seconds a heartbeat
listing the requests it still has pending there (`RoutingAlive`). Every gateway, and every
`kvledger indexer`, tails every replica's stream into its router's `PendingRequests`, so a
router counts what the others sent exactly as what it sent itself: the blocks of a request not
finished are held on its replica (precise's pending credit), and a request sent after the
replica's last status is missing from that status's load. Without it, each gateway spreads a
burst of one new prefix on its own, and double counts or misses the others' load.

Nothing outlives a gateway that dies: another's entries expire `SHARED_TTL_S` (6 s) after its
last word on that replica (an entry, a heartbeat every 2 s), checked twice a second, so a dead
gateway leaves nothing booked past 6.5 s; a heartbeat drops whatever it no longer lists
(a release lost on the way). A request still pending after `REPUBLISH_S` is written again, so a
reader that starts late (a restarted gateway, a new indexer) reads the last SHARED_TTL_S of each
stream (stream ids are milliseconds) and finds everything pending. The streams are trimmed to
the last `KEEP_S` on every write and expire when no gateway writes.

Writing never delays a request: `routed` and `ended` queue the entry and a writer task sends
what is queued in one pipeline; readers block on XREAD, so another gateway's decision reaches a
router within a round trip or two.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.routing.policy import PendingRequests
from services.transport import redis_streams
from services.transport.keys import StreamNames
from services.wire import codec
from services.wire.messages import Routed, RoutedEnded, RoutingAlive

log = logging.getLogger(__name__)

SHARED_TTL_S = 6.0  # a silent gateway's entries go this long after its last word
HEARTBEAT_S = 2.0  # three heartbeats missed before another gateway's entries expire
EXPIRE_EVERY_S = 0.5  # so a dead gateway's entries are gone within 6.5 s of its last word
REPUBLISH_S = SHARED_TTL_S / 2
KEEP_S = 60.0
MAX_OUTBOX = 20_000  # entries queued while Redis is down; the oldest go first past this


@dataclass(slots=True)
class RemoteEntry:
    gateway: str
    replica: str
    refreshed: float  # monotonic


class SharedPending:
    """Mirrors every other gateway's pending requests into `pending` and, with a `gateway_id`,
    publishes this gateway's own (those `pending` holds with owner ""); None: read only (the
    indexer)."""

    def __init__(
        self,
        r: aioredis.Redis,
        replicas: Mapping[str, StreamNames],
        pending: PendingRequests,
        gateway_id: str | None,
        *,
        ttl_s: float = SHARED_TTL_S,
        heartbeat_s: float = HEARTBEAT_S,
        on_outage: Callable[[str], None] | None = None,
    ) -> None:
        self.r = r
        self.replicas = dict(replicas)
        self.pending = pending
        self.gateway_id = gateway_id
        self.ttl_s = ttl_s
        self.heartbeat_s = heartbeat_s
        self.on_outage = on_outage
        self.remote: dict[str, RemoteEntry] = {}
        self._by_gateway: dict[tuple[str, str], set[str]] = defaultdict(set)
        self._outbox: list[tuple[str, codec.Message]] = []
        self._ended: dict[str, list[str]] = defaultdict(list)
        self._published: dict[str, float] = {}  # own req_id -> monotonic time last written
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.applied = 0  # entries of other gateways read (for /health and tests)
        self.expired = 0  # remote entries dropped for silence or by a heartbeat

    # --- this gateway's side ----------------------------------------------------------------

    def routed(self, req_id: str) -> None:
        """The router just sent `req_id` (it is in `pending`): tell the others."""
        if self.gateway_id is None:
            return
        entry = self.pending.get(req_id)
        if entry is None:
            return
        self._queue(entry.replica, self._routed_message(req_id))
        self._published[req_id] = time.monotonic()

    def ended(self, req_id: str, replica: str) -> None:
        if self.gateway_id is None:
            return
        if self._published.pop(req_id, None) is None:
            return  # never told anyone
        self._ended[replica].append(req_id)
        self._wake.set()

    def _routed_message(self, req_id: str) -> Routed:
        entry = self.pending.get(req_id)
        assert entry is not None and self.gateway_id is not None
        return Routed(
            gateway_id=self.gateway_id,
            req_id=req_id,
            sent_at=entry.sent_at,
            block_hashes=list(entry.block_hashes),
            prefill_tokens=entry.prefill_tokens,
        )

    def _queue(self, replica: str, msg: codec.Message) -> None:
        self._outbox.append((replica, msg))
        if len(self._outbox) > MAX_OUTBOX:
            del self._outbox[: len(self._outbox) - MAX_OUTBOX]
        self._wake.set()

    # --- lifetime ----------------------------------------------------------------------------

    async def start(self) -> None:
        for replica in self.replicas:
            self._tasks.append(
                asyncio.create_task(self._read(replica), name=f"routing-read-{replica}")
            )
        self._tasks.append(asyncio.create_task(self._upkeep(), name="routing-upkeep"))
        if self.gateway_id is not None:
            self._tasks.append(asyncio.create_task(self._write(), name="routing-write"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.gateway_id is not None:
            # A last heartbeat with nothing pending: the others drop this gateway's entries
            # now rather than SHARED_TTL_S later.
            with contextlib.suppress(RedisError, OSError):
                for replica in self.replicas:
                    self._outbox.append((replica, RoutingAlive(self.gateway_id, [])))
                self._ended.clear()
                await asyncio.wait_for(self._flush(), timeout=2.0)

    # --- writing -----------------------------------------------------------------------------

    async def _write(self) -> None:
        reconnect = redis_streams.Reconnect("routing-write", self.on_outage)
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._flush()
            except (RedisError, OSError) as exc:
                await reconnect.failed(exc)
                self._wake.set()  # what was queued is still queued
                continue
            reconnect.succeeded()

    async def _flush(self) -> None:
        assert self.gateway_id is not None
        outbox, self._outbox = self._outbox, []
        for replica, ids in self._ended.items():
            if ids:
                outbox.append((replica, RoutedEnded(self.gateway_id, ids)))
        ended, self._ended = self._ended, defaultdict(list)
        if not outbox:
            return
        keep_from = f"{int((time.time() - KEEP_S) * 1000)}-0"
        pipe = self.r.pipeline(transaction=False)
        touched = set()
        for replica, msg in outbox:
            stream = self.replicas[replica].routing
            pipe.xadd(
                stream, {redis_streams.FIELD: codec.encode(msg)}, minid=keep_from, approximate=True
            )
            touched.add(stream)
        for stream in touched:
            pipe.pexpire(stream, int(KEEP_S * 1000))
        try:
            await pipe.execute()
        except BaseException:
            self._outbox[:0] = [(r, m) for r, m in outbox if not isinstance(m, RoutedEnded)]
            for replica, ids in ended.items():
                self._ended[replica][:0] = ids
            raise

    # --- reading -----------------------------------------------------------------------------

    async def _read(self, replica: str) -> None:
        stream = self.replicas[replica].routing
        last: bytes | str = f"{int((time.time() - self.ttl_s) * 1000)}-0"
        reconnect = redis_streams.Reconnect(f"routing-read-{replica}", self.on_outage)
        while True:
            try:
                entries = await redis_streams.read_from(self.r, stream, last, block_ms=1000)
            except (RedisError, OSError) as exc:
                await reconnect.failed(exc)
                continue
            reconnect.succeeded()
            for entry_id, fields in entries:
                last = entry_id
                try:
                    msg = codec.decode(fields[redis_streams.FIELD])
                except (codec.WireError, KeyError) as exc:
                    log.warning("routing_entry_unreadable stream=%s error=%s", stream, exc)
                    continue
                self.apply(replica, msg, _entry_age_s(entry_id))

    def apply(self, replica: str, msg: codec.Message, age_s: float = 0.0) -> None:
        """One entry of the replica's routing stream, written `age_s` ago."""
        gateway = getattr(msg, "gateway_id", None)
        if gateway is None or gateway == self.gateway_id:
            return  # this gateway's own word (or not a routing entry)
        refreshed = time.monotonic() - max(age_s, 0.0)
        if isinstance(msg, Routed):
            self.applied += 1
            if time.monotonic() - refreshed >= self.ttl_s:
                return
            self.pending.add(
                msg.req_id, replica, msg.block_hashes, msg.sent_at, msg.prefill_tokens,
                owner=gateway,
            )  # fmt: skip
            self.remote[msg.req_id] = RemoteEntry(gateway, replica, refreshed)
            self._by_gateway[(gateway, replica)].add(msg.req_id)
        elif isinstance(msg, RoutedEnded):
            for req_id in msg.req_ids:
                self._drop(req_id)
        elif isinstance(msg, RoutingAlive):
            listed = set(msg.req_ids)
            for req_id in list(self._by_gateway.get((gateway, replica), ())):
                if req_id in listed:
                    self.remote[req_id].refreshed = max(self.remote[req_id].refreshed, refreshed)
                else:
                    self._drop(req_id)
                    self.expired += 1

    def _drop(self, req_id: str) -> None:
        entry = self.remote.pop(req_id, None)
        if entry is None:
            return
        self.pending.release(req_id)
        ids = self._by_gateway.get((entry.gateway, entry.replica))
        if ids is not None:
            ids.discard(req_id)
            if not ids:
                del self._by_gateway[(entry.gateway, entry.replica)]

    # --- heartbeats and expiry ---------------------------------------------------------------

    async def _upkeep(self) -> None:
        beat = time.monotonic()
        while True:
            await asyncio.sleep(min(EXPIRE_EVERY_S, self.heartbeat_s, self.ttl_s / 4))
            self.expire()
            if self.gateway_id is not None and time.monotonic() - beat >= self.heartbeat_s:
                beat = time.monotonic()
                self.heartbeat()

    def expire(self) -> int:
        """Drop the entries of gateways silent for ttl_s: they died, or lost Redis."""
        limit = time.monotonic() - self.ttl_s
        gone = [req_id for req_id, entry in self.remote.items() if entry.refreshed < limit]
        for req_id in gone:
            self._drop(req_id)
        self.expired += len(gone)
        return len(gone)

    def heartbeat(self) -> None:
        """This gateway's pending requests on each replica; the long ones written again."""
        assert self.gateway_id is not None
        now = time.monotonic()
        for replica in self.replicas:
            mine = self.pending.ids_on(replica, owner="")
            self._queue(replica, RoutingAlive(self.gateway_id, mine))
            for req_id in mine:
                published = self._published.get(req_id)
                if published is not None and now - published >= REPUBLISH_S:
                    self._queue(replica, self._routed_message(req_id))
                    self._published[req_id] = now
        # Requests dropped without a release (the pending table's capacity): forget them.
        for req_id in [r for r in self._published if self.pending.get(r) is None]:
            del self._published[req_id]

    def num_remote(self) -> int:
        return len(self.remote)


def _entry_age_s(entry_id: bytes | str) -> float:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return max(time.time() - int(text.split("-", 1)[0]) / 1000.0, 0.0)
