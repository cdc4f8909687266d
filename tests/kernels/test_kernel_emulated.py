"""The CUDA kernel sources, built for the host (csrc/host_emulation.cuh), against the reference.

Each CUDA thread runs as a fiber switched at barriers and warp-collective instructions, cp.async
lands only at its wait, ldmatrix and mma.sync compute exactly the fragments the PTX ISA gives
each lane, and global accesses are bounds-checked, so index math, fragment layouts, masking,
pipeline and split-merge bugs show up on a CPU. What emulation cannot show (real timing,
instruction selection) is for the GPU tests. The default run takes a short matrix; the whole
one runs with `-m emulation_full`.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels import cuda, reference
from kernels.library import CUDA_CORES, TENSOR_CORES, KernelLibrary
from tests.kernels.conftest import FAKE_SMS
from tests.kernels.paged_cases import (
    PagedBatch,
    decode_lengths,
    dense_attention,
    make_batch,
    ragged_lengths,
)

# vLLM's kernel-test tolerances
TOLERANCE = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2}


def run(
    library: KernelLibrary,
    batch: PagedBatch,
    num_sms: int = FAKE_SMS,
    max_query_len: int | None = None,
) -> tuple[torch.Tensor, cuda.WorkList]:
    hint = max(batch.q_lens) if max_query_len is None else max_query_len
    out, work = cuda.paged_attention(
        library, batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
        batch.seq_lens, batch.query_start_loc, batch.scale, None, 0, num_sms, hint,
    )  # fmt: skip
    assert work is not None
    return out, work


def assert_matches_reference(out: torch.Tensor, batch: PagedBatch) -> None:
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out, reference.paged_attention(*batch.attention_args()),
                               atol=tol, rtol=tol)  # fmt: skip
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=tol, rtol=tol)


def chunks_per_tile(work: cuda.WorkList) -> list[int]:
    items = work.items[: int(work.num_items.item())]
    return items[items[:, 8] == 0, 7].tolist()  # num_chunks of each tile's chunk 0


# (dtype, head_dim, block_size, heads, kv_heads): every dtype, head_dim, block_size and GQA
# ratio 1 (CUDA cores for decode), 4 and 8 (tensor cores) appears with both batch shapes.
SHORT = [
    (torch.float16, 128, 16, 8, 8),
    (torch.bfloat16, 64, 32, 8, 8),
    (torch.float16, 64, 16, 8, 2),
    (torch.bfloat16, 128, 32, 8, 2),
    (torch.bfloat16, 64, 16, 16, 2),
    (torch.float16, 128, 32, 16, 2),
]
# The GPU tests' matrix (dtype x head_dim x block_size x GQA 1, 4, 8), plus GQA 2 and 16.
FULL = [
    (dtype, head_dim, block_size, heads, kv_heads)
    for dtype in (torch.float16, torch.bfloat16)
    for head_dim in (64, 128)
    for block_size in (16, 32)
    for heads, kv_heads in ((8, 8), (8, 4), (8, 2), (16, 2), (32, 2))
    if (dtype, head_dim, block_size, heads, kv_heads) not in SHORT
]
SHAPES = [pytest.param(*case, id="-".join(map(str, case))) for case in SHORT] + [
    pytest.param(*case, id="-".join(map(str, case)), marks=pytest.mark.emulation_full)
    for case in FULL
]


@pytest.mark.parametrize(("dtype", "head_dim", "block_size", "heads", "kv_heads"), SHAPES)
@pytest.mark.parametrize("lengths", [decode_lengths, ragged_lengths])
def test_emulated_attention_matches_reference(
    library, dtype, head_dim, block_size, heads, kv_heads, lengths
):
    seq_lens, q_lens = lengths(block_size)
    batch = make_batch(
        seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, seed=11, padding_tokens=2
    )
    out, work = run(library, batch)
    decode_mha = heads == kv_heads and max(q_lens) == 1
    assert work.kernel == (CUDA_CORES if decode_mha else TENSOR_CORES)
    assert_matches_reference(out, batch)
    assert out[sum(q_lens) :].abs().sum().item() == 0  # padding rows zeroed, not left as is


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4)])
@pytest.mark.parametrize("num_sms", [1, FAKE_SMS, 132])
def test_emulated_split_keys_merge_in_the_last_chunk(library, heads, kv_heads, num_sms):
    # More SMs, more chunks: the planner splits long contexts to fill the GPU.
    seq_lens, q_lens = [1, 31, 33, 300, 1200, 64], [1, 1, 2, 1, 1, 3]
    batch = make_batch(seq_lens, q_lens, heads, kv_heads, 128, 16, torch.bfloat16, seed=num_sms)
    out, work = run(library, batch, num_sms)
    assert_matches_reference(out, batch)
    if num_sms >= FAKE_SMS:
        assert max(chunks_per_tile(work)) > 1
    assert work.counters.abs().sum().item() == 0  # the merging chunk reset every counter
    # The next layer reuses the step's work list.
    again, same = cuda.paged_attention(
        library, batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
        batch.seq_lens, batch.query_start_loc, batch.scale, work, 0, num_sms,
    )  # fmt: skip
    assert same is work and torch.equal(again, out)


def test_emulated_prefill_rows_split_across_warps(library):
    # 64-row tiles of 16 tokens x 4 query heads per KV head: a prefill of 150 tokens on a short
    # cached prefix, and an extend on a long one (its tiles run the steady-state loop).
    batch = make_batch([170, 40, 900], [150, 40, 40], 8, 2, 128, 16, torch.bfloat16, seed=8)
    out, work = run(library, batch)
    assert work.q_tile == 16 and work.kernel == TENSOR_CORES
    assert_matches_reference(out, batch)


def test_emulated_result_is_independent_of_thread_schedule_and_copy_timing(library):
    # Each output element is computed in a fixed order, so any difference between schedules is a
    # race: a missing barrier, or a read of a cp.async destination before its wait.
    seq_lens, q_lens = ragged_lengths(16)
    batch = make_batch(seq_lens, q_lens, 8, 2, 64, 16, torch.float16, seed=5)
    outs = []
    try:
        for reverse, eager, greedy in itertools.product([False, True], repeat=3):
            library.configure_emulation(reverse, eager, greedy)
            outs.append(run(library, batch, num_sms=132)[0])
    finally:
        library.configure_emulation()
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
def test_emulated_undersized_query_length_hint_is_still_correct(library, heads, kv_heads):
    # The hint picks the kernel and sizes partial slots; tiles it did not foresee never split.
    batch = make_batch([500, 70], [20, 1], heads, kv_heads, 64, 32, torch.float16, seed=2)
    out, _ = run(library, batch, num_sms=132, max_query_len=1)
    assert_matches_reference(out, batch)


def test_emulated_padded_decode_batch_equals_the_unpadded_one(library):
    # What a CUDA graph of bucket 8 replays for 5 sequences: 3 padding sequences with no keys
    # and no queries, 3 padding tokens at the end.
    seq_lens = [17, 100, 1, 64, 300]
    batch = make_batch(seq_lens, [1] * 5, 16, 2, 128, 16, torch.bfloat16, seed=6)
    padded = make_batch(seq_lens, [1] * 5, 16, 2, 128, 16, torch.bfloat16, seed=6)
    padded.query = torch.cat([batch.query, torch.randn(3, 16, 128).to(torch.bfloat16)])
    padded.seq_lens = torch.cat([batch.seq_lens, torch.zeros(3, dtype=torch.int32)])
    padded.query_start_loc = torch.cat(
        [batch.query_start_loc, torch.full((3,), 5, dtype=torch.int32)]
    )
    padded.block_tables = torch.cat([batch.block_tables, torch.zeros_like(batch.block_tables[:3])])
    out, _ = run(library, batch)
    out_padded, _ = run(library, padded)
    assert torch.equal(out_padded[:5], out)
    assert out_padded[5:].abs().sum().item() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_emulated_mma_and_ldmatrix_fragments_are_the_ptx_isas(library, dtype):
    # The same instructions and addressing as the kernel's S = Q K^T (no transpose) and
    # O = P V (.trans); test_kernel_gpu.py runs this on the GPU against the same matmul.
    gen = torch.Generator().manual_seed(1)
    a, b, v = (torch.randn(16, 16, generator=gen).to(dtype) for _ in range(3))
    c_kt, c_v = library.selftest_mma(a, b, v, stream=0)
    torch.testing.assert_close(c_kt, a.double().matmul(b.double().T).float())
    torch.testing.assert_close(c_v, a.double().matmul(v.double()).float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_emulated_cache_write_equals_reference_exactly(library, dtype):
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, kv_heads, head_dim, tokens = 9, 16, 2, 64, 37
    shape = (num_blocks, kv_heads, block_size, head_dim)
    # K and V as column slices of one fused projection, as a model produces them
    qkv = torch.randn(tokens, 3 * kv_heads * head_dim, generator=gen).to(dtype)
    key = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, 2 * kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::5] = -1
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    reference.reshape_and_cache(key, value, *expected, slots)
    library.reshape_and_cache(key, value, *caches, slots, stream=0)
    assert torch.equal(caches[0], expected[0])
    assert torch.equal(caches[1], expected[1])


def test_emulated_empty_batch_launches_nothing(library):
    cache = torch.zeros(2, 2, 16, 64, dtype=torch.float16)
    out, work = cuda.paged_attention(
        library, torch.empty(0, 4, 64, dtype=torch.float16), cache, cache,
        torch.empty(0, 1, dtype=torch.int32), torch.empty(0, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32), 0.125, None, 0, FAKE_SMS,
    )  # fmt: skip
    assert out.shape == (0, 4, 64) and work is None
    rows = torch.empty(0, 2, 64, dtype=torch.float16)
    library.reshape_and_cache(rows, rows, cache, cache, torch.empty(0, dtype=torch.long), 0)
    assert cache.abs().sum().item() == 0
