"""The CUDA kernel sources, built for the host (csrc/host_emulation.cuh), against the reference.

Each CUDA thread runs as a fiber switched at barriers and shuffles, cp.async lands only at its
wait, and global accesses are bounds-checked, so index math, masking, pipeline and split-reduce
bugs show up on a CPU. What emulation cannot show (PTX, real timing) is for the GPU tests.
"""

from __future__ import annotations

import itertools
import platform

import pytest
import torch

from kernels import build, cuda, reference
from tests.kernels.paged_cases import (
    decode_lengths,
    dense_attention,
    make_batch,
    ragged_lengths,
)

# vLLM's kernel-test tolerances
TOLERANCE = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2}
FAKE_SMS = 4  # a small "GPU", so the split heuristic splits even these short contexts


@pytest.fixture(scope="module")
def library() -> cuda.KernelLibrary:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the emulator's fiber switch is x86-64 assembly")
    try:
        return cuda.KernelLibrary(build.build(emulated=True))
    except build.BuildError as exc:
        if build.find_nvcc() is None:
            pytest.skip("no nvcc, so no CUDA headers (cuda_fp16.h) to build the emulation with")
        raise AssertionError(str(exc)) from exc


def run(library: cuda.KernelLibrary, batch, num_splits: int | None = None) -> torch.Tensor:
    return library.paged_attention(
        *batch.attention_args(),
        max(batch.q_lens),
        int(batch.seq_lens.max()),
        stream=0,
        num_sms=FAKE_SMS,
        num_splits=num_splits,
    )


def assert_matches_reference(out: torch.Tensor, batch) -> None:
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out, reference.paged_attention(*batch.attention_args()),
                               atol=tol, rtol=tol)  # fmt: skip
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=tol, rtol=tol)


# Every dtype, head_dim, block_size and GQA ratio (1, 4, 8) appears with both batch shapes.
CASES = [
    (torch.float16, 128, 16, 8, 8),
    (torch.bfloat16, 64, 32, 8, 8),
    (torch.float16, 64, 16, 8, 2),
    (torch.bfloat16, 128, 32, 8, 2),
    (torch.bfloat16, 64, 16, 16, 2),
    (torch.float16, 128, 32, 16, 2),
]


@pytest.mark.parametrize(("dtype", "head_dim", "block_size", "heads", "kv_heads"), CASES)
@pytest.mark.parametrize("lengths", [decode_lengths, ragged_lengths])
def test_emulated_attention_matches_reference(
    library, dtype, head_dim, block_size, heads, kv_heads, lengths
):
    seq_lens, q_lens = lengths(block_size)
    batch = make_batch(
        seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, seed=11, padding_tokens=2
    )
    out = run(library, batch)
    assert_matches_reference(out, batch)
    assert out[sum(q_lens) :].abs().sum().item() == 0  # padding rows untouched (zero)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 40])
def test_emulated_split_k_matches_reference_including_empty_splits(library, num_splits):
    # 40 splits of 32 keys: most sequences here are shorter, so many splits are empty.
    seq_lens, q_lens = [1, 31, 33, 300, 1200, 64], [1, 1, 2, 1, 1, 3]
    batch = make_batch(seq_lens, q_lens, 8, 2, 128, 16, torch.bfloat16, seed=num_splits)
    assert_matches_reference(run(library, batch, num_splits), batch)


def test_emulated_result_is_independent_of_thread_schedule_and_copy_timing(library):
    # Each output element is computed in a fixed order, so any difference between schedules is a
    # race: a missing barrier, or a read of a cp.async destination before its wait.
    seq_lens, q_lens = ragged_lengths(16)
    batch = make_batch(seq_lens, q_lens, 8, 2, 64, 16, torch.float16, seed=5)
    outs = []
    try:
        for reverse, eager, greedy in itertools.product([False, True], repeat=3):
            library.configure_emulation(reverse, eager, greedy)
            outs.append(run(library, batch, num_splits=3))
    finally:
        library.configure_emulation()
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_emulated_undersized_max_seq_len_hint_is_still_correct(library):
    seq_lens, q_lens = [500, 70], [1, 1]
    batch = make_batch(seq_lens, q_lens, 4, 4, 64, 32, torch.float16, seed=2)
    out = library.paged_attention(
        *batch.attention_args(), 1, 100, stream=0, num_sms=FAKE_SMS, num_splits=2
    )
    assert_matches_reference(out, batch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_emulated_cache_write_equals_reference_exactly(library, dtype):
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, kv_heads, head_dim, tokens = 9, 16, 2, 64, 37
    shape = (num_blocks, block_size, kv_heads, head_dim)
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


@pytest.mark.parametrize("hints", [True, False])
def test_emulated_routing_sends_prefills_to_sdpa_and_the_rest_to_the_kernel(library, hints):
    seq_lens, q_lens = ragged_lengths(16)
    assert max(q_lens) >= cuda.PREFILL_SDPA_MIN_QUERY_LEN > sorted(q_lens)[-2]
    batch = make_batch(seq_lens, q_lens, 8, 2, 64, 16, torch.bfloat16, seed=4, padding_tokens=2)
    extra = (max(q_lens), max(seq_lens)) if hints else ()
    out = cuda.routed_attention(library, 0, FAKE_SMS, *batch.attention_args(), *extra)
    assert_matches_reference(out, batch)
    assert out[sum(q_lens) :].abs().sum().item() == 0


def test_emulated_empty_batch_launches_nothing(library):
    cache = torch.zeros(2, 16, 2, 64, dtype=torch.float16)
    args = (
        torch.empty(0, 4, 64, dtype=torch.float16), cache, cache,
        torch.empty(0, 1, dtype=torch.int32), torch.empty(0, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32), 0.125,
    )  # fmt: skip
    assert cuda.routed_attention(library, 0, FAKE_SMS, *args).shape == (0, 4, 64)
    rows = torch.empty(0, 2, 64, dtype=torch.float16)
    library.reshape_and_cache(rows, rows, cache, cache, torch.empty(0, dtype=torch.long), 0)
    assert cache.abs().sum().item() == 0
