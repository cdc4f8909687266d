"""The binary forms of a prefix index (event hash -> physical blocks): the ledger's KV-events
snapshot in Redis and a subscriber's checkpoint file.

Both hold the index as two packed arrays (uint64 hashes, uint32 counts, little-endian), which
load a million entries in a fraction of the time a msgpack list of pairs takes. A checkpoint is
a base file plus an append-only log of what was applied since; `CheckpointWriter` compacts the
log into a new base once it outgrows the base, so the cost of checkpointing stays proportional
to the events, not to the index. A log record is either a stream entry's batch as the stream
carried it (earlier releases), or the index operations of one poll: only the block hashes,
about a tenth of the batch bytes (token_ids are most of a BlockStored), so compaction, which
rewrites the whole base, comes about ten times less often.

Beside the GPU's index, both forms carry one per offloaded tier (vLLM's `medium`: "CPU"), in the
same packed arrays (`tiers`: medium -> [hashes, counts]); a log record's tier operations follow
its GPU ones (an AllBlocksCleared clears every tier, so each tier's log repeats the clears at
their places). Files and snapshots of earlier releases have none and load as no tier blocks.
"""

from __future__ import annotations

import json
import os
import sys
from array import array
from collections.abc import Iterable
from pathlib import Path

import msgpack
import msgspec
import numpy as np

SNAPSHOT_VERSION = 2
_BIG_ENDIAN = sys.byteorder == "big"


class KVSnapshot(msgspec.Struct, omit_defaults=True):
    """The ledger's snapshot: the cached blocks as of stream entry `stream_id`."""

    epoch: str
    stream_id: str
    block_size: int
    hash_algo: str
    written_at: float
    version: int = SNAPSHOT_VERSION
    hash_array: bytes = b""  # uint64 LE event hashes
    count_array: bytes = b""  # uint32 LE physical blocks holding each hash
    hashes: list[tuple[int, int]] | None = None  # version 1: [[hash, count], ...]
    # The sequence number of entry `stream_id` (its `seq` field, its ZMQ sequence): a ZMQ
    # subscriber loads the snapshot and asks the replay socket for seq + 1 on. None: no entry
    # carried one (an empty stream, or a ledger of an earlier release).
    seq: int | None = None
    # Each offloaded tier's blocks (vLLM's medium, "CPU" -> [hash_array, count_array]), as the
    # GPU's above; None: none held (or a ledger of an earlier release).
    tiers: dict[str, tuple[bytes, bytes]] | None = None


TierCounts = dict[str, dict[int, int]]  # medium -> event hash -> blocks holding it


def pack_tiers(tiers: TierCounts) -> dict[str, tuple[bytes, bytes]] | None:
    """The tiers' indexes as packed arrays (None when no tier holds a block)."""
    packed = {medium: pack_counts(counts) for medium, counts in tiers.items() if counts}
    return packed or None


def unpack_tiers(packed: dict[str, tuple[bytes, bytes]] | None) -> TierCounts:
    return {medium: unpack_counts(*arrays) for medium, arrays in (packed or {}).items()}


def pack_arrays(hashes: array, counts: array) -> tuple[bytes, bytes]:
    if _BIG_ENDIAN:
        hashes, counts = array("Q", hashes), array("I", counts)
        hashes.byteswap()
        counts.byteswap()
    return hashes.tobytes(), counts.tobytes()


def pack_counts(counts: dict[int, int]) -> tuple[bytes, bytes]:
    return pack_arrays(array("Q", counts.keys()), array("I", counts.values()))


def unpack_counts(hash_array: bytes, count_array: bytes) -> dict[int, int]:
    hashes = np.frombuffer(hash_array, dtype="<u8")
    counts = np.frombuffer(count_array, dtype="<u4")
    if len(hashes) != len(counts):
        raise ValueError(f"{len(hashes)} hashes but {len(counts)} counts")
    # Nearly every cached hash is held by one block: dict.fromkeys builds those without a
    # (hash, count) tuple each, and the few others are set after (about 1.3x faster at 1M).
    index = dict.fromkeys(hashes.tolist(), 1)
    shared = np.flatnonzero(counts != 1)
    if len(shared):
        index.update(zip(hashes[shared].tolist(), counts[shared].tolist(), strict=True))
    return index


def snapshot_counts(snapshot: KVSnapshot) -> dict[int, int]:
    if snapshot.hashes is not None:  # a version-1 snapshot
        return {h: n for h, n in snapshot.hashes}
    return unpack_counts(snapshot.hash_array, snapshot.count_array)


def snapshot_tier_counts(snapshot: KVSnapshot) -> TierCounts:
    return unpack_tiers(snapshot.tiers)


_SNAPSHOT_DECODER = msgspec.msgpack.Decoder(KVSnapshot)
_ENCODER = msgspec.msgpack.Encoder()


def encode_snapshot(snapshot: KVSnapshot) -> bytes:
    return _ENCODER.encode(snapshot)


def decode_snapshot(data: bytes) -> KVSnapshot:
    return _SNAPSHOT_DECODER.decode(data)


class _Base(msgspec.Struct):
    last_id: str
    hash_array: bytes
    count_array: bytes
    tiers: dict[str, tuple[bytes, bytes]] | None = None  # medium -> arrays, as KVSnapshot's


# Kinds of an operation run in a logged poll, in the order the index applied them: the order
# matters (a BlockRemoved of a hash not held is a no-op, so remove-then-store != store-then-remove).
STORED, REMOVED, CLEARED = 0, 1, 2


class LoggedOps(msgspec.Struct, array_like=True, gc=False):
    """The index operations of one poll: runs of (kind, how many hashes), then all hashes."""

    kinds: bytes  # uint8 per run
    lengths: bytes  # uint32 LE per run
    hashes: bytes | list[int]  # uint64 LE, or a list where a hash is outside uint64
    # Each offloaded tier's operations of the poll (medium -> [kinds, lengths, hashes]), applied
    # after the GPU's; None: none (and every record of earlier releases).
    tiers: dict[str, tuple[bytes, bytes, bytes | list[int]]] | None = None

    def runs(self) -> Iterable[tuple[int, list[int]]]:
        return _runs_of(self.kinds, self.lengths, self.hashes)

    def tier_runs(self) -> dict[str, list[tuple[int, list[int]]]]:
        return {medium: list(_runs_of(*packed)) for medium, packed in (self.tiers or {}).items()}


def _runs_of(
    kinds: bytes, lengths_bytes: bytes, hashes: bytes | list[int]
) -> Iterable[tuple[int, list[int]]]:
    lengths = np.frombuffer(lengths_bytes, dtype="<u4").tolist()
    values: list[int] = (
        np.frombuffer(hashes, dtype="<u8").tolist() if isinstance(hashes, bytes) else hashes
    )
    start = 0
    for kind, n in zip(kinds, lengths, strict=True):
        yield kind, values[start : start + n]
        start += n


class OpLog:
    """The operations of one poll, as the index applies them. Kept flat: a (kind, hashes) pair
    per event would keep ~100k objects per poll alive for the collector to walk (seven full
    collections over a 200k-event run, a third of its time)."""

    __slots__ = ("hashes", "kinds", "lengths", "tiers")

    def __init__(self) -> None:
        self.kinds = bytearray()
        self.lengths = array("I")
        self.hashes: list[int] = []
        self.tiers: dict[str, OpLog] | None = None  # each offloaded tier's own operations

    def add(self, kind: int, hashes: list[int]) -> None:
        """A GPU operation. A clear clears every tier too: the tiers' logs, applied after the
        GPU's, repeat it where it falls among their own operations."""
        self.kinds.append(kind)
        self.lengths.append(len(hashes))
        self.hashes.extend(hashes)
        if kind == CLEARED and self.tiers:
            for tier in self.tiers.values():
                tier.add(CLEARED, [])

    def tier(self, medium: str) -> OpLog:
        """The operations of one offloaded tier (vLLM's medium)."""
        if self.tiers is None:
            self.tiers = {}
        log = self.tiers.get(medium)
        if log is None:
            log = self.tiers[medium] = OpLog()
        return log


def pack_ops(ops: OpLog) -> LoggedOps:
    """Merge consecutive operations of a kind (but not clears) into one run."""
    logged = _pack_one(ops)
    if ops.tiers:
        logged.tiers = {
            medium: (packed.kinds, packed.lengths, packed.hashes)
            for medium, tier in ops.tiers.items()
            for packed in [_pack_one(tier)]
            if packed.kinds
        } or None
    return logged


def _pack_one(ops: OpLog) -> LoggedOps:
    kinds = np.frombuffer(bytes(ops.kinds), dtype=np.uint8)
    lengths = np.frombuffer(ops.lengths, dtype=np.uint32)
    if len(kinds):
        starts = np.flatnonzero(np.r_[True, (kinds[1:] != kinds[:-1]) | (kinds[1:] == CLEARED)])
        kinds, lengths = kinds[starts], np.add.reduceat(lengths, starts)
    try:
        packed: bytes | list[int] = pack_arrays(array("Q", ops.hashes), array("I"))[0]
    except OverflowError:  # a negative or oversized hash: msgpack keeps any int64/uint64
        packed = ops.hashes
    return LoggedOps(kinds.tobytes(), lengths.astype("<u4").tobytes(), packed)


class CheckpointWriter:
    """A subscriber's checkpoint at `path` (the base) and `path` + ".log" (entries since)."""

    def __init__(self, path: str | Path, *, min_compact_bytes: int = 8 << 20) -> None:
        self.path = Path(path)
        self.log_path = self.path.with_name(self.path.name + ".log")
        self.min_compact_bytes = min_compact_bytes
        self._base_bytes = 0
        self._log_bytes = 0
        self._has_base = self.path.exists()
        self.loaded_tiers: TierCounts = {}  # the tiers of the base `load` read

    def exists(self) -> bool:
        return self.path.exists()

    def load(self) -> tuple[str, dict[int, int], list[tuple[str, bytes | LoggedOps]]]:
        """(the base's last id, its counts, the logged records after it: (entry id, its batch)
        or (the poll's last entry id, its LoggedOps)); the base's tiers in `loaded_tiers`."""
        data = self.path.read_bytes()
        self._base_bytes = len(data)
        self.loaded_tiers = {}
        if data[:1] == b"{":  # the JSON checkpoint of earlier releases
            state = json.loads(data)
            return state["last_id"], {int(h): n for h, n in state["counts"]}, []
        base = msgspec.msgpack.decode(data, type=_Base)
        counts = unpack_counts(base.hash_array, base.count_array)
        self.loaded_tiers = unpack_tiers(base.tiers)
        entries: list[tuple[str, bytes | LoggedOps]] = []
        if self.log_path.exists():
            log = self.log_path.read_bytes()
            self._log_bytes = len(log)
            unpacker = msgpack.Unpacker(raw=False)
            unpacker.feed(log)
            after = _id_tuple(base.last_id)
            # A record cut short by a crash mid-append simply never comes out of the unpacker.
            for record in unpacker:
                entry_id = record[0]
                if _id_tuple(entry_id) <= after:  # the log may predate a compaction that crashed
                    continue
                if len(record) == 2:  # [entry id, batch]
                    entries.append((entry_id, record[1]))
                else:  # [last id, kinds, lengths, hashes, tiers?]
                    tiers = record[4] if len(record) > 4 else None
                    kinds, lengths, hashes = record[1:4]
                    ops = LoggedOps(kinds, lengths, hashes, _tier_ops(tiers))
                    entries.append((entry_id, ops))
        return base.last_id, counts, entries

    def append(
        self,
        entries: Iterable[tuple[str, bytes]],
        last_id: str,
        counts: dict[int, int],
        tiers: TierCounts | None = None,
    ) -> None:
        """Log these applied entries whole (as earlier releases did); compact into a new base
        when the log outgrows it."""
        record = b"".join(msgpack.packb([entry_id, batch]) for entry_id, batch in entries)
        self._write(record, last_id, counts, tiers)

    def append_ops(
        self, last_id: str, ops: OpLog, counts: dict[int, int], tiers: TierCounts | None = None
    ) -> None:
        """Log the index operations (kind, hashes) of the entries up to `last_id`, the tiers'
        after the GPU's."""
        packed = pack_ops(ops)
        fields: list = [last_id, packed.kinds, packed.lengths, packed.hashes]
        if packed.tiers:
            fields.append({medium: list(ops_) for medium, ops_ in packed.tiers.items()})
        self._write(msgpack.packb(fields), last_id, counts, tiers)

    def _write(
        self, record: bytes, last_id: str, counts: dict[int, int], tiers: TierCounts | None
    ) -> None:
        with open(self.log_path, "ab") as f:
            f.write(record)
        self._log_bytes += len(record)
        if not self._has_base or self._log_bytes >= max(self._base_bytes, self.min_compact_bytes):
            self.compact(last_id, counts, tiers)

    def compact(
        self, last_id: str, counts: dict[int, int], tiers: TierCounts | None = None
    ) -> None:
        hash_array, count_array = pack_counts(counts)
        data = msgspec.msgpack.encode(
            _Base(last_id, hash_array, count_array, pack_tiers(tiers or {}))
        )
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)
        # The new base covers everything logged: a crash before this truncation leaves records
        # that load() skips by their ids.
        with open(self.log_path, "wb"):
            pass
        self._base_bytes, self._log_bytes, self._has_base = len(data), 0, True


def _tier_ops(raw: object) -> dict[str, tuple[bytes, bytes, bytes | list[int]]] | None:
    if not isinstance(raw, dict) or not raw:
        return None
    return {str(medium): (ops[0], ops[1], ops[2]) for medium, ops in raw.items()}


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
