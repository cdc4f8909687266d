"""The KV-events stream and its snapshot in Redis.

Each batch is one stream entry: field `batch`, vLLM's bytes, and field `hashes`, the same
batch's block hashes in runs for prefix indexes (`services/events/runs.py`), with field `tiers`
beside it when the batch has events of an offloaded tier (vLLM's medium "CPU"). The stream keeps
a mirror of the cached blocks (event hash -> physical blocks), the GPU's and each tier's, by
applying every batch it publishes (its runs), so a snapshot is the mirror as of one entry id: a
subscriber loads it and reads the stream from that id on. Periodic snapshots never stall the
engine loop: they run as a background task that packs the mirror in chunks, yielding between
them, while batches published meanwhile go to an overlay that is merged back when the snapshot
is written.

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
    TIERS_FIELD,
    Run,
    TierRuns,
    apply_runs,
    batch_runs_and_tiers,
    clears_tiers,
    encode_runs,
    encode_tier_runs,
)
from services.events.snapshot import (
    CLEARED,
    REMOVED,
    STORED,
    KVSnapshot,
    TierCounts,
    encode_snapshot,
    pack_arrays,
)
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

# One entry to append: vLLM's batch, its GPU runs, extra fields, its tiers' runs ({}: none).
Append = tuple[bytes, list[Run], dict[bytes, bytes] | None, TierRuns]


class _Mirror:
    """One medium's mirror (event hash -> physical blocks). While a snapshot reads `counts`,
    changes land in `overlay` (0: the hash is gone), and `cleared` says whether `counts` still
    underlies them; `thaw` merges them back."""

    __slots__ = ("cleared", "counts", "overlay")

    def __init__(self, counts: dict[int, int] | None = None) -> None:
        self.counts: dict[int, int] = counts if counts is not None else {}
        self.overlay: dict[int, int] | None = None
        self.cleared = False

    def apply(self, runs: list[Run]) -> None:
        overlay = self.overlay
        if overlay is None:
            apply_runs(self.counts, runs)
            return
        for kind, hashes in runs:
            if kind == CLEARED:
                self.clear()
                continue
            delta = 1 if kind == STORED else -1
            for h in hashes:
                known = overlay.get(h)
                if known is None:
                    known = 0 if self.cleared else self.counts.get(h, 0)
                overlay[h] = max(known + delta, 0)

    def clear(self) -> None:
        if self.overlay is None:
            self.counts.clear()
        else:
            self.overlay.clear()
            self.cleared = True

    def freeze(self) -> dict[int, int]:
        self.overlay, self.cleared = {}, False
        return self.counts

    def thaw(self) -> None:
        overlay, self.overlay = self.overlay, None
        assert overlay is not None
        if self.cleared:
            self.counts = {h: n for h, n in overlay.items() if n}
            return
        counts = self.counts
        for h, n in overlay.items():
            if n:
                counts[h] = n
            else:
                counts.pop(h, None)


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
        # The mirror: what a subscriber at last_id holds, the GPU's blocks and each tier's.
        self._gpu = _Mirror()
        self._tiers: dict[str, _Mirror] = {}
        self._frozen: list[_Mirror] = []  # the mirrors a snapshot in flight reads
        self.tier_removed: dict[str, int] = {}  # medium -> blocks published as removed
        self._synced = False
        self._snapshot_task: asyncio.Task | None = None
        self._last_snapshot_start = float("-inf")

    @property
    def counts(self) -> dict[int, int]:
        """The GPU's mirror: event hash -> blocks holding it, as of last_id."""
        return self._gpu.counts

    @counts.setter
    def counts(self, counts: dict[int, int]) -> None:
        assert not self._frozen, "no snapshot may be reading the mirror"
        self._gpu.counts = counts

    @property
    def tier_counts(self) -> TierCounts:
        """Each offloaded tier's mirror (vLLM's medium -> event hash -> blocks)."""
        return {medium: mirror.counts for medium, mirror in self._tiers.items()}

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
        runs, tier_runs = batch_runs_and_tiers(events)
        await self.append(batch, runs, epoch, apply=synced, tier_runs=tier_runs)
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
        tier_runs: TierRuns | None = None,
    ) -> bytes:
        """Append one encoded batch with its runs and its tiers' (applied to the mirror unless
        it is already in step) and any `extra` fields; returns the entry id. The GPU's mirror
        is the pool's when it is out of step (`sync_from_pool`), the tiers' always the events'."""
        fields = self._fields(batch, runs, self.seq + 1, extra, tier_runs)
        flat = [part for pair in fields.items() for part in pair]
        (entry_id,) = await self.writer.write(
            ("XADD", self.streams.events, "MAXLEN", "~", self.maxlen, "*", *flat)
        )
        self._appended(batch, runs, fields, entry_id, apply, tier_runs)
        if self.batches % CALIBRATE_EVERY == 0:
            await self._calibrate()
        self._maybe_snapshot(epoch)
        return entry_id

    async def append_many(self, entries: Sequence[Append], epoch: str) -> None:
        """`append` of several batches in one fenced write (a bridge forwarding a backlog: the
        writer's bulk form, for vLLM's ~24 KB batches)."""
        if not entries:
            return
        fields = [
            self._fields(batch, runs, self.seq + 1 + i, extra, tiers)
            for i, (batch, runs, extra, tiers) in enumerate(entries)
        ]
        ids = await self.writer.write_bulk(
            *[
                ("XADD", self.streams.events, "MAXLEN", "~", self.maxlen, "*",
                 *[part for pair in entry.items() for part in pair])
                for entry in fields
            ]
        )  # fmt: skip
        for (batch, runs, _, tiers), entry_fields, entry_id in zip(
            entries, fields, ids, strict=True
        ):
            self._appended(batch, runs, entry_fields, entry_id, True, tiers)
        self._maybe_snapshot(epoch)

    @staticmethod
    def _fields(
        batch: bytes,
        runs: list[Run],
        seq: int,
        extra: dict[bytes, bytes] | None,
        tier_runs: TierRuns | None = None,
    ) -> dict[bytes, bytes]:
        fields = {b"batch": batch, HASHES_FIELD: encode_runs(runs), SEQ_FIELD: b"%d" % seq}
        if tier_runs:
            fields[TIERS_FIELD] = encode_tier_runs(tier_runs)
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
        tier_runs: TierRuns | None = None,
    ) -> None:
        self.last_id, self.seq = entry_id, self.seq + 1
        if self.on_published is not None:
            self.on_published(self.seq, batch)
        self.batches += 1
        self._entry_bytes += sum(len(k) + len(v) for k, v in fields.items()) - len(b"batch")
        self._apply(runs, tier_runs, gpu=apply)

    def _apply(self, runs: list[Run], tier_runs: TierRuns | None = None, gpu: bool = True) -> None:
        """One batch's runs to the mirror (the GPU's unless it is in step with the pool
        already); the tiers' mirrors follow the events alone (the pool holds only the GPU's)."""
        if gpu:
            self._gpu.apply(runs)
        if self._tiers and clears_tiers(runs):
            for mirror in self._tiers.values():
                mirror.clear()
        for medium, tier in (tier_runs or {}).items():
            found = self._tiers.get(medium)
            if found is None:
                found = self._tiers[medium] = _Mirror()
            found.apply(tier)
            self.tier_removed[medium] = self.tier_removed.get(medium, 0) + sum(
                len(hashes) for kind, hashes in tier if kind == REMOVED
            )

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

    def load(
        self, counts: dict[int, int], last_id: bytes | None, tiers: TierCounts | None = None
    ) -> None:
        """Take `counts` (and `tiers`) as the mirror as of entry `last_id` (a bridge resuming
        its stream)."""
        assert not self._frozen, "no snapshot may be reading the mirror"
        self.counts, self.last_id, self._synced = counts, last_id, True
        self._tiers = {medium: _Mirror(c) for medium, c in (tiers or {}).items()}

    def sync_from_pool(self, pool: BlockPool) -> None:
        """Rebuild the GPU's mirror from the pool itself (a scan of every block: start-up
        only)."""
        assert not self._frozen, "no snapshot may be reading the mirror"
        counts: dict[int, int] = {}
        for block in pool.blocks:
            if block.block_hash is not None:
                key = to_event_hash(block.block_hash)
                counts[key] = counts.get(key, 0) + 1
        self.counts = counts
        self._synced = True

    def _freeze(self) -> tuple[dict[int, int], TierCounts, str, int]:
        self._frozen = [self._gpu, *self._tiers.values()]
        tiers = {medium: mirror.freeze() for medium, mirror in self._tiers.items()}
        return self._gpu.freeze(), tiers, (self.last_id or b"0-0").decode(), self.seq

    def _thaw(self) -> None:
        frozen, self._frozen = self._frozen, []
        for mirror in frozen:
            mirror.thaw()

    async def _snapshot_in_background(self, epoch: str) -> None:
        try:
            counts, tiers, stream_id, seq = self._freeze()
            try:
                hashes, values = await _packed(counts)
                tier_arrays = {medium: await _packed(c) for medium, c in tiers.items() if c}
            finally:
                self._thaw()  # the arrays are a copy: the mirror may change again
            await self._write(hashes, values, stream_id, epoch, seq, tier_arrays)
        except aioredis.RedisError as exc:
            log.warning("kv_snapshot_failed error=%s", exc)
        except LeadershipLost:
            # Fenced off: a successor leads. The engine loop finds out at its next write.
            log.warning("kv_snapshot_fenced epoch=%s", epoch)
        finally:
            self._snapshot_task = None

    def _encode(
        self,
        hashes: array,
        values: array,
        stream_id: str,
        epoch: str,
        seq: int,
        tiers: dict[str, tuple[array, array]],
    ) -> bytes:
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
            tiers={medium: pack_arrays(*arrays) for medium, arrays in tiers.items()} or None,
        )
        return encode_snapshot(snapshot)

    async def _write(
        self,
        hashes: array,
        values: array,
        stream_id: str,
        epoch: str,
        seq: int,
        tiers: dict[str, tuple[array, array]] | None = None,
    ) -> None:
        # The arrays are this call's own copies, so packing and encoding (memory copies of
        # ~12 MB at 1M blocks) run in a thread while the loop steps.
        data = await asyncio.to_thread(
            self._encode, hashes, values, stream_id, epoch, seq, tiers or {}
        )
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
        tiers = {
            medium: (array("Q", c.keys()), array("I", c.values()))
            for medium, c in self.tier_counts.items()
            if c
        }
        await self._write(
            array("Q", counts.keys()), array("I", counts.values()), stream_id, epoch, self.seq,
            tiers,
        )  # fmt: skip
        self._last_snapshot_start = time.monotonic()


async def _packed(counts: dict[int, int]) -> tuple[array, array]:
    """A mirror's hashes and counts as arrays, a chunk at a time, yielding to the loop between."""
    hashes, values = array("Q"), array("I")
    keys, nums = iter(counts.keys()), iter(counts.values())
    while True:
        before = len(hashes)
        hashes.extend(islice(keys, SNAPSHOT_CHUNK))
        values.extend(islice(nums, SNAPSHOT_CHUNK))
        if len(hashes) == before:
            break
        await asyncio.sleep(0)
    return hashes, values


def _seq_of(fields: dict[bytes, bytes]) -> int | None:
    raw = fields.get(SEQ_FIELD)
    try:
        return None if raw is None else int(raw)
    except ValueError:
        return None
