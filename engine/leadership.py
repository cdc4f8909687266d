"""Exactly one ledger leads a replica: a lease in Redis, renewed, with a fencing token.

Two ledgers on one replica would both schedule the same requests onto the same workers (each
step of one resets the workers' state for the other). So a ledger first takes the lease key
(`SET key holder NX PX ttl`); one that finds it taken stands by and tries again until the
holder's lease expires. On taking it, the leader draws a token from a counter that only grows
(`INCR`) and puts it on every step; workers drop steps with a token below the highest they have
seen, and the leader drops results that carry another token. The token is what protects the
workers from a leader that was paused past its lease (SIGSTOP, a long GC, a VM migration): it
cannot know it was paused until it runs again, and by then a newer token is on the stream.

The leader also keeps a local deadline: the lease counts as held only until `ttl` after the
start of the last renewal that succeeded, measured on the monotonic clock, so a resumed leader
sees at once that its lease may have passed to another and renews it before it steps: it goes on
if nobody took the lease (its Redis was paused or restarted) and stops if a successor did.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from typing import Any, NoReturn, Protocol, cast

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from observability import get_logger
from services.transport import redis_streams
from services.transport.keys import StreamNames

log = get_logger("kvledger.ledger")

# Renew or give back only a lease this holder still holds: a lease that expired and went to
# another ledger must not be extended or deleted by the old holder.
# A lease that is simply gone (Redis restarted without its data, or it expired while Redis was
# away and nobody took it) is taken again, and the token counter is put back to at least this
# leader's token: a counter restarted from 0 would hand a later leader a token the workers drop.
_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return 1
end
if holder == false then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[3]) then
        redis.call('SET', KEYS[2], ARGV[3])
    end
    return 2
end
return 0
"""
# A leader's write happens only while no later leader has drawn a token: the check and the
# commands are one script, so a leader paused between its lease check and its write (SIGSTOP, a
# long GC) cannot write once a successor holds the replica. KEYS[1] is the token counter, each
# further key is one command's: ARGV holds the token, then per command its name, the count of
# its other arguments and those arguments. Returns nil when fenced off, else every reply.
_FENCED = """
if tonumber(redis.call('GET', KEYS[1]) or '0') > tonumber(ARGV[1]) then
    return false
end
local replies, a = {}, 2
for k = 2, #KEYS do
    local n = tonumber(ARGV[a + 1])
    local args = {ARGV[a], KEYS[k]}
    for j = 1, n do
        args[j + 2] = ARGV[a + 1 + j]
    end
    a = a + 2 + n
    replies[k - 1] = redis.call(unpack(args))
end
return replies
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


# From this many bytes of arguments on, `write_bulk` fences with a transaction, not the script.
BULK_BYTES = 64 * 1024


class LeadershipLost(RuntimeError):
    """The lease ran out or went to another ledger: this ledger must not step again."""


# One Redis command whose first argument is its key, e.g. ("SET", key, value, "PX", 5000).
Op = tuple[Any, ...]


class Writer(Protocol):
    """How a part of the engine writes to Redis: `Leadership` fences every write with the
    leader's token; `Unfenced` (a component used on its own: tests, benchmarks) does not."""

    async def write(self, *ops: Op) -> list[Any]: ...

    async def write_bulk(self, *ops: Op) -> list[Any]:
        """`write` for commands carrying large values (a bridge appending a backlog of vLLM's
        ~24 KB batches): the same guarantee, another mechanism."""
        ...


class Unfenced:
    def __init__(self, r: aioredis.Redis) -> None:
        self.r = r

    async def write(self, *ops: Op) -> list[Any]:
        async with self.r.pipeline(transaction=False) as pipe:
            for op in ops:
                pipe.execute_command(*op)
            return await pipe.execute()

    async def write_bulk(self, *ops: Op) -> list[Any]:
        return await self.write(*ops)


class Leadership:
    def __init__(self, r: aioredis.Redis, streams: StreamNames, ttl_s: float) -> None:
        self.r = r
        self.key = streams.leader
        self.token_key = streams.leader_token
        self.ttl_ms = max(int(ttl_s * 1000), 100)
        self.holder = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.token = 0
        self.standing_by = False
        self.leader_seen: str | None = None  # the holder this standby waits for
        self._valid_until = 0.0
        self._lost = False
        self._fenced = r.register_script(_FENCED)

    def held(self) -> bool:
        return not self._lost and time.monotonic() < self._valid_until

    def held_for(self) -> float:
        """Seconds the lease is still surely ours (0 once in doubt): what Redis hands this
        ledger within them (a blocking read), it hands to the leader."""
        if self._lost:
            return 0.0
        return max(self._valid_until - time.monotonic(), 0.0)

    @property
    def lost(self) -> bool:
        """A successor holds the lease: this ledger never writes again."""
        return self._lost

    async def ensure(self) -> None:
        """Return once the lease is surely ours; LeadershipLost if another ledger holds it.

        Past the local deadline (this ledger or its Redis was paused, or Redis was away) the
        lease is renewed before anything else is written: taken again if nobody holds it, lost
        if a successor does. A ledger paused past its lease stops here."""
        if self.held():
            return
        if self._lost:
            raise LeadershipLost(f"the ledger lease {self.key} is no longer held by {self.holder}")
        await self.renew()

    async def acquire(self, stopping: asyncio.Event) -> int:
        """Wait until this ledger holds the lease; return its fencing token."""
        announced = 0.0
        down_since: float | None = None  # one line when an outage begins, one when it ends
        attempts = 0
        while not stopping.is_set():
            started = time.monotonic()
            try:
                acquired = await self.r.set(self.key, self.holder, nx=True, px=self.ttl_ms)
                if down_since is not None:
                    log.info(
                        "redis_reconnected", loop="leadership",
                        down_s=round(started - down_since, 3), attempts=attempts,
                    )  # fmt: skip
                    down_since, attempts = None, 0
                if acquired:
                    self.token = int(await self.r.incr(self.token_key))
                    self._valid_until = started + self.ttl_ms / 1000
                    self._lost = False
                    self.standing_by = False
                    log.info("leader_elected", holder=self.holder, fence=self.token, key=self.key)
                    return self.token
                leader = await self.r.get(self.key)
                self.leader_seen = leader.decode() if isinstance(leader, bytes) else leader
            except aioredis.ConnectionError as exc:
                if not redis_streams.is_unavailable(exc):
                    raise  # a wrong password: waiting would never end
                if down_since is None:
                    down_since = started
                    log.warning("redis_unavailable", loop="leadership", error=str(exc))
                attempts += 1
            self.standing_by = True
            if down_since is None and time.monotonic() - announced > 30:
                log.info("standing_by", leader=self.leader_seen, key=self.key, holder=self.holder)
                announced = time.monotonic()
            await asyncio.sleep(self.ttl_ms / 3000)
        raise asyncio.CancelledError

    async def append_fenced(self, stream: str, field: bytes, value: bytes, maxlen: int) -> bytes:
        """XADD to a stream of this replica unless a later leader drew a token (`write`)."""
        (entry_id,) = await self.write(("XADD", stream, "MAXLEN", "~", maxlen, "*", field, value))
        return cast(bytes, entry_id)

    async def write(self, *ops: Op) -> list[Any]:
        """Run the commands (on keys of this replica: the token key's hash tag) unless a later
        leader drew a token; LeadershipLost then, and nothing is written. The lease check before
        a write can pass just before the process is paused; this check cannot, being the write
        itself. Every write of the leader goes through here: steps, outputs, KV events, the
        snapshot, the status key, acks of the requests stream."""
        keys: list[Any] = [self.token_key]
        args: list[Any] = [self.token]
        for op in ops:
            keys.append(op[1])
            args.extend((op[0], len(op) - 2, *op[2:]))
        replies = await self._fenced(keys=keys, args=args)
        if replies is None:
            self._lose(f"a later leader than fence {self.token} holds {self.key}")
        return cast(list[Any], replies)

    async def write_bulk(self, *ops: Op) -> list[Any]:
        """`write`, fenced by a transaction instead of the script: WATCH the token counter, read
        it, and run the commands in MULTI/EXEC, which Redis refuses if the counter moved since
        the WATCH. Two round trips instead of one, but the script copies every argument into
        Lua and back: on 24 KB XADDs Redis spent ~60-75 us a command in the script against
        ~15-20 us in a transaction, three times the work for the same append. A counter moved
        by this leader's own renewal (`_RENEW` after Redis lost it) only makes it try again.
        Writes under BULK_BYTES go through the script all the same: for them the two extra
        round trips cost the writer more than the copies cost Redis (a bridge forwarding one
        batch at a time, 20k events/s: +~130 us of the bridge's CPU per batch)."""
        size = 0
        for op in ops:
            for arg in op:
                if isinstance(arg, bytes | str):
                    size += len(arg)
        if size < BULK_BYTES:
            return await self.write(*ops)
        while True:
            async with self.r.pipeline(transaction=True) as pipe:
                await pipe.watch(self.token_key)
                if int(await pipe.get(self.token_key) or 0) > self.token:
                    self._lose(f"a later leader than fence {self.token} holds {self.key}")
                pipe.multi()
                for op in ops:
                    pipe.execute_command(*op)
                try:
                    return await pipe.execute()
                except WatchError:
                    continue  # nothing was written: check the counter again

    async def renew_forever(self) -> None:
        """Extend the lease every third of its TTL; raise LeadershipLost once another holds it."""
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            try:
                await self.renew()
            except aioredis.ConnectionError as exc:
                # Keep trying: the local deadline runs out on its own if Redis stays away.
                log.warning("lease_renewal_failed", error=str(exc), held=self.held())

    async def renew(self) -> None:
        """Extend the lease now (or take it again if it is gone); LeadershipLost if another
        ledger holds it. After a Redis outage the engine calls this before it steps again."""
        started = time.monotonic()
        renewed = await self.r.eval(
            _RENEW, 2, self.key, self.token_key, self.holder, self.ttl_ms, self.token
        )
        if not renewed:
            self._lose(f"the ledger lease {self.key} went to another ledger")
        if renewed == 2:
            log.warning("lease_retaken", holder=self.holder, fence=self.token, key=self.key)
        self._valid_until = started + self.ttl_ms / 1000

    def _lose(self, reason: str) -> NoReturn:
        """A successor holds the replica: this ledger never steps again."""
        self._lost = True
        log.error("leadership_lost", holder=self.holder, fence=self.token, key=self.key)
        raise LeadershipLost(reason)

    async def release(self) -> None:
        """Give the lease back at a clean stop, so a standby takes over without waiting."""
        if self.token and not self._lost:
            try:
                await self.r.eval(_RELEASE, 1, self.key, self.holder)
            except aioredis.RedisError as exc:
                log.warning("lease_release_failed", error=str(exc))
