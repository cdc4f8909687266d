"""Redis Streams transport: connecting, appending, consumer groups, acks and dead letters.

Conventions: a message is one stream entry with a single field `m` holding the wire bytes
(`services.wire.codec`); KV events use field `batch`. Readers ack an entry only after its work is
done. An entry that does not parse is copied to the dead-letter stream (truncated, with the error
and the source stream), deleted from its source and acked, so one bad producer cannot wedge a
service nor fill Redis.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast, overload

import redis.asyncio as aioredis
import structlog
from redis.exceptions import AuthenticationError, AuthorizationError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.transport import redis_client
from services.transport.keys import DEAD_LETTERS_MAXLEN, REQUESTS_MAXLEN
from services.wire import codec

log = logging.getLogger(__name__)
outage_log = structlog.get_logger("kvledger.redis")

# What a Redis restart, pause or network cut raises: worth retrying, unlike a wrong command.
UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


def is_unavailable(exc: BaseException) -> bool:
    """A lost connection, or a Redis still loading its data after a restart. A wrong password
    or a user without the rights is not: waiting would never end, so it fails at once."""
    if isinstance(exc, AuthenticationError | AuthorizationError):
        return False
    if isinstance(exc, UNAVAILABLE):
        return True
    return isinstance(exc, ResponseError) and str(exc).startswith("LOADING")


def is_nogroup(exc: BaseException) -> bool:
    """The stream or its consumer group is gone: Redis came back without its data."""
    return isinstance(exc, ResponseError) and str(exc).startswith("NOGROUP")


T = TypeVar("T")


class Reconnect:
    """A loop's way through a Redis outage: capped exponential backoff between attempts, one
    log line when the outage begins and one when it ends (not one per attempt), and
    `on_outage(loop)` once per outage for a metric.

        except RedisError as exc:
            await reconnect.failed(exc)   # re-raises what retrying cannot fix
            continue
        reconnect.succeeded()
    """

    def __init__(
        self,
        loop: str,
        on_outage: Callable[[str], None] | None = None,
        min_delay_s: float = 0.05,
        max_delay_s: float = 2.0,
    ) -> None:
        self.loop = loop
        self.on_outage = on_outage
        self.min_delay_s = min_delay_s
        self.max_delay_s = max_delay_s
        self.delay_s = 0.0
        self.down_since: float | None = None
        self.attempts = 0

    @property
    def down(self) -> bool:
        return self.down_since is not None

    async def failed(self, exc: BaseException) -> None:
        if not is_unavailable(exc):
            raise exc
        if self.down_since is None:
            self.down_since = time.monotonic()
            outage_log.warning("redis_unavailable", loop=self.loop, error=str(exc) or repr(exc))
            if self.on_outage is not None:
                self.on_outage(self.loop)
        self.attempts += 1
        self.delay_s = min(max(self.delay_s * 2, self.min_delay_s), self.max_delay_s)
        await asyncio.sleep(self.delay_s)

    def succeeded(self) -> None:
        if self.down_since is not None:
            outage_log.info(
                "redis_reconnected",
                loop=self.loop,
                down_s=round(time.monotonic() - self.down_since, 3),
                attempts=self.attempts,
            )
        self.down_since, self.delay_s, self.attempts = None, 0.0, 0

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """`await fn()` again (after the backoff) until Redis is reachable for all of it: for
        start-up, where a service may come up before its Redis does."""
        while True:
            try:
                result = await fn()
            except (RedisError, OSError) as exc:
                await self.failed(exc)
                continue
            self.succeeded()
            return result

    async def until_up(self, r: aioredis.Redis) -> None:
        """PING with backoff until Redis answers."""
        while True:
            try:
                await r.ping()
            except (RedisError, OSError) as exc:
                await self.failed(exc)
                continue
            self.succeeded()
            return


M = TypeVar("M", bound=codec.Message)

FIELD = b"m"


def connect(url: str, **kwargs: Any) -> aioredis.Redis:
    """One Redis server or a Redis Cluster, by the URL's scheme (services.transport.redis_client)."""
    return redis_client.connect(url, **kwargs)


def connect_pooled(
    url: str, max_connections: int, pool_timeout_s: float, **kwargs: Any
) -> aioredis.Redis:
    """A client whose commands wait up to `pool_timeout_s` for one of `max_connections`
    connections: redis-py's default pool fails a command past 100 connections instead, which
    turned a burst of concurrent requests into errors. A cluster client keeps a pool per node
    with no such cap, so it is built as any other."""
    if redis_client.is_cluster_url(url):
        return redis_client.connect(url, **kwargs)
    redis_client.client_options(kwargs)
    kwargs.setdefault("socket_timeout", None)
    kwargs.setdefault("socket_connect_timeout", 5)
    kwargs.setdefault("health_check_interval", 30)
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=pool_timeout_s,
        decode_responses=False,
        **kwargs,
    )
    return aioredis.Redis.from_pool(pool)


async def append(
    r: aioredis.Redis, stream: str, msg: codec.Message, maxlen: int | None = REQUESTS_MAXLEN
) -> bytes:
    """XADD one wire message; approximate MAXLEN trimming keeps the stream bounded cheaply."""
    # redis-py types replies as bytes | str; this client never decodes them.
    return cast(
        bytes, await r.xadd(stream, {FIELD: codec.encode(msg)}, maxlen=maxlen, approximate=True)
    )


@dataclass(slots=True)
class Entry:
    stream: str
    entry_id: bytes
    fields: dict[bytes, bytes]


# A dead letter keeps this much of each field of the bad entry, with the field's size and
# SHA-256: enough to see what it was and to match it with a producer's log, while 10,000 dead
# letters stay within ~20 MB however large the entries were (61 whole ones once took 202 MB).
DEAD_LETTER_PREFIX_BYTES = 1024
DEAD_LETTER_MAXLEN = DEAD_LETTERS_MAXLEN


async def dead_letter(r: aioredis.Redis, dead_stream: str, entry: Entry, error: str) -> None:
    """Copy a bad entry (truncated) to the dead letters, then delete it from its source
    stream: left there whole, one 10 MB entry held 10 MB of Redis until trimming reached it,
    and every other reader of that stream would dead-letter it again."""
    fields: dict[Any, Any] = {
        b"source_stream": entry.stream.encode(),
        b"source_id": entry.entry_id,
        b"error": error.encode()[:DEAD_LETTER_PREFIX_BYTES],
    }
    for key, value in list(entry.fields.items())[:16]:
        key = key[:64]
        fields[b"orig:" + key] = value[:DEAD_LETTER_PREFIX_BYTES]
        fields[b"size:" + key] = str(len(value)).encode()
        fields[b"sha256:" + key] = hashlib.sha256(value).hexdigest().encode()
    await r.xadd(dead_stream, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
    # A consumer group's pending list may still name it: a read hands it out as deleted (no
    # fields), which GroupReader acks. The caller acks it as before.
    await r.xdel(entry.stream, entry.entry_id)
    log.warning(
        "dead_letter stream=%s id=%s error=%s", entry.stream, entry.entry_id.decode(), error
    )


@overload
def decode_entry(entry: Entry) -> codec.Message: ...
@overload
def decode_entry(entry: Entry, expect: type[M]) -> M: ...
def decode_entry(entry: Entry, expect: type[M] | None = None) -> codec.Message:
    data = entry.fields.get(FIELD)
    if data is None:
        raise codec.WireError(f"field '{FIELD.decode()}': missing from the stream entry")
    return codec.decode(data) if expect is None else codec.decode(data, expect)


# Delete a consumer only if nothing is pending under it: XGROUP DELCONSUMER drops its pending
# entries, and one read between a check and the delete would be lost.
_DELETE_IF_EMPTY = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) == 0 then
    return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
end
return -1
"""


class GroupReader:
    """One consumer in a consumer group on one or more streams.

    On start it first re-reads this consumer's own pending entries (delivered before a crash but
    never acked), then new ones. `claim_stale` takes over entries a dead consumer left pending.
    """

    def __init__(
        self, r: aioredis.Redis, streams: Sequence[str], group: str, consumer: str
    ) -> None:
        self.r = r
        self.streams = list(streams)
        self.group = group
        self.consumer = consumer
        self._pending_cursor: dict[str, str | None] = {}
        self.reread_pending()  # a consumer starts with what it was handed before a restart

    async def ensure_groups(self, start_id: str = "0") -> None:
        for stream in self.streams:
            try:
                await self.r.xgroup_create(stream, self.group, id=start_id, mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def reread_pending(self) -> None:
        """The next reads hand out this consumer's pending entries again first: after a broken
        connection an entry may have been delivered (and kept pending) while its reply was lost."""
        self._pending_cursor = {s: "0" for s in self.streams}

    async def read(self, count: int = 128, block_ms: int | None = 1000) -> list[Entry]:
        try:
            return await self._read_pending_then_new(count, block_ms)
        except ResponseError as exc:
            if not is_nogroup(exc):
                raise
            # Redis came back without its data: the group (and whatever it held) is gone. A
            # new group from the stream's start reads everything appended since the loss.
            outage_log.warning("consumer_group_recreated", group=self.group, streams=self.streams)
            await self.ensure_groups("0")
            self._pending_cursor = {s: None for s in self.streams}
            return []

    async def _read_pending_then_new(self, count: int, block_ms: int | None) -> list[Entry]:
        # First one pass over this consumer's pending list (entries delivered before a restart
        # and never acked), paging by id so that each is handed out once, then new entries.
        pending = {s: c for s, c in self._pending_cursor.items() if c is not None}
        if pending:
            seen: dict[str, bytes] = {}
            entries = await self._read(pending, count, None, seen)
            for stream in pending:
                self._pending_cursor[stream] = seen[stream].decode() if stream in seen else None
            if entries:
                return entries
        return await self._read({s: ">" for s in self.streams}, count, block_ms)

    async def _read(
        self,
        ids: dict[str, str],
        count: int,
        block_ms: int | None,
        seen: dict[str, bytes] | None = None,
    ) -> list[Entry]:
        streams: dict[Any, Any] = dict(ids)
        reply = await self.r.xreadgroup(
            self.group, self.consumer, streams, count=count, block=block_ms
        )
        entries = []
        for stream, items in normalize_reply(reply):
            for entry_id, fields in items:
                if seen is not None:
                    seen[stream] = entry_id
                if fields is None:  # pending entry trimmed away meanwhile: nothing to redo
                    await self.r.xack(stream, self.group, entry_id)
                    continue
                entries.append(Entry(stream, entry_id, fields))
        return entries

    async def ack(self, entries: Sequence[Entry]) -> None:
        by_stream: dict[str, list[bytes]] = {}
        for entry in entries:
            by_stream.setdefault(entry.stream, []).append(entry.entry_id)
        for stream, ids in by_stream.items():
            try:
                await self.r.xack(stream, self.group, *ids)
            except ResponseError as exc:
                if not is_nogroup(exc):  # gone with Redis's data: nothing left to ack
                    raise

    async def claim_others(self, count: int = 256) -> list[Entry]:
        """Take over every entry pending under another consumer of the group (one that no
        longer reads: a deposed leader), then delete that consumer if nothing is pending under
        it any more (checked and deleted in one script: an entry it reads meanwhile stays
        pending under it, for the next pass). Cheap when there is nothing to take: one XPENDING
        summary per stream."""
        claimed: list[Entry] = []
        for stream in self.streams:
            try:
                summary = await self.r.xpending(stream, self.group)
            except ResponseError as exc:
                if is_nogroup(exc):
                    continue  # read() re-creates the group
                raise
            for row in summary.get("consumers") or []:
                name = row["name"].decode() if isinstance(row["name"], bytes) else row["name"]
                if name == self.consumer:
                    continue
                for _ in range(int(row["pending"]) // count + 1):
                    pending = await self.r.xpending_range(
                        stream, self.group, "-", "+", count, consumername=name
                    )
                    if not pending:
                        break
                    ids: list[Any] = [p["message_id"] for p in pending]
                    reply: Any = await self.r.xclaim(stream, self.group, self.consumer, 0, ids)
                    got = {entry_id: fields for entry_id, fields in reply if fields}
                    claimed.extend(Entry(stream, i, f) for i, f in got.items())
                    if gone := [i for i in ids if i not in got]:  # trimmed away: nothing to do
                        await self.r.xack(stream, self.group, *gone)
                await self.r.eval(_DELETE_IF_EMPTY, 1, stream, self.group, name)
        return claimed

    async def claim_stale(self, min_idle_ms: int, count: int = 100) -> list[Entry]:
        """XAUTOCLAIM every entry idle for `min_idle_ms` in the group's pending lists (paging
        through them all); they become this consumer's pending entries."""
        claimed: list[Entry] = []
        for stream in self.streams:
            cursor: bytes | str = "0-0"
            while True:
                reply = await self.r.xautoclaim(
                    stream, self.group, self.consumer, min_idle_ms, cursor, count=count
                )
                claimed.extend(
                    Entry(stream, entry_id, fields) for entry_id, fields in reply[1] if fields
                )
                cursor = reply[0]
                if cursor in (b"0-0", "0-0"):
                    break
        return claimed


def normalize_reply(reply: Any) -> list[tuple[str, list]]:
    # redis-py answers XREAD(GROUP) as a list of [stream, entries] under RESP2, a dict under RESP3.
    if not reply:
        return []
    items = reply.items() if isinstance(reply, dict) else reply
    return [(s.decode() if isinstance(s, bytes) else s, entries) for s, entries in items]


async def read_from(
    r: aioredis.Redis,
    stream: str,
    last_id: bytes | str,
    count: int = 256,
    block_ms: int | None = 1000,
) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Plain XREAD (no group) after `last_id`: for readers that keep their own position."""
    reply = await r.xread({stream: last_id}, count=count, block=block_ms)
    out = []
    for _, items in normalize_reply(reply):
        out.extend(items)
    return out
