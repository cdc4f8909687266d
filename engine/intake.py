"""The requests stream as the engine loop sees it: a reader task fills a queue (riding out Redis
outages), and the engine loop drains it between steps and sleeps on it when it has nothing to do.

One ledger leads a replica (the lease in `leadership`), and only the leader may take requests
off the stream: an entry Redis hands to a consumer stays pending under it until acked, so a
request read by a ledger that then finds itself deposed would wait for nobody. Hence:

- the reader reads only while the lease is surely held, and blocks no longer than that
  (`Leadership.held_for`): a leader paused past its lease reads nothing when it resumes;
- each leader reads under a consumer name of its own (`ledger-<fencing token>`), and every
  `CLAIM_INTERVAL_S` claims what is pending under any other name (`GroupReader.claim_others`):
  a request that reached a deposed ledger anyway (paused between its lease check and its read)
  is taken over within seconds, not at the next leader change;
- acks are fenced writes (`Leadership.write`): a deposed ledger cannot ack away a request (an
  abort, say) that its successor has yet to see.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from engine.leadership import Leadership
from observability import get_logger
from services.transport import redis_streams
from services.transport.keys import StreamNames

log = get_logger("kvledger.ledger")

GROUP = "ledger"
# How often the leader takes over what other consumers (deposed ledgers) left pending.
CLAIM_INTERVAL_S = 1.0
# A read ends this long before the lease could lapse: Redis hands entries out only while this
# ledger surely leads. Past that point the reader waits for the next renewal.
READ_MARGIN_S = 0.1
MAX_BLOCK_S = 1.0


def consumer_name(token: int) -> str:
    """The leader with fencing token `token` reads under this name."""
    return f"ledger-{token}"


class RequestIntake:
    def __init__(
        self,
        r: aioredis.Redis,
        streams: StreamNames,
        leadership: Leadership,
        on_outage: Callable[[str], None],
    ) -> None:
        self.leadership = leadership
        self.reader = redis_streams.GroupReader(
            r, [streams.requests], GROUP, consumer_name(leadership.token)
        )
        self.queue: asyncio.Queue[redis_streams.Entry] = asyncio.Queue()
        self.event = asyncio.Event()
        self.on_outage = on_outage
        self.claimed = 0  # entries taken over from other consumers after start-up

    async def read_forever(self) -> None:
        reconnect = redis_streams.Reconnect("intake", self.on_outage)
        last_claim = time.monotonic()  # start-up claimed everything already
        while True:
            try:
                entries: list[redis_streams.Entry] = []
                await self._lease_window()
                if time.monotonic() - last_claim >= CLAIM_INTERVAL_S:
                    last_claim = time.monotonic()
                    entries = await self.claim_others()
                if not entries:
                    block_s = await self._lease_window()
                    entries = await self.reader.read(count=256, block_ms=int(block_s * 1000))
            except (RedisError, OSError) as exc:
                await reconnect.failed(exc)
                continue
            reconnect.succeeded()
            self.put(entries)

    async def _lease_window(self) -> float:
        """How long a read may block: until shortly before the lease could lapse. While the
        lease is in doubt (a renewal late or failing, a pause just ended) nothing is read: the
        renewal restores it, or the engine loop finds it lost and stops."""
        margin = min(READ_MARGIN_S, self.leadership.ttl_ms / 10_000)  # a short lease: less
        while (held_s := self.leadership.held_for() - margin) < margin:
            await asyncio.sleep(0.02)
        return min(held_s, MAX_BLOCK_S)

    async def claim_others(self) -> list[redis_streams.Entry]:
        """Entries pending under another consumer: read by a ledger deposed since."""
        entries = await self.reader.claim_others()
        if entries:
            self.claimed += len(entries)
            log.warning(
                "requests_claimed", entries=len(entries), consumer=self.reader.consumer,
                ids=[e.entry_id.decode() for e in entries[:10]],
            )  # fmt: skip
        return entries

    def put(self, entries: Sequence[redis_streams.Entry]) -> None:
        for entry in entries:
            self.queue.put_nowait(entry)
        if entries:
            self.event.set()

    async def ack(self, entries: Sequence[redis_streams.Entry]) -> None:
        """XACK, fenced: a deposed ledger's ack raises LeadershipLost and acks nothing."""
        if not entries:
            return
        ids = [entry.entry_id for entry in entries]
        try:
            await self.leadership.write(("XACK", entries[0].stream, GROUP, *ids))
        except RedisError as exc:
            if "NOGROUP" not in str(exc):  # gone with Redis's data: nothing left to ack
                raise

    def drain(self) -> list[redis_streams.Entry]:
        entries = []
        while not self.queue.empty():
            entries.append(self.queue.get_nowait())
        return entries

    def wake(self) -> None:
        """End the engine loop's idle wait (a status tick, a stop, a crashed task)."""
        self.event.set()

    async def wait(self, timeout: float) -> None:
        self.event.clear()
        if self.queue.empty():
            with contextlib.suppress(TimeoutError):
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
                # that lands as it times out, and the ledger would then never stop.
                async with asyncio.timeout(timeout):
                    await self.event.wait()
