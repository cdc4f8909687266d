"""KV-cache events, byte-compatible with vLLM 0.33's `vllm/distributed/kv_events.py`.

The events are msgspec Structs declared as vLLM declares them (tagged maps, `omit_defaults`, the
batch `array_like`), so msgspec writes the same bytes vLLM's encoder does: a batch is the array
`[ts, events, data_parallel_rank]`, each event a map whose first key is `"type"`. The decoder
takes that fast path first and falls back to a generic reader for what msgspec refuses: vLLM's
older positional events (arrays tagged by their first element), values of unexpected types, and
malformed input (raised as EventDecodeError with the reason).
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


# gc=False: an event holds only lists and scalars, never a cycle, so the collector need not
# track the structs (the lists inside are tracked as usual); vLLM declares them the same way.
class KVCacheEvent(
    msgspec.Struct, omit_defaults=True, gc=False, tag=True, forbid_unknown_fields=True
):
    """Base class of the three events (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    # Up to lora_name there is no default, so those fields are always written (None included).
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


# What the ledger emits and decodes; annotations use this union rather than the base class because
# msgspec decodes a tagged union of concrete structs.
AnyKVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[AnyKVCacheEvent]
    data_parallel_rank: int | None = None


EVENT_TYPES: dict[str, type[AnyKVCacheEvent]] = {
    cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)
}
_FIELDS: dict[type, tuple[str, ...]] = {cls: cls.__struct_fields__ for cls in EVENT_TYPES.values()}
_REQUIRED: dict[type, tuple[str, ...]] = {
    cls: cls.__struct_fields__[: len(cls.__struct_fields__) - len(cls.__struct_defaults__)]
    for cls in EVENT_TYPES.values()
}
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_event(event: AnyKVCacheEvent) -> bytes:
    return _ENCODER.encode(event)


# Each thread's buffer for encode_batch. Encoder.encode grows a fresh output from a few dozen
# bytes to the batch's ~2 KB by reallocation on every call; encode_into a buffer kept from the
# last call rarely grows it, and one copy out of it is cheaper than those reallocations (about
# 6% of the encode on the shared-prefix batches, which pays for this function's own call).
_buffers = threading.local()


def encode_batch(batch: KVEventBatch) -> bytes:
    """`[ts, events, data_parallel_rank]`, exactly as vLLM's msgspec encoder writes it."""
    if type(batch.ts) is not float:  # vLLM's ts is always a float; an int would pack as int
        batch = msgspec.structs.replace(batch, ts=float(batch.ts))
    try:
        buffer = _buffers.batch
    except AttributeError:
        buffer = _buffers.batch = bytearray()
    _ENCODER.encode_into(batch, buffer)
    return bytes(buffer)


class EventDecodeError(ValueError):
    pass


def decode_batch(data: bytes) -> KVEventBatch:
    """Parse one batch published by kvledger or by vLLM (map or older positional events)."""
    try:
        return _DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return decode_batch_generic(data)


def decode_batch_generic(data: bytes) -> KVEventBatch:
    """The slow reader: any layout vLLM ever published, each value taken as it is."""
    # Imported here, not at the top: the codec itself needs msgspec alone, so it also runs in
    # vLLM's own venv, where benchmarks/kv_events.py times the two encoders side by side.
    import msgpack

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


def _event_from_map(raw: dict[str, Any]) -> AnyKVCacheEvent:
    kind = raw.get("type")
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise EventDecodeError(f"unknown KV event type {kind!r}")
    fields = _FIELDS[cls]
    unknown = set(raw) - set(fields) - {"type"}
    if unknown:
        raise EventDecodeError(f"{kind}: unknown field(s) {sorted(unknown)}")
    missing = [name for name in _REQUIRED[cls] if name not in raw]
    if missing:
        raise EventDecodeError(f"{kind}: missing field(s) {missing}")
    kwargs = {name: raw[name] for name in fields if name in raw}
    if kwargs.get("extra_keys") is not None:
        kwargs["extra_keys"] = [tuple(k) if k is not None else None for k in kwargs["extra_keys"]]
    return cls(**kwargs)


def _event_from_array(raw: list[Any]) -> AnyKVCacheEvent:
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
    for name in _REQUIRED[cls]:
        fields.setdefault(name, None)
    return _event_from_map({"type": raw[0], **fields})
