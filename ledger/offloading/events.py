"""The tier's changes as vLLM 0.33's OffloadingConnector publishes them (self-describing off).

The manager knows a block only by its key, so a store is announced as one BlockStored per block
carrying the hash, the group and the medium, with no tokens, no parent and block_size 0; the
evictions of one call are one BlockRemoved per group. A failed store's release is never
published: the block was never announced.
"""

from __future__ import annotations

from collections.abc import Iterable

from ledger.events import AnyKVCacheEvent, BlockRemoved, BlockStored
from ledger.hashing import to_event_hash
from ledger.offloading.base import (
    OffloadingEvent,
    offload_key_block_hash,
    offload_key_group_idx,
)


def to_kv_events(events: Iterable[OffloadingEvent]) -> list[AnyKVCacheEvent]:
    out: list[AnyKVCacheEvent] = []
    for event in events:
        if not event.removed:
            out.extend(
                BlockStored(
                    block_hashes=[to_event_hash(offload_key_block_hash(key))],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=0,
                    lora_id=None,
                    medium=event.medium,
                    lora_name=None,
                    group_idx=offload_key_group_idx(key),
                    locality=event.locality,
                )
                for key in event.keys
            )
        elif not event.metadata_only:
            by_group: dict[int, list[int]] = {}
            for key in event.keys:
                by_group.setdefault(offload_key_group_idx(key), []).append(
                    to_event_hash(offload_key_block_hash(key))
                )
            out.extend(
                BlockRemoved(
                    block_hashes=hashes,
                    medium=event.medium,
                    group_idx=group_idx,
                    locality=event.locality,
                )
                for group_idx, hashes in by_group.items()
            )
    return out
