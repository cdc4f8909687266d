"""One block of the shared tier as bytes: a header that names it, its payload, a checksum.

    "KVLB" | version u8 | namespace length u8 | key length u8 | 0 | rank u16 | tp size u16 |
    payload length u64 | CRC-32 of the payload u32 | namespace | key | payload

A reader checks every field against what it asked for and the CRC against the payload, so a
block of another namespace, key or rank, a truncated file or value, and flipped bits are all
refused (`CorruptBlock`) and the block is recomputed. Where a block lives: a directory backend
keeps one file per block and rank, `<root>/<namespace>/<2 hex>/<key hex>.r<rank>.kvb`; a Redis
backend one value per block and rank (`services.transport.keys.SharedTierKeys.data`).
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

MAGIC = b"KVLB"
VERSION = 1
_HEADER = struct.Struct("<4sBBBxHHQI")
HEADER_SIZE = _HEADER.size


class CorruptBlock(ValueError):
    """A block whose bytes are not the block asked for (the text says what differs)."""


def pack_block(
    namespace: str, key: bytes, rank: int, tp_size: int, payload: bytes | memoryview
) -> bytes:
    ns = namespace.encode()
    header = _HEADER.pack(
        MAGIC, VERSION, len(ns), len(key), rank, tp_size, len(payload), zlib.crc32(payload)
    )
    return b"".join((header, ns, key, payload))


def unpack_block(
    data: bytes | memoryview, namespace: str, key: bytes, rank: int, tp_size: int, size: int
) -> memoryview:
    """The payload of a block read back, checked to be `size` bytes of this key's block."""
    view = memoryview(data)
    if len(view) < HEADER_SIZE:
        raise CorruptBlock(f"{len(view)} bytes, shorter than the header")
    magic, version, ns_len, key_len, got_rank, got_tp, length, crc = _HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock(f"not a kvledger block of version {VERSION}")
    start = HEADER_SIZE + ns_len + key_len
    got_ns = bytes(view[HEADER_SIZE : HEADER_SIZE + ns_len])
    if got_ns != namespace.encode():
        raise CorruptBlock(f"namespace {got_ns.decode(errors='replace')!r}, not {namespace!r}")
    if bytes(view[HEADER_SIZE + ns_len : start]) != key:
        raise CorruptBlock("another block's key")
    if (got_rank, got_tp) != (rank, tp_size):
        raise CorruptBlock(f"rank {got_rank} of {got_tp}, not {rank} of {tp_size}")
    if length != size:
        raise CorruptBlock(f"a payload of {length} bytes, not {size}")
    payload = view[start:]
    if len(payload) != length:
        raise CorruptBlock(f"truncated: {len(payload)} of {length} payload bytes")
    if zlib.crc32(payload) != crc:
        raise CorruptBlock("checksum mismatch")
    return payload


def block_path(root: str | Path, namespace: str, key: bytes, rank: int) -> Path:
    hex_key = key.hex()
    return Path(root) / namespace / hex_key[:2] / f"{hex_key}.r{rank}.kvb"
