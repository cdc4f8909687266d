"""The torch reference against dense attention on unpaged K/V (CPU, runs in CI)."""

from __future__ import annotations

import pytest
import torch

from kernels import (
    AttentionSpec,
    BackendError,
    TorchReference,
    cuda_unsupported,
    kv_cache_shape,
    reference,
    select_backend,
)
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
    out = batch.attend(TorchReference())
    assert out[41:].abs().sum().item() == 0
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_reshape_and_cache_writes_rows_and_skips_negative_slots():
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, kv_heads, head_dim = 6, 16, 2, 64
    shape = kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)
    key_cache, value_cache = torch.zeros(shape), torch.zeros(shape)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:20]
    slots[[3, 11]] = -1
    key = torch.randn(20, kv_heads, head_dim, generator=gen)
    value = torch.randn(20, kv_heads, head_dim, generator=gen)
    no_seqs = torch.empty(0, dtype=torch.int32)
    plan = TorchReference().plan(slots, no_seqs.view(0, 1), no_seqs, no_seqs, 0, 0)
    plan.write_kv(key, value, (key_cache, value_cache))

    for token, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        assert torch.equal(key_cache[block, :, offset], key[token])  # HND: [block, head, offset]
        assert torch.equal(value_cache[block, :, offset], value[token])
    written = (key_cache.abs().sum(dim=(1, 3)) != 0).sum().item()
    assert written == 18  # padding tokens 3 and 11 left no trace


def test_cache_layout_is_hnd_one_kv_heads_page_contiguous():
    assert kv_cache_shape(10, 16, 8, 128) == (10, 8, 16, 128)
    batch = make_batch([40], [1], 4, 2, 64, 16, seed=2)
    table = batch.block_tables[0].long()
    # The 16 keys of head 1 in the sequence's second page are one contiguous run.
    page = batch.key_cache[table[1], 1]
    assert page.is_contiguous() and torch.equal(page, batch.keys[0][16:32, 1])


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


def spec(**overrides) -> AttentionSpec:
    shape = dict(
        device=torch.device("cpu"), dtype=torch.float32, num_heads=8, num_kv_heads=2,
        head_dim=64, block_size=16,
    )  # fmt: skip
    return AttentionSpec(**{**shape, **overrides})


def test_the_cpu_runs_the_reference_and_says_so():
    assert select_backend(spec()).name == "torch-reference"
    assert select_backend(spec(), "reference").name == "torch-reference"


def test_kernels_asked_for_on_the_cpu_fail_with_what_to_change():
    with pytest.raises(BackendError, match=r"need a CUDA device.*--kernels reference"):
        select_backend(spec(), "cuda")
    with pytest.raises(BackendError, match="'triton' is not one of auto, cuda, reference"):
        select_backend(spec(), "triton")


def test_shapes_the_cuda_kernels_do_not_cover_are_named():
    cuda = torch.device("cuda")
    assert cuda_unsupported(spec(device=cuda, dtype=torch.bfloat16)) == []
    reasons = cuda_unsupported(
        spec(device=cuda, dtype=torch.float32, head_dim=96, block_size=8, num_heads=64)
    )
    assert reasons == [
        "dtype float32 (they run float16 and bfloat16)",
        "head_dim 96 (they are built for 64 and 128)",
        "block_size 8 (they are built for 16 and 32)",
        "64 query heads over 2 KV heads (a GQA group of at most 16 query heads per KV head)",
    ]
    if not torch.cuda.is_available():  # the check comes before any build or device access
        with pytest.raises(BackendError, match="do not cover this model: dtype float32"):
            select_backend(spec(device=cuda), "cuda")


def test_empty_batch_gives_empty_output():
    cache = torch.zeros(kv_cache_shape(2, 16, 2, 64))
    no_seqs = torch.empty(0, dtype=torch.int32)
    plan = TorchReference().plan(
        torch.empty(0, dtype=torch.long), torch.empty(0, 1, dtype=torch.int32), no_seqs,
        torch.zeros(1, dtype=torch.int32), 0, 0,
    )  # fmt: skip
    out = plan.attention(torch.empty(0, 4, 64), (cache, cache), 0.125)
    assert out.shape == (0, 4, 64)
