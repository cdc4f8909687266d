"""The KV-events stream and its snapshot in Redis.

Each batch is one stream entry: field `batch`, vLLM's bytes, and field `hashes`, the same
batch's block hashes in runs for prefix indexes (`services/events/runs.py`). The stream keeps a
mirror of the cached blocks (event hash -> physical blocks) by applying every batch it publishes
(its runs), so a snapshot is the mirror as of one entry id: a subscriber loads it and reads the
stream from that id on. Periodic snapshots never stall the engine loop: they run as a background
task that packs the mirror in chunks, yielding between them, while batches published meanwhile
go to an overlay that is merged back when the snapshot is written.

Each entry also carries its sequence number (field `seq`), the batch's number over ZMQ
(`engine/zmq_events.py`): a ledger that starts reads the last entry's and goes on from it, so the
sequence runs on across restarts and failovers, and the snapshot records the number of its entry.

The stream is capped by memory, not by a count: entries vary in size (a batch of one removal
is tens of bytes, a long prefill's stored blocks kilobytes), so the MAXLEN of each XADD is the
budget divided by the average entry seen so far (payload plus Redis' per-entry overhead).

Every write that others read (a batch, the snapshot) goes through the engine's `Writer`: the
leader's fenced write, so a deposed ledger (paused past its lease) publishes nothing over its
successor's events, the background snapshot writer included, whose write lands after its
encoding thread returns.

budget divided by what an entry costs Redis: at first the average payload seen so far plus a
fixed overhead, then, every CALIBRATE_EVERY batches, what Redis reports (MEMORY USAGE over
XLEN). The fixed overhead alone let the stream run ~15-18% past its budget with entries of a
few kilobytes, which the allocator keeps in size classes hundreds of bytes larger.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from array import array
from collections.abc import Callable, Sequence
from itertools import islice
from typing import cast

import redis.asyncio as aioredis

from engine.leadership import LeadershipLost, Unfenced, Writer
from ledger.block_pool import BlockPool
from ledger.events import AnyKVCacheEvent, KVEventBatch, encode_batch
from ledger.hashing import to_event_hash
from services.events.runs import (
    HASHES_FIELD,
    SEQ_FIELD,
    Run,
    apply_runs,
    batch_runs,
    encode_runs,
)
from services.events.snapshot import CLEARED, STORED, KVSnapshot, encode_snapshot, pack_arrays
from services.transport.keys import StreamNames

# Before the first entry: the size measured under load (a few stored blocks per batch: ~1.9 KB
# of `batch`, ~0.2 KB of `hashes`).
ASSUMED_ENTRY_BYTES = 2100
# Redis' own cost per stream entry (id, field name, listpack bookkeeping), measured with
# MEMORY USAGE (tests/engine/test_redis_bounds.py: ~440 bytes per ~330-byte entry).
ENTRY_OVERHEAD_BYTES = 110
MIN_MAXLEN = 1000  # subscribers catching up need some history, whatever the budget
# How often the cost of an entry is read back from Redis (one pipelined round trip), and how
# many of the stream's nodes MEMORY USAGE samples for it.
CALIBRATE_EVERY = 256
CALIBRATE_SAMPLES = 64

log = logging.getLogger(__name__)
Entry = tuple[bytes, dict[bytes, bytes]]

# Entries packed between two yields to the loop: about 2 ms of array building on a slow core.
SNAPSHOT_CHUNK = 50_000
# The snapshot goes to Redis in parts of this size, each its own command: one SET of 12 MB
# (1M cached blocks) held the loop ~20 ms sending it, a 1 MB APPEND about a tenth of that.
SNAPSHOT_PART_BYTES = 1 << 20
BUILDING_TTL_S = 600  # a snapshot being built that its writer never renamed (it died) goes away


class KVEventStream:
    def __init__(
        self,
        r: aioredis.Redis,
        streams: StreamNames,
        *,
        max_bytes: int,
        snapshot_interval_s: float,
        block_size: int,
        hash_algo: str,
        writer: Writer | None = None,
    ) -> None:
        self.r = r
        self.writer = writer or Unfenced(r)
        self.streams = streams
        self.max_bytes = max_bytes
        self._entry_bytes = 0  # payload bytes of every entry published, for the average
        self._redis_entry_bytes: float | None = None  # what Redis said an entry costs
        self.snapshot_interval_s = snapshot_interval_s
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.last_id: bytes | None = None
        self.seq = -1  # the sequence number of entry last_id (-1: none yet)
        # Called with (seq, batch) once the entry is on the stream (the ZMQ publisher).
        self.on_published: Callable[[int, bytes], object] | None = None
        self.published = 0
        self.batches = 0
        self.snapshots_written = 0
        self.counts: dict[int, int] = {}  # the mirror: what a subscriber at last_id holds
        self._synced = False
        # While a snapshot reads `counts`, changes land here (0: the hash is gone) and
        # `_cleared` says whether `counts` still underlies them.
        self._overlay: dict[int, int] | None = None
        self._cleared = False
        self._snapshot_task: asyncio.Task | None = None
        self._last_snapshot_start = float("-inf")

    @property
    def maxlen(self) -> int:
        """Entries that fit the memory budget at what an entry costs Redis."""
        per_entry = self._redis_entry_bytes
        if per_entry is None:
            average = self._entry_bytes / self.batches if self.batches else ASSUMED_ENTRY_BYTES
            per_entry = average + ENTRY_OVERHEAD_BYTES
        return max(MIN_MAXLEN, int(self.max_bytes / per_entry))

    async def _calibrate(self) -> None:
        """Read back what the stream's entries cost Redis (ids, listpack nodes, the
        allocator's rounding: all of it, unlike a payload count)."""
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.memory_usage(self.streams.events, samples=CALIBRATE_SAMPLES)
            pipe.xlen(self.streams.events)
            used, length = await pipe.execute()
        if used and length:
            self._redis_entry_bytes = used / length

    async def publish(self, events: list[AnyKVCacheEvent], pool: BlockPool, epoch: str) -> int:
        """Append one batch (nothing when there are no events); returns how many events."""
        if not events:
            return 0
        batch = encode_batch(KVEventBatch(time.time(), events))
        synced = self._synced
        await self.append(batch, batch_runs(events), epoch, apply=synced)
        if not synced:  # the pool already holds these events' effects
            self.sync_from_pool(pool)
        self.published += len(events)
        return len(events)

    async def append(
        self,
        batch: bytes,
        runs: list[Run],
        epoch: str,
        extra: dict[bytes, bytes] | None = None,
        *,
        apply: bool = True,
    ) -> bytes:
        """Append one encoded batch with its runs (applied to the mirror unless it is already
        in step) and any `extra` fields; returns the entry id."""
        fields = self._fields(batch, runs, self.seq + 1, extra)
        flat = [part for pair in fields.items() for part in pair]
        (entry_id,) = await self.writer.write(
            ("XADD", self.streams.events, "MAXLEN", "~", self.maxlen, "*", *flat)
        )
        self._appended(batch, runs, fields, entry_id, apply)
        if self.batches % CALIBRATE_EVERY == 0:
            await self._calibrate()
        self._maybe_snapshot(epoch)
        return entry_id

    async def append_many(
        self, entries: Sequence[tuple[bytes, list[Run], dict[bytes, bytes] | None]], epoch: str
    ) -> None:
        """`append` of several batches in one fenced write (a bridge forwarding a backlog: the
        writer's bulk form, for vLLM's ~24 KB batches)."""
        if not entries:
            return
        fields = [
            self._fields(batch, runs, self.seq + 1 + i, extra)
            for i, (batch, runs, extra) in enumerate(entries)
        ]
        ids = await self.writer.write_bulk(
            *[
                ("XADD", self.streams.events, "MAXLEN", "~", self.maxlen, "*",
                 *[part for pair in entry.items() for part in pair])
                for entry in fields
            ]
        )  # fmt: skip
        for (batch, runs, _), entry_fields, entry_id in zip(entries, fields, ids, strict=True):
            self._appended(batch, runs, entry_fields, entry_id, True)
        self._maybe_snapshot(epoch)

    @staticmethod
    def _fields(
        batch: bytes, runs: list[Run], seq: int, extra: dict[bytes, bytes] | None
    ) -> dict[bytes, bytes]:
        fields = {b"batch": batch, HASHES_FIELD: encode_runs(runs), SEQ_FIELD: b"%d" % seq}
        if extra:
            fields.update(extra)
        return fields

    def _appended(
        self,
        batch: bytes,
        runs: list[Run],
        fields: dict[bytes, bytes],
        entry_id: bytes,
        apply: bool,
    ) -> None:
        self.last_id, self.seq = entry_id, self.seq + 1
        if self.on_published is not None:
            self.on_published(self.seq, batch)
        self.batches += 1
        self._entry_bytes += sum(len(k) + len(v) for k, v in fields.items()) - len(b"batch")
        if apply:
            self._apply(runs)

    def _maybe_snapshot(self, epoch: str) -> None:
        # The interval runs from the start of the last snapshot, so a slow write does not
        # stretch it; a snapshot still in flight is never doubled up.
        now = time.monotonic()
        if self._snapshot_task is None and now - self._last_snapshot_start >= (
            self.snapshot_interval_s
        ):
            self._last_snapshot_start = now
            self._snapshot_task = asyncio.create_task(self._snapshot_in_background(epoch))

    async def resume(self, history: int = 0) -> list[tuple[int, bytes]]:
        """Go on with the sequence of the stream's last entry (a restart, a failover); return up
        to `history` of the last entries as (seq, batch), oldest first, for the ZMQ replay
        buffer: those whose numbers run without a gap up to the last one."""
        newest = cast(list[Entry], await self.r.xrevrange(self.streams.events, count=1))
        seq = _seq_of(newest[0][1]) if newest else None
        self.seq = -1 if seq is None else seq
        kept: list[tuple[int, bytes]] = []
        end = b"+"
        while seq is not None and len(kept) < history:
            entries = cast(
                list[Entry],
                await self.r.xrevrange(
                    self.streams.events, max=end, count=min(history - len(kept), 1000)
                ),
            )
            for _, fields in entries:
                if _seq_of(fields) != self.seq - len(kept) or b"batch" not in fields:
                    kept.reverse()
                    return kept
                kept.append((self.seq - len(kept), fields[b"batch"]))
            if not entries:
                break
            end = b"(" + entries[-1][0]
        kept.reverse()
        return kept

    def load(self, counts: dict[int, int], last_id: bytes | None) -> None:
        """Take `counts` as the mirror as of entry `last_id` (a bridge resuming its stream)."""
        assert self._overlay is None, "no snapshot may be reading the mirror"
        self.counts, self.last_id, self._synced = counts, last_id, True

    def sync_from_pool(self, pool: BlockPool) -> None:
        """Rebuild the mirror from the pool itself (a scan of every block: start-up only)."""
        assert self._overlay is None, "no snapshot may be reading the mirror"
        counts: dict[int, int] = {}
        for block in pool.blocks:
            if block.block_hash is not None:
                key = to_event_hash(block.block_hash)
                counts[key] = counts.get(key, 0) + 1
        self.counts = counts
        self._synced = True

    def _apply(self, runs: list[Run]) -> None:
        overlay = self._overlay
        if overlay is None:
            apply_runs(self.counts, runs)
            return
        for kind, hashes in runs:
            if kind == CLEARED:
                overlay.clear()
                self._cleared = True
                continue
            delta = 1 if kind == STORED else -1
            for h in hashes:
                known = overlay.get(h)
                if known is None:
                    known = 0 if self._cleared else self.counts.get(h, 0)
                overlay[h] = max(known + delta, 0)

    def _freeze(self) -> tuple[dict[int, int], str, int]:
        self._overlay, self._cleared = {}, False
        return self.counts, (self.last_id or b"0-0").decode(), self.seq

    def _thaw(self) -> None:
        overlay, self._overlay = self._overlay, None
        assert overlay is not None
        if self._cleared:
            self.counts = {h: n for h, n in overlay.items() if n}
            return
        counts = self.counts
        for h, n in overlay.items():
            if n:
                counts[h] = n
            else:
                counts.pop(h, None)

    async def _snapshot_in_background(self, epoch: str) -> None:
        try:
            counts, stream_id, seq = self._freeze()
            try:
                hashes, values = array("Q"), array("I")
                keys, nums = iter(counts.keys()), iter(counts.values())
                while True:
                    before = len(hashes)
                    hashes.extend(islice(keys, SNAPSHOT_CHUNK))
                    values.extend(islice(nums, SNAPSHOT_CHUNK))
                    if len(hashes) == before:
                        break
                    await asyncio.sleep(0)
            finally:
                self._thaw()  # the arrays are a copy: the mirror may change again
            await self._write(hashes, values, stream_id, epoch, seq)
        except aioredis.RedisError as exc:
            log.warning("kv_snapshot_failed error=%s", exc)
        except LeadershipLost:
            # Fenced off: a successor leads. The engine loop finds out at its next write.
            log.warning("kv_snapshot_fenced epoch=%s", epoch)
        finally:
            self._snapshot_task = None

    def _encode(self, hashes: array, values: array, stream_id: str, epoch: str, seq: int) -> bytes:
        hash_array, count_array = pack_arrays(hashes, values)
        snapshot = KVSnapshot(
            epoch=epoch,
            stream_id=stream_id,
            block_size=self.block_size,
            hash_algo=self.hash_algo,
            written_at=time.time(),
            hash_array=hash_array,
            count_array=count_array,
            seq=None if seq < 0 else seq,
        )
        return encode_snapshot(snapshot)

    async def _write(
        self, hashes: array, values: array, stream_id: str, epoch: str, seq: int
    ) -> None:
        # The arrays are this call's own copies, so packing and encoding (memory copies of
        # ~12 MB at 1M blocks) run in a thread while the loop steps.
        data = await asyncio.to_thread(self._encode, hashes, values, stream_id, epoch, seq)
        key = self.streams.events_snapshot
        if len(data) <= SNAPSHOT_PART_BYTES:
            await self.writer.write(("SET", key, data))
        else:
            # Built beside the live key (same hash tag: same cluster slot; a name of this
            # writer's own, expiring, so that no other writer appends to it) and renamed over it
            # at once, fenced, so a subscriber never reads half a snapshot or a deposed one.
            building, view = f"{key}:writing:{uuid.uuid4().hex[:8]}", memoryview(data)
            await self.r.set(building, view[:SNAPSHOT_PART_BYTES], ex=BUILDING_TTL_S)
            for start in range(SNAPSHOT_PART_BYTES, len(data), SNAPSHOT_PART_BYTES):
                await self.r.append(building, view[start : start + SNAPSHOT_PART_BYTES])
            await self.writer.write(("RENAME", building, key), ("PERSIST", key))
        self.snapshots_written += 1

    async def write_snapshot(self, pool: BlockPool | None, epoch: str) -> None:
        """Write the snapshot now (start-up, a new epoch, shutdown), resynced from the pool
        (None: from the mirror as it is, for a bridge, which has no pool)."""
        if self._snapshot_task is not None:
            await asyncio.gather(self._snapshot_task, return_exceptions=True)
        if pool is not None:
            self.sync_from_pool(pool)
        counts, stream_id = self.counts, (self.last_id or b"0-0").decode()
        await self._write(
            array("Q", counts.keys()), array("I", counts.values()), stream_id, epoch, self.seq
        )
        self._last_snapshot_start = time.monotonic()


def _seq_of(fields: dict[bytes, bytes]) -> int | None:
    raw = fields.get(SEQ_FIELD)
    try:
        return None if raw is None else int(raw)
    except ValueError:
        return None
