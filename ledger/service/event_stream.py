"""The KV-events stream and its snapshot in Redis.

Each batch is one stream entry (field `batch`, vLLM's bytes). The snapshot of the cached blocks
is written right after a batch by the only writer of the stream, so it is exactly the state as
of that entry's id: a subscriber loads it and reads the stream from that id on.
"""

from __future__ import annotations

import time
from typing import cast

import msgpack
import redis.asyncio as aioredis

from ledger.core.block_pool import BlockPool
from ledger.core.events import AnyKVCacheEvent, KVEventBatch, encode_batch
from ledger.core.hashing import to_event_hash
from services.config import StreamNames


class KVEventStream:
    def __init__(
        self,
        r: aioredis.Redis,
        streams: StreamNames,
        *,
        maxlen: int,
        snapshot_interval_s: float,
        block_size: int,
        hash_algo: str,
    ) -> None:
        self.r = r
        self.streams = streams
        self.maxlen = maxlen
        self.snapshot_interval_s = snapshot_interval_s
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.last_id: bytes | None = None
        self.published = 0
        self._last_snapshot = 0.0

    async def publish(self, events: list[AnyKVCacheEvent], pool: BlockPool, epoch: str) -> int:
        """Append one batch (nothing when there are no events); returns how many events."""
        if not events:
            return 0
        batch = encode_batch(KVEventBatch(time.time(), events))
        self.last_id = cast(
            bytes,
            await self.r.xadd(
                self.streams.events, {b"batch": batch}, maxlen=self.maxlen, approximate=True
            ),
        )
        self.published += len(events)
        if time.monotonic() - self._last_snapshot >= self.snapshot_interval_s:
            await self.write_snapshot(pool, epoch)
        return len(events)

    async def write_snapshot(self, pool: BlockPool, epoch: str) -> None:
        counts: dict[int, int] = {}
        for block in pool.blocks:
            if block.block_hash is not None:
                key = to_event_hash(block.block_hash)
                counts[key] = counts.get(key, 0) + 1
        snapshot = {
            "epoch": epoch,
            "stream_id": (self.last_id or b"0-0").decode(),
            "block_size": self.block_size,
            "hash_algo": self.hash_algo,
            "hashes": [[h, n] for h, n in counts.items()],
            "written_at": time.time(),
        }
        await self.r.set(self.streams.events_snapshot, msgpack.packb(snapshot))
        self._last_snapshot = time.monotonic()
