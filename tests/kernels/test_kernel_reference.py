"""The torch reference against dense attention on unpaged K/V (CPU, runs in CI)."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference
from tests.kernels.paged_cases import decode_lengths, dense_attention, make_batch, ragged_lengths

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (16, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("lengths", [ragged_lengths, decode_lengths])
def test_reference_matches_dense_attention(head_dim, num_heads, num_kv_heads, block_size, lengths):
    seq_lens, q_lens = lengths(block_size)
    batch = make_batch(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, seed=7)
    out = reference.paged_attention(*batch.attention_args())
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_half_precision_within_vllm_tolerance(dtype):
    seq_lens, q_lens = ragged_lengths(16)
    batch = make_batch(seq_lens, q_lens, 8, 2, 64, 16, dtype=dtype, seed=3)
    out = reference.paged_attention(*batch.attention_args())
    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=tol, rtol=tol)


def test_padding_rows_past_the_last_sequence_are_zero():
    batch = make_batch([40, 9], [40, 1], 4, 2, 64, 16, seed=1, padding_tokens=3)
    out = kernels.paged_attention(*batch.attention_args())
    assert out[41:].abs().sum().item() == 0
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_reshape_and_cache_writes_rows_and_skips_negative_slots():
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, kv_heads, head_dim = 6, 16, 2, 64
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache, value_cache = torch.zeros(shape), torch.zeros(shape)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:20]
    slots[[3, 11]] = -1
    key = torch.randn(20, kv_heads, head_dim, generator=gen)
    value = torch.randn(20, kv_heads, head_dim, generator=gen)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)

    for token, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        assert torch.equal(key_cache[block, offset], key[token])
        assert torch.equal(value_cache[block, offset], value[token])
    written = (key_cache.abs().sum(dim=(2, 3)) != 0).sum().item()
    assert written == 18  # padding tokens 3 and 11 left no trace


def test_query_longer_than_context_is_rejected_with_the_reason():
    batch = make_batch([4], [4], 4, 2, 64, 16)
    with pytest.raises(ValueError, match="seq_len"):
        reference.paged_attention(
            batch.query,
            batch.key_cache,
            batch.value_cache,
            batch.block_tables,
            torch.tensor([3], dtype=torch.int32),
            batch.query_start_loc,
            batch.scale,
        )


def test_cpu_dispatch_picks_the_reference():
    assert kernels.backend("cpu") == "torch-reference"
    assert kernels.backend(torch.device("cpu")) == "torch-reference"


def test_empty_batch_gives_empty_output():
    cache = torch.zeros(2, 16, 2, 64)
    no_seqs = torch.empty(0, dtype=torch.int32)
    out = kernels.paged_attention(
        torch.empty(0, 4, 64), cache, cache, torch.empty(0, 1, dtype=torch.int32), no_seqs,
        torch.zeros(1, dtype=torch.int32), 0.125,
    )  # fmt: skip
    assert out.shape == (0, 4, 64)
