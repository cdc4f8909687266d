"""The `hashes` field of a KV-events stream entry: the batch's block hashes as an index applies
them, written by the ledger beside vLLM's own bytes (field `batch`, unchanged).

A prefix index needs only each event's kind and block hashes, but vLLM's bytes are mostly the
token_ids of BlockStored (~1.7 KB of a ~1.8 KB entry), which any decoder of them still has to
scan. So the ledger adds, in the same XADD, a msgpack array of runs `[kind, [hash, ...]]`: kind
0 BlockStored, 1 BlockRemoved, 2 AllBlocksCleared (no hashes), in the batch's event order, each
run the block hashes of consecutive events of one kind. Applying the runs in order is applying
the events in order. `batch` stays the record: an entry without `hashes` (an older ledger,
another publisher) or whose `hashes` does not parse is read from `batch`.

The runs are the GPU's blocks: events of another medium (the CPU tier's, vLLM's `medium` "CPU")
are left out of them and go, per medium, to a second field, `tiers` (`TIERS_FIELD`): a msgpack
map medium -> runs of that medium's events, written only on entries that have such events. An
AllBlocksCleared clears every tier too (a new epoch: the ledger's books of every tier start
empty), so a reader applies `hashes` first, clearing its tiers at a clear, then `tiers`, whose
runs repeat the batch's clears where they fall among that medium's events. Readers that ignore
`tiers` see the GPU's index, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal, cast

import msgspec

from ledger.events import MEDIUM_GPU, AllBlocksCleared, AnyKVCacheEvent, BlockRemoved, BlockStored
from services.events.snapshot import CLEARED, REMOVED, STORED, OpLog

HASHES_FIELD = b"hashes"
TIERS_FIELD = b"tiers"
# The batch's sequence number (ASCII decimal), the one it carries over ZMQ: one more than the
# entry before it, across ledger restarts and failovers (engine/event_stream.py). Entries of
# earlier releases have none.
SEQ_FIELD = b"seq"

Run = tuple[int, list[int]]
TierRuns = dict[str, list[Run]]  # medium -> its runs


def indexed(medium: str | None) -> bool:
    """Whether a block event of this medium changes the prefix index: the GPU's (None is vLLM's
    unset medium, the GPU's before it named one)."""
    return medium is None or medium == MEDIUM_GPU


_ENCODER = msgspec.msgpack.Encoder()
# Kinds outside 0-2 or hashes that are not ints are refused here, in C, like any malformed value.
_DECODER = msgspec.msgpack.Decoder(list[tuple[Literal[0, 1, 2], list[int]]])
_TIERS_DECODER = msgspec.msgpack.Decoder(dict[str, list[tuple[Literal[0, 1, 2], list[int]]]])

try:  # Counter's own C loop (counts[h] = counts.get(h, 0) + 1), without Counter.update's checks
    from _collections import _count_elements as count_into  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - other Pythons

    def count_into(counts: dict[int, int], hashes: Iterable[int]) -> None:
        for h in hashes:
            counts[h] = counts.get(h, 0) + 1


def remove_from(counts: dict[int, int], hashes: list[int]) -> None:
    """One block fewer for each hash (a hash not held is skipped, as BlockRemoved of a block
    the index never saw changes nothing)."""
    for h in hashes:
        n = counts.pop(h, 0)
        if n > 1:
            counts[h] = n - 1


def apply_runs(counts: dict[int, int], runs: Iterable[Run], ops: OpLog | None = None) -> None:
    """Apply runs in order to an index of hash -> blocks holding it (a subscriber's, the ledger's
    snapshot mirror); if `ops` is given, append each run to it, for a checkpoint."""
    pop = counts.pop
    for kind, hashes in runs:
        if kind == STORED:
            count_into(counts, hashes)
        elif kind == REMOVED:
            # remove_from, inline: most runs of a batch are removals of one to a few blocks,
            # and a call each was a fifth of applying them.
            for h in hashes:
                n = pop(h, 0)
                if n > 1:
                    counts[h] = n - 1
        else:
            counts.clear()
        if ops is not None:
            ops.add(kind, hashes)


def batch_runs(events: list[AnyKVCacheEvent]) -> list[Run]:
    """The runs of one batch (only int hashes: the ledger's are always ints)."""
    return batch_runs_and_tiers(events)[0]


def batch_tier_runs(events: list[AnyKVCacheEvent]) -> TierRuns:
    """The runs of one batch's events of other media than the GPU's, per medium, each with the
    batch's clears that follow that medium's first event ({} when it has none)."""
    return batch_runs_and_tiers(events)[1]


def batch_runs_and_tiers(events: list[AnyKVCacheEvent]) -> tuple[list[Run], TierRuns]:
    """`batch_runs` and `batch_tier_runs` of one batch, in one pass (the ledger's, per step)."""
    runs: list[Run] = []
    kind = -1
    hashes: list[int] = []
    tiers: TierRuns = {}
    last: dict[str, tuple[int, list[int]]] = {}  # medium -> (kind, the run it is filling)
    for event in events:
        cls = type(event)
        if cls is AllBlocksCleared:
            kind = CLEARED
            runs.append((CLEARED, []))
            for name, tier_runs in tiers.items():
                tier_runs.append((CLEARED, []))
                last[name] = (CLEARED, [])
            continue
        medium = event.medium  # type: ignore[union-attr]
        if medium is not None and medium != MEDIUM_GPU:  # not indexed(): one call fewer
            tier_kind = STORED if cls is BlockStored else REMOVED
            current = last.get(medium)
            if current is None or current[0] != tier_kind:
                current = (tier_kind, [])
                tiers.setdefault(medium, []).append(current)
                last[medium] = current
            current[1].extend(event.block_hashes)  # type: ignore[union-attr]
            continue
        if cls is BlockStored:
            if kind != STORED:
                kind, hashes = STORED, []
                runs.append((STORED, hashes))
            hashes += event.block_hashes  # type: ignore[union-attr]
        elif cls is BlockRemoved:
            if kind != REMOVED:
                kind, hashes = REMOVED, []
                runs.append((REMOVED, hashes))
            hashes += event.block_hashes  # type: ignore[union-attr]
    return runs, tiers


def clears_tiers(runs: list[Run]) -> bool:
    """Whether these GPU runs clear the index, and so every tier with it."""
    return any(kind == CLEARED for kind, _ in runs)


def encode_runs(runs: list[Run]) -> bytes:
    return _ENCODER.encode(runs)


def encode_tier_runs(tiers: TierRuns) -> bytes:
    return _ENCODER.encode(tiers)


# Raises msgspec.DecodeError (ValidationError is one) for a malformed field.
decode_tier_runs = cast(Callable[[bytes], TierRuns], _TIERS_DECODER.decode)


# Raises msgspec.DecodeError (ValidationError is one) for a malformed field. The decoder's own
# method, not a function around it: a subscriber calls it once per stream entry.
decode_runs = cast(Callable[[bytes], list[Run]], _DECODER.decode)
