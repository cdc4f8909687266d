"""A KV-events subscriber for routers: bootstrap from the snapshot, follow the stream, resume.

It keeps a prefix index (event hash -> how many physical blocks hold it) and answers "how many
leading tokens of this prompt are cached" by hashing the prompt itself, which needs the ledger's
hash algorithm and NONE_HASH seed. Beside the GPU's blocks it keeps, per offloaded tier (vLLM's
`medium`, "CPU"), the blocks that tier holds (`PrefixIndex.tiers`), from the same stream (the
field `tiers`, `services/events/runs.py`) and snapshot. It checkpoints its index and last stream id to a file, so a
restarted subscriber resumes where it stopped; if the stream was trimmed past that id (events
lost), it starts over from the snapshot. Of each entry it reads the field `hashes` (the ledger's
runs of block hashes, `services/events/runs.py`), and vLLM's `batch` only where that is absent
or does not parse.
"""

from __future__ import annotations

import asyncio
import logging
import select
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import msgspec
import redis.asyncio as aioredis

from ledger.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    KVEventBatch,
    decode_batch,
)
from ledger.hashing import BlockHasher, to_event_hash
from services.events.runs import (
    HASHES_FIELD,
    TIERS_FIELD,
    Run,
    TierRuns,
    apply_runs,
    clears_tiers,
    count_into,
    decode_runs,
    decode_tier_runs,
    indexed,
    remove_from,
)
from services.events.snapshot import (
    CLEARED,
    REMOVED,
    STORED,
    CheckpointWriter,
    LoggedOps,
    OpLog,
    TierCounts,
    decode_snapshot,
    snapshot_counts,
    snapshot_tier_counts,
)
from services.transport.keys import StreamNames
from services.transport.redis_streams import connect, read_from

log = logging.getLogger(__name__)


# What the index reads of a batch: the events' kinds and block hashes. Every other field is
# taken as msgspec.Raw (its bytes skipped, not built: token_ids are most of a BlockStored), but
# required fields must be there and unknown ones are refused, as the full decoder does; a batch
# this does not fit (hashes that are not ints, vLLM's positional events) goes through the full
# decoder instead.
def _hashes_only(cls: Any) -> Any:
    names = cls.__struct_fields__
    required = len(names) - len(cls.__struct_defaults__)
    fields: list = [("block_hashes", list[int])] if "block_hashes" in names else []
    if "medium" in names:  # required in both events: only the GPU's blocks are indexed
        fields.append(("medium", str | None))
    for position, name in enumerate(names):
        if name not in ("block_hashes", "medium"):
            raw = (name, msgspec.Raw) if position < required else (name, msgspec.Raw, msgspec.Raw())
            fields.append(raw)
    return msgspec.defstruct(f"_{cls.__name__}Hashes", fields, tag=cls.__name__,
                             forbid_unknown_fields=True, gc=False)  # fmt: skip


_Stored, _Removed, _Cleared = (
    _hashes_only(c) for c in (BlockStored, BlockRemoved, AllBlocksCleared)
)
_HashesOnly: Any = msgspec.defstruct(
    "_HashesOnly",
    [("ts", float), ("events", list[_Stored | _Removed | _Cleared]),  # type: ignore[valid-type]
     ("data_parallel_rank", int | None, None)],
    array_like=True,
    gc=False,
)  # fmt: skip
_HASHES_DECODER = msgspec.msgpack.Decoder(_HashesOnly)


_KIND_OF: dict[type, int] = {
    _Stored: STORED, _Removed: REMOVED, _Cleared: CLEARED,
    BlockStored: STORED, BlockRemoved: REMOVED, AllBlocksCleared: CLEARED,
}  # fmt: skip


def event_hash(h: int | bytes) -> int:
    """A block hash as an index holds it: vLLM's int as it is, its bytes form (vLLM with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) as vLLM turns it into an int: the last 8 bytes,
    big-endian."""
    return h if isinstance(h, int) else int.from_bytes(h[-8:], "big")


def batch_hash_runs(data: bytes) -> list[Run]:
    """The runs (kind, hashes) of one batch as vLLM or kvledger encodes it, for the `hashes`
    field of an entry written from another publisher's bytes (`kvledger bridge`). Reads only the
    kinds and block hashes where it can; raises EventDecodeError for what is no batch."""
    return batch_runs_by_tier(data)[0]


def batch_runs_by_tier(data: bytes) -> tuple[list[Run], TierRuns]:
    """`batch_hash_runs`, and the runs of the batch's offloaded tiers (the `tiers` field: per
    medium, with the batch's clears after that medium's first event)."""
    try:
        events: list[Any] = _HASHES_DECODER.decode(data).events
        convert = False
    except (msgspec.ValidationError, msgspec.DecodeError):
        events = decode_batch(data).events  # byte hashes, positional events, odd values
        convert = True
    runs: list[Run] = []
    tiers: TierRuns = {}
    last, current = -1, cast(list[int], [])
    tier_last: dict[str, tuple[int, list[int]]] = {}
    kind_of = _KIND_OF
    for event in events:
        kind = kind_of[type(event)]
        if kind == CLEARED:
            for medium, tier_runs in tiers.items():
                tier_runs.append((CLEARED, []))
                tier_last[medium] = (CLEARED, [])
        elif not indexed(event.medium):
            medium = event.medium
            open_run = tier_last.get(medium)
            if open_run is None or open_run[0] != kind:
                open_run = (kind, [])
                tiers.setdefault(medium, []).append(open_run)
                tier_last[medium] = open_run
            open_run[1].extend(
                [event_hash(h) for h in event.block_hashes] if convert else event.block_hashes
            )
            continue
        if kind != last or kind == CLEARED:
            current = []
            runs.append((kind, current))
            last = kind
        if kind != CLEARED:
            current += (
                [event_hash(h) for h in event.block_hashes] if convert else event.block_hashes
            )
    return runs, tiers


class PrefixIndex:
    """The GPU's blocks (`counts`: event hash -> physical blocks holding it) and each offloaded
    tier's (`tiers`: vLLM's medium, "CPU" -> event hash -> blocks). An AllBlocksCleared clears
    them all."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}  # event hash -> physical blocks holding it
        self.tiers: TierCounts = {}

    def tier(self, medium: str) -> dict[int, int]:
        """The blocks an offloaded tier holds (empty when it has published none)."""
        return self.tiers.get(medium) or {}

    def _apply_tier_event(self, event: Any, kind: int, ops: OpLog | None) -> None:
        hashes = [h for h in event.block_hashes if isinstance(h, int)]
        counts = self.tiers.setdefault(event.medium, {})
        if kind == STORED:
            count_into(counts, hashes)
        else:
            remove_from(counts, hashes)
        if ops is not None:
            ops.tier(event.medium).add(kind, hashes)

    def apply(self, batch: KVEventBatch, ops: OpLog | None = None) -> None:
        """Apply one batch; if `ops` is given, append the (kind, hashes) it applied to it."""
        counts = self.counts
        for event in batch.events:
            if not isinstance(event, AllBlocksCleared) and not indexed(event.medium):
                self._apply_tier_event(
                    event, STORED if isinstance(event, BlockStored) else REMOVED, ops
                )
                continue
            if isinstance(event, BlockStored):
                # Only int hashes are ever held, so only they change the index.
                stored = [h for h in event.block_hashes if isinstance(h, int)]
                count_into(counts, stored)
                if ops is not None:
                    ops.add(STORED, stored)
            elif isinstance(event, BlockRemoved):
                removed = [h for h in event.block_hashes if isinstance(h, int)]
                remove_from(counts, removed)
                if ops is not None:
                    ops.add(REMOVED, removed)
            elif isinstance(event, AllBlocksCleared):
                counts.clear()
                self.tiers.clear()
                if ops is not None:
                    ops.add(CLEARED, [])

    def apply_runs(self, runs: list[Run], ops: OpLog | None = None) -> None:
        """Apply runs of (kind, hashes) in order: one entry's `hashes` field (the runs of its
        batch, `services/events/runs.py`) or the operations a checkpoint logged; if `ops` is
        given, append the operations to it, for the checkpoint. A clear clears every tier."""
        apply_runs(self.counts, runs, ops)
        if self.tiers and clears_tiers(runs):
            self.tiers.clear()

    def apply_tier_runs(self, tiers: TierRuns, ops: OpLog | None = None) -> None:
        """Apply each tier's runs (an entry's `tiers` field, after its `hashes`)."""
        for medium, runs in tiers.items():
            apply_runs(self.tiers.setdefault(medium, {}), runs, ops.tier(medium) if ops else None)

    def apply_bytes(self, data: bytes, ops: OpLog | None = None) -> None:
        """Apply one batch as the stream carries it (raises EventDecodeError if it is none);
        if `ops` is given, append the (kind, hashes) it applied to it, for the checkpoint."""
        try:
            events = _HASHES_DECODER.decode(data).events
        except (msgspec.ValidationError, msgspec.DecodeError):
            self.apply(decode_batch(data), ops)
            return
        counts = self.counts
        for event in events:
            kind = type(event)
            if kind is not _Cleared and not indexed(event.medium):
                self._apply_tier_event(event, STORED if kind is _Stored else REMOVED, ops)
                continue
            if kind is _Stored:
                count_into(counts, event.block_hashes)
                if ops is not None:
                    ops.add(STORED, event.block_hashes)
            elif kind is _Removed:
                remove_from(counts, event.block_hashes)
                if ops is not None:
                    ops.add(REMOVED, event.block_hashes)
            else:
                counts.clear()
                self.tiers.clear()
                if ops is not None:
                    ops.add(CLEARED, [])

    def apply_ops(self, logged: LoggedOps) -> None:
        """Replay the operations a checkpoint logged, in their order (the tiers' after)."""
        self.apply_runs(list(logged.runs()))
        if logged.tiers:
            self.apply_tier_runs(logged.tier_runs())

    def cached_prefix_tokens(
        self,
        token_ids: Sequence[int],
        hasher: BlockHasher,
        block_size: int,
        cache_salt: str | None = None,
    ) -> int:
        """Leading tokens of the prompt whose blocks are cached (the ledger's hit is at most
        this, and never the whole prompt: it recomputes the last token)."""
        cached = 0
        for block_hash in hasher.hash_blocks(token_ids, block_size, cache_salt=cache_salt):
            if to_event_hash(block_hash) not in self.counts:
                break
            cached += block_size
        return cached

    def leading_blocks(self, event_hashes: Sequence[int]) -> int:
        """How many of these chained block hashes (in KV-event form) are cached, from the first."""
        counts = self.counts
        for index, event_hash in enumerate(event_hashes):
            if event_hash not in counts:
                return index
        return len(event_hashes)

    def tier_blocks(self, medium: str, event_hashes: Sequence[int], start: int = 0) -> int:
        """How many of these block hashes an offloaded tier holds in a row from `start`."""
        counts = self.tiers.get(medium)
        if not counts:
            return 0
        for index in range(start, len(event_hashes)):
            if event_hashes[index] not in counts:
                return index - start
        return max(len(event_hashes) - start, 0)

    def __len__(self) -> int:
        return len(self.counts)


class KVEventSubscriber:
    def __init__(
        self,
        r: aioredis.Redis,
        prefix: str = "kvl",
        checkpoint: str | Path | None = None,
        replica: str = "default",
    ) -> None:
        self.r = r
        self.streams = StreamNames(prefix, replica)
        self.checkpoint = CheckpointWriter(checkpoint) if checkpoint else None
        self.index = PrefixIndex()
        self.last_id: str = "0-0"
        self.batches_applied = 0
        self.skipped = 0  # entries that were not a KV event batch
        self.hashes_refused = 0  # entries read from `batch` because `hashes` did not parse
        # The next page of a backlog, asked for ahead: ((after id, count), its XREAD).
        self._ahead: tuple[tuple[str, int], asyncio.Future] | None = None
        self.bootstraps = 0

    async def start(self, mode: str = "snapshot") -> None:
        """mode: snapshot (the cached blocks now), start (replay the whole stream), or end."""
        if self.checkpoint is not None and self.checkpoint.exists():
            await self._resume(self.checkpoint)
            return
        if mode == "snapshot":
            await self.bootstrap()
        elif mode == "end":
            info = (
                await self.r.xinfo_stream(self.streams.events)
                if await self.r.exists(self.streams.events)
                else None
            )
            self.last_id = info["last-generated-id"].decode() if info else "0-0"
        else:
            self.last_id = "0-0"

    async def bootstrap(self) -> None:
        data = await self.r.get(self.streams.events_snapshot)
        self.index = PrefixIndex()
        if data is None:  # no ledger has published yet: everything is in the stream
            self.last_id = "0-0"
        else:
            snapshot = decode_snapshot(data if isinstance(data, bytes) else data.encode())
            self.index.counts = snapshot_counts(snapshot)
            self.index.tiers = snapshot_tier_counts(snapshot)
            self.last_id = snapshot.stream_id
        self.bootstraps += 1
        if self.checkpoint is not None:
            self.checkpoint.compact(self.last_id, self.index.counts, self.index.tiers)

    async def _resume(self, checkpoint: CheckpointWriter) -> None:
        last_id, counts, logged = checkpoint.load()
        self.index.counts = counts
        self.index.tiers = checkpoint.loaded_tiers
        for entry_id, data in logged:
            if isinstance(data, LoggedOps):
                self.index.apply_ops(data)
            else:  # a whole batch, as earlier releases logged it
                self.index.apply_bytes(data)
            last_id = entry_id
        first = await self.r.xrange(self.streams.events, count=1)
        if first and _id_tuple(_text(first[0][0])) > _id_tuple(last_id) and last_id != "0-0":
            # Entries after last_id may have been trimmed away: the index could be wrong.
            await self.bootstrap()
            return
        self.last_id = last_id

    async def poll(self, block_ms: int | None = 1000, count: int = 1024) -> int:
        """Apply what arrived after last_id; returns how many batches (entries read)."""
        entries = await self._read(block_ms, count)
        applied = 0
        ops = OpLog() if self.checkpoint is not None else None
        index = self.index
        for entry_id, fields in entries:
            self.last_id = entry_id.decode()
            runs = fields.get(HASHES_FIELD)
            if runs is not None:
                try:
                    decoded = decode_runs(runs)
                    tiers = fields.get(TIERS_FIELD)
                    tier_runs = decode_tier_runs(tiers) if tiers is not None else None
                except msgspec.DecodeError as exc:  # a publisher's bug: `batch` is the record
                    self.hashes_refused += 1
                    log.warning(
                        "kv_event_hashes_refused stream=%s id=%s error=%s",
                        self.streams.events,
                        self.last_id,
                        exc,
                    )
                else:
                    index.apply_runs(decoded, ops)
                    if tier_runs:
                        index.apply_tier_runs(tier_runs, ops)
                    applied += 1
                    continue
            try:
                index.apply_bytes(fields[b"batch"], ops)
            except (KeyError, EventDecodeError) as exc:
                # The stream is the ledger's: a reader cannot dead-letter or fix an entry, only
                # step over it. The index stays right unless the entry held real events.
                self.skipped += 1
                log.warning(
                    "kv_event_entry_skipped stream=%s id=%s error=%s",
                    self.streams.events,
                    self.last_id,
                    "field 'batch' missing" if isinstance(exc, KeyError) else exc,
                )
                continue
            applied += 1
        self.batches_applied += applied
        if applied and self.checkpoint is not None:
            assert ops is not None
            self.checkpoint.append_ops(self.last_id, ops, self.index.counts, self.index.tiers)
        return len(entries)

    async def _read(self, block_ms: int | None, count: int) -> list:
        """The entries after last_id: the page asked for ahead by the last poll if it is that
        one, else a new XREAD. A full page means a backlog, so the next page is asked for before
        this one is applied: Redis builds and writes it (on another core) meanwhile, instead of
        the two taking turns."""
        ahead, self._ahead = self._ahead, None
        entries: list = []
        if ahead is not None and ahead[0] == (self.last_id, count):
            entries = await ahead[1]
        elif ahead is not None:  # the position moved (a bootstrap): that page is not next
            ahead[1].cancel()
        if len(entries) < count:
            # Not a full page asked for ahead: the stream's end as it was then. Read it now,
            # so that a short page always means "caught up during this poll" (replicas.py).
            entries = await read_from(
                self.r, self.streams.events, self.last_id, count=count, block_ms=block_ms
            )
        if len(entries) == count:
            after = entries[-1][0].decode()
            task = asyncio.ensure_future(
                read_from(self.r, self.streams.events, after, count=count, block_ms=None)
            )
            # An abandoned page's error (the connection closed under it) is nobody's to report.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._ahead = ((after, count), task)
            await asyncio.sleep(0)  # the task sends its XREAD now, before the page is applied
        return entries

    async def follow(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.poll(block_ms=500)


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


async def print_events(
    url: str, prefix: str, start: str, count: int, replica: str = "default"
) -> None:
    """`kvledger events`: one line per event, as they arrive."""
    r = connect(url)
    try:
        sub = KVEventSubscriber(r, prefix, replica=replica)
        if start == "snapshot":
            await sub.bootstrap()
            print(
                f"snapshot at {sub.last_id}: {sum(sub.index.counts.values())} cached blocks "
                f"({len(sub.index)} distinct hashes)",
                flush=True,
            )
        else:
            await sub.start(start)
        seen = 0
        while count == 0 or seen < count:
            entries = await read_from(r, sub.streams.events, sub.last_id, count=64, block_ms=1000)
            if not entries and _reader_gone(sys.stdout):
                # `kvledger events | head`: head may take its lines from the pipe's buffer and
                # leave while we wait for more, so no write ever fails; end as `tail -f` would.
                return
            for entry_id, fields in entries:
                sub.last_id = entry_id.decode()
                batch = decode_batch(fields[b"batch"])
                stamp = (
                    time.strftime("%H:%M:%S", time.localtime(batch.ts))
                    + f".{int(batch.ts * 1000) % 1000:03d}"
                )
                for event in batch.events:
                    print(f"{stamp} {sub.last_id:>17}  {describe(event)}", flush=True)
                seen += 1
                if count and seen >= count:
                    return
    finally:
        await r.aclose()


def _reader_gone(stream) -> bool:
    """True when `stream` is a pipe whose reading end is closed (poll reports POLLERR)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(mask & (select.POLLERR | select.POLLHUP) for _, mask in poller.poll(0))


def describe(event) -> str:
    if isinstance(event, BlockStored):
        hashes = ", ".join(
            f"{h:016x}" if isinstance(h, int) else str(h) for h in event.block_hashes[:4]
        )
        more = f" (+{len(event.block_hashes) - 4})" if len(event.block_hashes) > 4 else ""
        parent = (
            f"{event.parent_block_hash:016x}"
            if isinstance(event.parent_block_hash, int)
            else "none"
        )
        salt = (
            f" extra_keys={event.extra_keys[0]}" if event.extra_keys and event.extra_keys[0] else ""
        )
        return (
            f"BlockStored    {len(event.block_hashes)} block(s) of {event.block_size}, parent {parent}: "
            f"{hashes}{more}{salt}"
        )
    if isinstance(event, BlockRemoved):
        hashes = ", ".join(
            f"{h:016x}" if isinstance(h, int) else str(h) for h in event.block_hashes
        )
        return f"BlockRemoved   {hashes}"
    return "AllBlocksCleared"


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
