"""Capacity sizing pins the seeds' worked examples and errors."""

from __future__ import annotations

import pytest

from ledger.capacity import (
    KVCacheShape,
    capacity_line,
    check_enough_blocks,
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    kv_budget_from_utilization,
    kv_cache_bytes_per_block,
    num_blocks_from_memory,
)

MiB, GiB = 1 << 20, 1 << 30
LLAMA_31_8B = KVCacheShape(
    num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2, block_size=16
)


def test_llama_31_8b_block_is_two_mib():
    assert kv_cache_bytes_per_block(16, 32, 8, 128, 2) == 2 * MiB
    assert LLAMA_31_8B.bytes_per_block == 2 * MiB


def test_worked_example_55910_mib():
    num_blocks = num_blocks_from_memory(55_910 * MiB, LLAMA_31_8B)
    assert num_blocks == 27_955
    assert capacity_line(num_blocks, 16, 131_072) == (
        "GPU KV cache size: 447,280 tokens, Maximum concurrency for 131,072 tokens per request: 3.41x"
    )


def test_twenty_gib_gives_10240_blocks():
    assert num_blocks_from_memory(20 * GiB, LLAMA_31_8B) == 10_240


def test_override_replaces_the_count():
    assert num_blocks_from_memory(20 * GiB, LLAMA_31_8B, num_gpu_blocks_override=100) == 100


def test_budget_from_utilization_subtracts_weights_and_activations():
    budget = kv_budget_from_utilization(80 * GiB, 0.92, 16 * GiB, 2 * GiB)
    assert budget == int(80 * GiB * 0.92) - 18 * GiB
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget_from_utilization(80 * GiB, 1.5, 0, 0)


def test_no_memory_for_cache_blocks():
    with pytest.raises(ValueError, match="No available memory for the cache blocks"):
        check_enough_kv_cache_memory(2 * MiB, LLAMA_31_8B, 4096)


def test_one_max_model_len_request_must_fit_and_the_error_estimates_a_length():
    with pytest.raises(ValueError) as err:
        check_enough_kv_cache_memory(10 * GiB, LLAMA_31_8B, 131_072)
    message = str(err.value)
    assert "max seq len (131072)" in message
    assert "16.0 GiB KV cache is needed" in message
    # 10 GiB minus the null block holds 5,119 blocks of 16 tokens.
    assert "the estimated maximum model length is 81904" in message
    assert "decreasing `max_model_len`" in message
    assert estimate_max_model_len(10 * GiB - 2 * MiB, LLAMA_31_8B, 131_072) == 81_904
    check_enough_kv_cache_memory(17 * GiB, LLAMA_31_8B, 131_072)  # fits: no error


def test_check_on_a_block_count():
    check_enough_blocks(257, KVCacheShape(2, 2, 32, 4, 16), 4096)
    with pytest.raises(ValueError, match="estimated maximum model length is 4080"):
        check_enough_blocks(256, KVCacheShape(2, 2, 32, 4, 16), 4096)
