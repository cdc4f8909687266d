"""A shared-tier block's bytes: what was written comes back, and anything else is refused by
name (another namespace, key, rank or size, truncated, flipped bits)."""

from __future__ import annotations

import pytest

from services.tiers.blocks import CorruptBlock, block_path, pack_block, unpack_block
from services.tiers.namespace import namespace_fields, namespace_id

KEY = bytes(range(36))
PAYLOAD = bytes(range(256)) * 16


def test_a_block_comes_back_as_written():
    data = pack_block("ns0123456789abcd", KEY, 1, 2, PAYLOAD)
    assert bytes(unpack_block(data, "ns0123456789abcd", KEY, 1, 2, len(PAYLOAD))) == PAYLOAD


@pytest.mark.parametrize(
    ("namespace", "key", "rank", "tp", "size", "reason"),
    [
        ("other-namespace", KEY, 1, 2, len(PAYLOAD), "namespace"),
        ("ns0123456789abcd", KEY[::-1], 1, 2, len(PAYLOAD), "key"),
        ("ns0123456789abcd", KEY, 0, 2, len(PAYLOAD), "rank"),
        ("ns0123456789abcd", KEY, 1, 1, len(PAYLOAD), "rank"),
        ("ns0123456789abcd", KEY, 1, 2, len(PAYLOAD) + 4, "payload of"),
    ],
)
def test_another_blocks_bytes_are_refused(namespace, key, rank, tp, size, reason):
    data = pack_block("ns0123456789abcd", KEY, 1, 2, PAYLOAD)
    with pytest.raises(CorruptBlock, match=reason):
        unpack_block(data, namespace, key, rank, tp, size)


def test_truncated_and_flipped_bytes_are_refused():
    data = pack_block("ns", KEY, 0, 1, PAYLOAD)
    with pytest.raises(CorruptBlock, match="truncated"):
        unpack_block(data[:-1], "ns", KEY, 0, 1, len(PAYLOAD))
    with pytest.raises(CorruptBlock, match="shorter than the header"):
        unpack_block(data[:10], "ns", KEY, 0, 1, len(PAYLOAD))
    flipped = bytearray(data)
    flipped[-100] ^= 0x01
    with pytest.raises(CorruptBlock, match="checksum"):
        unpack_block(bytes(flipped), "ns", KEY, 0, 1, len(PAYLOAD))


def test_the_namespace_binds_every_field_that_makes_kv_interchangeable():
    identity = {"model": "m", "weights": "w", "dtype": "bfloat16", "layers": 4, "kv_heads": 8,
                "head_dim": 128, "tp_size": 2}  # fmt: skip
    base = namespace_id(namespace_fields(identity, "sha256", b"\1" * 32, 16))
    assert base == namespace_id(namespace_fields(dict(identity), "sha256", b"\1" * 32, 16))
    changed = [
        namespace_fields({**identity, field: value}, "sha256", b"\1" * 32, 16)
        for field, value in [("weights", "w2"), ("dtype", "float16"), ("tp_size", 1),
                             ("layers", 5), ("kv_heads", 4), ("head_dim", 64), ("model", "n")]
    ]  # fmt: skip
    changed += [
        namespace_fields(identity, "xxhash", b"\1" * 32, 16),
        namespace_fields(identity, "sha256", b"\2" * 32, 16),  # another seed
        namespace_fields(identity, "sha256", b"\1" * 32, 32),
    ]
    assert len({base, *(namespace_id(f) for f in changed)}) == len(changed) + 1


def test_a_blocks_file_is_under_its_namespace_and_rank(tmp_path):
    path = block_path(tmp_path, "abcd", KEY, 3)
    assert path.parent.parent == tmp_path / "abcd" and path.name == f"{KEY.hex()}.r3.kvb"
