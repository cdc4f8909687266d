"""Block hashes equal vLLM 0.33's: the known answers, NONE_HASH seeding and extra keys."""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import pytest

from ledger.hashing import (
    DEFAULT_NONE_HASH_SEED,
    BlockHasher,
    block_extra_keys,
    resolve_none_hash_seed,
    to_event_extra_keys,
    to_event_hash,
)

TOKENS_1_TO_16 = list(range(1, 17))


def test_sha256_cbor_known_answers_with_default_seed():
    hasher = BlockHasher("sha256_cbor", seed=DEFAULT_NONE_HASH_SEED)
    assert (
        hasher.none_hash.hex() == "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
    )
    (block,) = hasher.hash_blocks(TOKENS_1_TO_16, 16)
    assert block.hex() == "cd7c51bc5a8fc8643f383a2b9e01522fba7473c669e9270c7b0bf7bf7fd01682"
    assert to_event_hash(block) == 8866452693264111234


def test_sha256_cbor_known_answers_with_pythonhashseed_zero():
    hasher = BlockHasher(
        "sha256_cbor", seed=resolve_none_hash_seed("sha256_cbor", {"PYTHONHASHSEED": "0"})
    )
    assert (
        hasher.none_hash.hex() == "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    )
    (block,) = hasher.hash_blocks(TOKENS_1_TO_16, 16)
    assert block.hex() == "202da172482d928bbc42ab25b0151e2b895f13f41002e27b2ceabcfae6d332ea"


def test_seed_resolution_follows_vllm():
    assert resolve_none_hash_seed("sha256", {}) == "vllm-none-hash"
    assert resolve_none_hash_seed("sha256_cbor", {"PYTHONHASHSEED": "42"}) == "42"
    assert resolve_none_hash_seed("xxhash", {"PYTHONHASHSEED": "7"}) == "7"
    # Non-cryptographic hashes get a fresh secret seed per process when none is given.
    a, b = resolve_none_hash_seed("xxhash", {}), resolve_none_hash_seed("xxhash_cbor", {})
    assert a != b and len(a) == 64


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_blocks_chain_from_parent_and_none_hash(algo):
    hasher = BlockHasher(algo, seed="s")
    tokens = list(range(40))
    hashes = hasher.hash_blocks(tokens, 16)
    assert len(hashes) == 2  # the 8 trailing tokens make no full block
    assert hashes[0] == hasher.hash_fn((hasher.none_hash, tuple(tokens[:16]), None))
    assert hashes[1] == hasher.hash_fn((hashes[0], tuple(tokens[16:32]), None))
    # Resuming from the first hash yields the same second hash.
    assert hasher.hash_blocks(tokens, 16, start_block=1, parent=hashes[0]) == hashes[1:]
    assert len(hashes[0]) == (32 if algo.startswith("sha") else 16)


def test_sha256_hashes_the_pickle_and_cbor_variant_the_canonical_cbor():
    hasher = BlockHasher("sha256", seed="x")
    expected = hashlib.sha256(pickle.dumps((hasher.none_hash, (1, 2), None), protocol=5)).digest()
    assert hasher.hash_block(None, [1, 2]) == expected
    cbor = BlockHasher("sha256_cbor", seed="x")
    assert (
        cbor.hash_block(None, [1, 2])
        == hashlib.sha256(cbor2.dumps((cbor.none_hash, (1, 2), None), canonical=True)).digest()
    )


def test_cache_salt_enters_block_zero_only_and_lora_every_block():
    assert block_extra_keys(0, "salt", None) == (("cache_salt", "salt"),)
    assert block_extra_keys(1, "salt", None) is None
    assert block_extra_keys(1, "salt", ("ad", "/p")) == (("lora", "ad", "/p"),)
    assert block_extra_keys(0, "salt", ("ad", "/p")) == (
        ("lora", "ad", "/p"),
        ("cache_salt", "salt"),
    )
    hasher = BlockHasher("sha256", seed="s")
    tokens = list(range(32))
    plain = hasher.hash_blocks(tokens, 16)
    salted = hasher.hash_blocks(tokens, 16, cache_salt="tenant-a")
    assert plain[0] != salted[0] and plain[1] != salted[1]  # block 1 differs through its parent
    assert salted[1] == hasher.hash_block(salted[0], tokens[16:], None)


def test_events_carry_extra_keys_untagged():
    assert to_event_extra_keys((("lora", "ad", "/p"), ("cache_salt", "s"))) == ("ad", "s")
    assert to_event_extra_keys(None) is None


def test_unknown_algorithm_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="sha256, sha256_cbor, xxhash, xxhash_cbor"):
        BlockHasher("md5")
