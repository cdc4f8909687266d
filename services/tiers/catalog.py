"""The shared tier's catalog in Redis: which blocks it holds, how many bytes, and what changed.

Every key of one namespace shares a hash slot (`{kvs:<namespace>}`), so one script updates the
catalog atomically on a single server or a Redis Cluster alike:

    <base>:index   sorted set: member = offload key (the block hash + its 4-byte group index,
                   raw bytes), score = when it was last stored or loaded (ms): the LRU order
    <base>:bytes   what the listed blocks take (every rank's value), against the size bound
    <base>:log     stream of changes, `op` s (stored) or r (removed), `n` a sequence number
                   (a follower that sees a gap reloads the index), `k` the keys (each one byte
                   of length, then the key)
    <base>:seq     the log's last sequence number
    <base>:fence   replica -> the highest leader token that wrote: a deposed leader's writes
                   (a lower token for the same replica) are refused
    <base>:origin  key -> the replica that first wrote it (a request's trace names who computed
                   what it loaded); the log's entries carry their writer too (`w`)

A ledger writes what its workers did (`apply`): the blocks they cascaded (committed: listed,
their Redis values kept for good), those a load found missing or corrupt (removed, values
dropped), those loaded again (touched). Past the size bound the script evicts the blocks used
longest ago, whichever replica wrote them, and returns them (a directory's files are then
deleted by the ledger's workers; Redis values go in the script). Routers and ledgers follow
the log from a consistent read of the index (`CatalogFollower`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from services.transport import redis_streams
from services.transport.keys import SharedTierKeys

LOG_MAXLEN = 100_000

_APPLY = """
local fence = tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0')
local token = tonumber(ARGV[2])
if token < fence then return {0} end
if token > fence then redis.call('HSET', KEYS[4], ARGV[1], ARGV[2]) end
local now, max_bytes, bpb = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local tp, dp, maxlen = tonumber(ARGV[6]), ARGV[7], ARGV[8]
local nc, nr = tonumber(ARGV[9]), tonumber(ARGV[10])
local function each_value(k, cmd)
  if dp ~= '' then
    for rank = 0, tp - 1 do redis.call(cmd, dp .. k .. ':r' .. rank) end
  end
end
local function log(op, list)
  if #list == 0 then return end
  local parts = {}
  for _, k in ipairs(list) do parts[#parts + 1] = string.char(#k) .. k end
  local seq = redis.call('INCR', KEYS[5])
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', maxlen, '*', 'op', op, 'n', seq,
             'k', table.concat(parts), 'w', ARGV[1])
end
local function all_values(k)
  if dp == '' then return true end
  for rank = 0, tp - 1 do
    if redis.call('EXISTS', dp .. k .. ':r' .. rank) == 0 then return false end
  end
  return true
end
local added, removed, unlisted = {}, {}, {}
for i = 11, 10 + nc do
  local k = ARGV[i]
  if not all_values(k) then
    -- a value the cascade found there (SET NX) expired or went before this commit: not listed
    unlisted[#unlisted + 1] = k
  elseif redis.call('ZADD', KEYS[1], 'NX', now, k) == 1 then
    added[#added + 1] = k
    redis.call('HSET', KEYS[6], k, ARGV[1])
    each_value(k, 'PERSIST')
  else
    redis.call('ZADD', KEYS[1], 'XX', now, k)
    each_value(k, 'PERSIST')
  end
end
for i = 11 + nc, 10 + nc + nr do
  local k = ARGV[i]
  if redis.call('ZREM', KEYS[1], k) == 1 then removed[#removed + 1] = k end
  redis.call('HDEL', KEYS[6], k)
  each_value(k, 'UNLINK')
end
for i = 11 + nc + nr, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now, ARGV[i]) end
local total = redis.call('INCRBY', KEYS[3], (#added - #removed) * bpb)
local victims = {}
while total > max_bytes do
  local popped = redis.call('ZPOPMIN', KEYS[1], 1)
  if #popped == 0 then break end
  victims[#victims + 1] = popped[1]
  redis.call('HDEL', KEYS[6], popped[1])
  each_value(popped[1], 'UNLINK')
  total = redis.call('DECRBY', KEYS[3], bpb)
end
if total < 0 then redis.call('SET', KEYS[3], 0) end
log('s', added)
for _, k in ipairs(victims) do removed[#removed + 1] = k end
log('r', removed)
local reply = {1, #victims}
for _, k in ipairs(victims) do reply[#reply + 1] = k end
for _, k in ipairs(unlisted) do reply[#reply + 1] = k end
return reply
"""


def connect_tier(url: str) -> aioredis.Redis:
    """A client for a shared tier on a server of its own (`--kv-shared-tier redis:URL`): every
    wait bounded and nothing retried, so a tier that does not answer is a miss (the block is
    recomputed), never a stalled step. Longer than the follower's 1 s blocking read."""
    return redis_streams.connect(
        url, socket_timeout=3.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0)
    )


@dataclass(frozen=True)
class Applied:
    """What a write did besides what it was asked: the blocks it evicted past the size bound,
    and the commits it left out because a rank's Redis value was gone (a value the cascade found
    there expired or was evicted before the commit)."""

    evicted: list[bytes] = field(default_factory=list)
    unlisted: list[bytes] = field(default_factory=list)


class Fenced(Exception):
    """A later leader of this replica has written to the catalog: this one is deposed."""


def unpack_keys(packed: bytes) -> list[bytes]:
    keys, at = [], 0
    while at < len(packed):
        length = packed[at]
        keys.append(packed[at + 1 : at + 1 + length])
        at += 1 + length
    return keys


@dataclass(slots=True)
class CatalogWriter:
    """One replica's writes to the catalog, fenced by its leader token."""

    r: aioredis.Redis
    keys: SharedTierKeys
    replica: str
    max_bytes: int
    tp_size: int = 1
    redis_values: bool = False  # the Redis backend: the script keeps and drops the values
    _script: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._script = self.r.register_script(_APPLY)

    async def lower_fence(self, token: int) -> None:
        """Set this replica's fence to `token`, lower than the one there: only for a leader
        whose token is the latest its replica drew (the fence there came from a token counter
        that has since restarted: a main Redis that lost its data, the tier's kept)."""
        await self.r.hset(self.keys.fence, self.replica, token)

    async def apply(
        self,
        token: int,
        bytes_per_block: int,
        commits: Sequence[bytes] = (),
        removals: Sequence[bytes] = (),
        touches: Sequence[bytes] = (),
    ) -> Applied:
        """Write the changes (see `Applied` for what else it did). Raises Fenced."""
        if not (commits or removals or touches):
            return Applied()
        reply = await self._script(
            keys=self.keys.catalog,
            args=[
                self.replica, token, int(time.time() * 1000), self.max_bytes,
                bytes_per_block * self.tp_size, self.tp_size,
                self.keys.data_prefix if self.redis_values else b"", LOG_MAXLEN,
                len(commits), len(removals), *commits, *removals, *touches,
            ],
        )  # fmt: skip
        if not reply or int(reply[0]) != 1:
            raise Fenced(f"replica {self.replica}: a later leader writes the shared tier")
        num_evicted = int(reply[1])
        keys = [bytes(k) for k in reply[2:]]
        return Applied(keys[:num_evicted], keys[num_evicted:])


@dataclass(slots=True)
class CatalogChange:
    """Keys stored and removed since the last poll; `reloaded`: `stored` is the whole index
    (the follower read it again after a gap in the log), which replaces what the caller holds."""

    stored: list[bytes]
    removed: list[bytes]
    reloaded: bool = False
    origins: dict[bytes, str] = field(default_factory=dict)  # stored key -> its first writer


class CatalogFollower:
    """What the tier holds, kept current: a consistent read of the index, then the log from
    there. `poll` returns the changes since (or, after a gap, the whole index: `reloaded`);
    `restart` makes the next poll read the index again (after a lost connection)."""

    def __init__(self, r: aioredis.Redis, keys: SharedTierKeys) -> None:
        self.r = r
        self.keys = keys
        self.last_id: str = "0-0"
        self.seq = 0
        self.loaded = False

    def restart(self) -> None:
        self.loaded = False

    async def load(self) -> CatalogChange:
        """Every key the index holds (with its writer), and the log position that state is at."""
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.zrange(self.keys.index, 0, -1)
            pipe.hgetall(self.keys.origin)
            pipe.get(self.keys.seq)
            pipe.xrevrange(self.keys.log, "+", "-", count=1)
            members, origins, seq, last = await pipe.execute()
        self.seq = int(seq or 0)
        self.last_id = _id(last[0][0]) if last else "0-0"
        self.loaded = True
        return CatalogChange(
            [bytes(m) for m in members], [], reloaded=True,
            origins={bytes(k): v.decode() for k, v in origins.items()},
        )  # fmt: skip

    async def poll(self, block_ms: int | None = None, count: int = 1000) -> CatalogChange | None:
        """The changes since the last call, None if none; the first time, and after a gap in
        the log (trimmed past this follower), the whole index (`reloaded`)."""
        if not self.loaded:
            return await self.load()
        reply: Any = await self.r.xread({self.keys.log: self.last_id}, count=count, block=block_ms)
        if not reply:
            return None
        last: dict[bytes, bool] = {}  # key -> stored (True) or removed, by its last change
        origins: dict[bytes, str] = {}
        for _stream, entries in reply:
            for entry_id, fields in entries:
                seq = int(fields.get(b"n", b"0"))
                if seq != self.seq + 1:
                    return await self.load()
                self.seq, self.last_id = seq, _id(entry_id)
                stored = fields.get(b"op") == b"s"
                writer = fields.get(b"w", b"").decode()
                for key in unpack_keys(fields.get(b"k", b"")):
                    last[key] = stored
                    if stored:
                        origins.setdefault(key, writer)
        return CatalogChange(
            [key for key, stored in last.items() if stored],
            [key for key, stored in last.items() if not stored],
            origins={key: origins[key] for key, stored in last.items() if stored},
        )


def _id(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


async def catalog_size(r: aioredis.Redis, keys: SharedTierKeys) -> tuple[int, int]:
    """(blocks listed, bytes they take)."""
    async with r.pipeline(transaction=False) as pipe:
        pipe.zcard(keys.index)
        pipe.get(keys.size)
        blocks, size = await pipe.execute()
    return int(blocks or 0), int(size or 0)


def fields_of(keys: Iterable[bytes]) -> bytes:
    """The log's `k` field for `keys` (what the script writes), for tests and tools."""
    return b"".join(bytes([len(k)]) + k for k in keys)
