"""Worker registration and liveness through expiring keys.

A worker keeps `StreamNames.worker(group, worker_id)` set to its WorkerHello with a short TTL and
refreshes it as a heartbeat; the key vanishing means the worker is gone. A restarted worker
writes a new `started_at`, so the ledger tells a restart from a heartbeat.
"""

from __future__ import annotations

import threading
from typing import cast

import redis
import redis.asyncio as aioredis
import structlog

from services.transport.keys import StreamNames
from services.transport.redis_client import connect_sync
from services.wire import codec
from services.wire.messages import WorkerHello


def _registration(streams: StreamNames, hello: WorkerHello) -> tuple[str, bytes]:
    """The key and the value a worker keeps alive."""
    return streams.worker(hello.group, hello.worker_id), codec.encode(hello)


async def register(
    r: aioredis.Redis, streams: StreamNames, hello: WorkerHello, ttl_s: float
) -> None:
    await r.set(*_registration(streams, hello), px=int(ttl_s * 1000))


class Heartbeat:
    """Keeps a worker's registration alive from a thread of its own, on a connection of its own.

    The worker computes a step on its event loop's thread (no hand-off to a compute thread, no
    GIL contention with the loop while Redis answers); a step longer than the TTL must still not
    read as a lost worker, so the beat does not depend on that loop. Each beat is one SET.
    """

    def __init__(
        self, url: str, streams: StreamNames, hello: WorkerHello, ttl_s: float, every_s: float
    ) -> None:
        self.url, self.streams, self.hello = url, streams, hello
        self.ttl_s, self.every_s = ttl_s, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops beating; returns once no beat can land any more (unregistering is safe then),
        or after one beat's timeout where Redis hangs."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.ttl_s)

    def _run(self) -> None:
        log = structlog.get_logger("kvledger.worker")
        # A hung Redis fails a beat after ttl_s (the key is gone by then anyway) instead of
        # holding this thread, and the worker's stop, forever.
        client = connect_sync(
            self.url, socket_timeout=self.ttl_s, socket_connect_timeout=self.ttl_s
        )
        key, value = _registration(self.streams, self.hello)
        try:
            while not self._stop.wait(self.every_s):
                try:
                    client.set(key, value, px=int(self.ttl_s * 1000))
                except redis.RedisError as exc:
                    log.warning("heartbeat_failed", error=str(exc))
        finally:
            client.close()


async def unregister(r: aioredis.Redis, streams: StreamNames, hello: WorkerHello) -> None:
    await r.delete(streams.worker(hello.group, hello.worker_id))


async def live_workers(
    r: aioredis.Redis, streams: StreamNames, group: str
) -> dict[str, WorkerHello]:
    """Every worker of the group whose heartbeat key is alive (malformed keys are skipped)."""
    workers: dict[str, WorkerHello] = {}
    async for key in r.scan_iter(match=streams.worker(group, "*"), count=100):
        data = cast("bytes | None", await r.get(key))
        if data is None:
            continue
        try:
            hello = codec.decode(data, WorkerHello)
        except codec.WireError:
            continue
        workers[hello.worker_id] = hello
    return workers


async def known_replicas(r: aioredis.Redis, prefix: str) -> list[str]:
    """The replicas whose ledger publishes KV events under `prefix` (a SCAN, which visits every
    master of a cluster): what `kvledger events` and `kvledger indexer` offer when the replica
    they were given has none."""
    pattern = StreamNames(prefix, "*").events
    head, tail = f"{prefix}:{{", "}:kv-events"
    names = set()
    async for key in r.scan_iter(match=pattern, count=100):
        text = key.decode() if isinstance(key, bytes) else key
        if text.startswith(head) and text.endswith(tail):
            names.add(text[len(head) : -len(tail)])
    return sorted(names)
