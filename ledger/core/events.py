"""KV-cache events, byte-compatible with vLLM 0.33's `vllm/distributed/kv_events.py`.

A batch is the msgpack array `[ts, events, data_parallel_rank]`; each event is a msgpack map whose first key is `"type"`,
followed by the fields in vLLM's declaration order. Fields with a default of None are left out
while None; the required ones (BlockStored's first seven, BlockRemoved's two) are always there.
A subscriber written for vLLM's events decodes ours unchanged, and `decode_batch` also reads
vLLM's older positional events (arrays tagged by their first element).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack

MEDIUM_GPU = "GPU"


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None

    REQUIRED: ClassVar[tuple[str, ...]] = (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    )


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    REQUIRED: ClassVar[tuple[str, ...]] = ("block_hashes", "medium")


@dataclass(slots=True)
class AllBlocksCleared:
    REQUIRED: ClassVar[tuple[str, ...]] = ()


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES: dict[str, type[KVCacheEvent]] = {
    cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)
}
_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in fields(cls)) for cls in EVENT_TYPES.values()
}


@dataclass(slots=True)
class KVEventBatch:
    ts: float
    events: list[KVCacheEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


def _map_header(count: int, capacity: int) -> bytes:
    # msgspec sizes a struct's map header by how many fields the struct *could* write (every
    # field plus the "type" tag), then fills in how many it did write. BlockStored (16) thus
    # always gets a map16 header even with 11 entries; matching it keeps the bytes identical.
    if capacity <= 15:
        return bytes((0x80 | count,))
    if capacity <= 0xFFFF:
        return b"\xde" + count.to_bytes(2, "big")
    return b"\xdf" + count.to_bytes(4, "big")


_PACK = msgpack.Packer(use_bin_type=True).pack


def encode_event(event: KVCacheEvent) -> bytes:
    required = event.REQUIRED
    fields = _FIELDS[type(event)]
    parts = [_PACK("type"), _PACK(type(event).__name__)]
    for name in fields:
        value = getattr(event, name)
        if value is None and name not in required:
            continue
        parts.append(_PACK(name))
        parts.append(_PACK(value))
    return _map_header(len(parts) // 2, len(fields) + 1) + b"".join(parts)


def encode_batch(batch: KVEventBatch) -> bytes:
    """`[ts, events, data_parallel_rank]`, exactly as vLLM's msgspec encoder writes it."""
    events = batch.events
    if len(events) <= 15:
        header = bytes((0x90 | len(events),))
    elif len(events) <= 0xFFFF:
        header = b"\xdc" + len(events).to_bytes(2, "big")
    else:
        header = b"\xdd" + len(events).to_bytes(4, "big")
    return (
        b"\x93"
        + _PACK(float(batch.ts))
        + header
        + b"".join(encode_event(e) for e in events)
        + _PACK(batch.data_parallel_rank)
    )


class EventDecodeError(ValueError):
    pass


def _event_from_map(raw: dict[str, Any]) -> KVCacheEvent:
    kind = raw.get("type")
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise EventDecodeError(f"unknown KV event type {kind!r}")
    fields = _FIELDS[cls]
    unknown = set(raw) - set(fields) - {"type"}
    if unknown:
        raise EventDecodeError(f"{kind}: unknown field(s) {sorted(unknown)}")
    missing = [name for name in cls.REQUIRED if name not in raw]
    if missing:
        raise EventDecodeError(f"{kind}: missing field(s) {missing}")
    kwargs = {name: raw[name] for name in fields if name in raw}
    if kwargs.get("extra_keys") is not None:
        kwargs["extra_keys"] = [tuple(k) if k is not None else None for k in kwargs["extra_keys"]]
    return cls(**kwargs)


def _event_from_array(raw: list[Any]) -> KVCacheEvent:
    """vLLM's older array_like events: [tag, field0, field1, ...] in declaration order.

    Older releases had fewer trailing fields (no `medium`, no `lora_name`): those read as None.
    """
    if not raw or not isinstance(raw[0], str) or raw[0] not in EVENT_TYPES:
        raise EventDecodeError(f"positional KV event with unknown tag {raw[:1]!r}")
    cls = EVENT_TYPES[raw[0]]
    values = raw[1:]
    minimum = {BlockStored: 4, BlockRemoved: 1, AllBlocksCleared: 0}[cls]
    if len(values) < minimum:
        raise EventDecodeError(
            f"{raw[0]}: {len(values)} positional fields, expected at least {minimum}"
        )
    fields = dict(zip(_FIELDS[cls], values, strict=False))
    for name in cls.REQUIRED:
        fields.setdefault(name, None)
    return _event_from_map({"type": raw[0], **fields})


def decode_batch(data: bytes) -> KVEventBatch:
    """Parse one batch published by kvledger or by vLLM (map or older positional events)."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from None
    if not isinstance(body, list) or len(body) < 2 or not isinstance(body[1], list):
        raise EventDecodeError("a KV event batch is the array [ts, events, data_parallel_rank?]")
    events = []
    for raw in body[1]:
        if isinstance(raw, dict):
            events.append(_event_from_map(raw))
        elif isinstance(raw, list):
            events.append(_event_from_array(raw))
        else:
            raise EventDecodeError(f"a KV event is a map or an array, got {type(raw).__name__}")
    rank = body[2] if len(body) > 2 else None
    return KVEventBatch(ts=float(body[0]), events=events, data_parallel_rank=rank)
