"""The CUDA kernels against the torch reference on a GPU (skipped without one).

Tolerances are vLLM's kernel-test ones; the cache write must be exact; the mma/ldmatrix
self-test must give the matmul the host emulation gives (so the emulator's fragment layouts
are the hardware's); decode steps replayed from CUDA graphs must equal eager ones; and a whole
worker run on the GPU must sample the same greedy tokens as the CPU reference.
"""

from __future__ import annotations

import pytest
import torch

from kernels import AttentionSpec, CudaKernels, cuda, reference, select_backend
from kernels.library import CUDA_CORES, TENSOR_CORES
from tests.kernels.paged_cases import (
    decode_lengths,
    dense_attention,
    make_batch,
    ragged_lengths,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOLERANCE = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float16, torch.bfloat16]
GQA = [(8, 8), (8, 2), (16, 2)]  # ratios 1, 4, 8


def assert_matches_reference(out: torch.Tensor, batch) -> None:
    tol = TOLERANCE[out.dtype]
    expected = reference.paged_attention(*batch.attention_args())
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=tol, rtol=tol)


def sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def kernel(batch, num_sms: int | None = None) -> tuple[torch.Tensor, cuda.WorkList]:
    out, work = cuda.paged_attention(
        cuda.load(), batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
        batch.seq_lens, batch.query_start_loc, batch.scale, None,
        torch.cuda.current_stream().cuda_stream, num_sms or sms(), max(batch.q_lens),
    )  # fmt: skip
    assert work is not None
    return out, work


def backend(dtype: torch.dtype = torch.bfloat16, **shape: int) -> CudaKernels:
    spec = {"num_heads": 16, "num_kv_heads": 2, "head_dim": 128, "block_size": 16, **shape}
    chosen = select_backend(AttentionSpec(torch.device("cuda"), dtype, **spec))
    assert isinstance(chosen, CudaKernels)
    return chosen


def test_a_cuda_device_runs_the_kernels_and_says_so():
    assert backend().name == "cuda"
    cpu = AttentionSpec(torch.device("cpu"), torch.bfloat16, 16, 2, 128, 16)
    assert select_backend(cpu).name == "torch-reference"


@pytest.mark.parametrize("dtype", DTYPES)
def test_mma_and_ldmatrix_fragments_match_the_host_emulation(dtype):
    gen = torch.Generator().manual_seed(1)
    a, b, v = (torch.randn(16, 16, generator=gen).to(dtype).cuda() for _ in range(3))
    c_kt, c_v = cuda.load().selftest_mma(a, b, v, torch.cuda.current_stream().cuda_stream)
    torch.testing.assert_close(c_kt, a.double().matmul(b.double().T).float())
    torch.testing.assert_close(c_v, a.double().matmul(v.double()).float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
@pytest.mark.parametrize("lengths", [decode_lengths, ragged_lengths])
def test_cuda_kernel_matches_reference(dtype, head_dim, block_size, heads, kv_heads, lengths):
    seq_lens, q_lens = lengths(block_size)
    batch = make_batch(
        seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, "cuda", padding_tokens=3
    )
    out, work = kernel(batch)
    decode_mha = heads == kv_heads and max(q_lens) == 1
    assert work.kernel == (CUDA_CORES if decode_mha else TENSOR_CORES)
    assert_matches_reference(out, batch)
    assert out[sum(q_lens) :].abs().sum().item() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_sms", [2, 16, None])
def test_cuda_split_keys_match_reference(dtype, num_sms):
    seq_lens = [1, 17, 2048, 5000, 333, 4096]
    batch = make_batch(seq_lens, [1, 1, 1, 3, 1, 2], 32, 8, 128, 16, dtype, "cuda", seed=4)
    out, work = kernel(batch, num_sms)
    assert_matches_reference(out, batch)
    assert work.counters.abs().sum().item() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hints", [True, False])
def test_public_api_matches_reference_with_and_without_hints(dtype, hints):
    seq_lens, q_lens = ragged_lengths(16)  # a prefill and decodes in one launch
    batch = make_batch(seq_lens, q_lens, 16, 2, 128, 16, dtype, "cuda", seed=8, padding_tokens=1)
    extra = {"max_query_len": max(q_lens), "max_seq_len": max(seq_lens)} if hints else {}
    out = batch.attend(backend(dtype), **extra)
    assert_matches_reference(out, batch)


def test_long_prefill_on_a_cached_prefix_matches_reference():
    batch = make_batch([5000, 700], [3000, 700], 32, 8, 128, 16, torch.bfloat16, "cuda", seed=3)
    out, work = kernel(batch)
    assert work.kernel == TENSOR_CORES and work.q_tile == 16
    assert_matches_reference(out, batch)


def test_long_context_decode_splits_and_matches_reference():
    seq_lens = [20_000, 9_000, 31]
    batch = make_batch(seq_lens, [1, 1, 1], 32, 8, 128, 16, torch.bfloat16, "cuda", seed=6)
    out, work = kernel(batch)
    items = work.items[: int(work.num_items.item())]
    assert int(items[:, 7].max()) > 1  # the long sequences were cut into chunks
    assert_matches_reference(out, batch)


def test_query_sliced_from_a_fused_projection_matches_reference():
    seq_lens, q_lens = decode_lengths(16)
    batch = make_batch(seq_lens, q_lens, 8, 2, 64, 16, torch.float16, "cuda", seed=9)
    fused = torch.randn(len(q_lens), 12 * 64, device="cuda", dtype=torch.float16)
    fused[:, : 8 * 64] = batch.query.reshape(len(q_lens), -1)
    batch.query = fused[:, : 8 * 64].view(len(q_lens), 8, 64)  # strided, not contiguous
    out = batch.attend(backend(torch.float16, num_heads=8, num_kv_heads=2, head_dim=64))
    assert_matches_reference(out, batch)


def test_attention_inside_a_cuda_graph_replays_new_lengths_correctly():
    # The planner runs inside the graph: a replay with other sequence lengths re-plans.
    chosen = backend()
    batch = make_batch([2000, 40, 700, 5], [1] * 4, 16, 2, 128, 16, torch.bfloat16, "cuda", seed=1)
    plan = batch.plan(chosen, max_query_len=1)
    plan.attention(batch.query, batch.kv_cache, batch.scale)  # warm-up (lazy set-up)
    graph = torch.cuda.CUDAGraph()
    plan = batch.plan(chosen, max_query_len=1)
    with torch.cuda.graph(graph):
        out = plan.attention(batch.query, batch.kv_cache, batch.scale)
    for lens in ([2000, 40, 700, 5], [1999, 40, 1, 5], [17, 1, 700, 3]):  # within the pages
        batch.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        batch.keys = [k[:n] for k, n in zip(batch.keys, lens, strict=True)]
        batch.values = [v[:n] for v, n in zip(batch.values, lens, strict=True)]
        graph.replay()
        assert_matches_reference(out, batch)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32])
def test_cuda_cache_write_is_exact(dtype):
    cuda_backend = backend()  # the copy moves 16-byte rows of any dtype
    gen = torch.Generator().manual_seed(2)
    num_blocks, block_size, kv_heads, head_dim, tokens = 40, 16, 8, 128, 300
    shape = (num_blocks, kv_heads, block_size, head_dim)
    qkv = torch.randn(tokens, 3 * kv_heads * head_dim, generator=gen).to(dtype).cuda()
    key = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, 2 * kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::7] = -1
    slots = slots.cuda()
    caches = [torch.randn(shape, generator=gen).to(dtype).cuda() for _ in range(2)]
    expected = [c.clone() for c in caches]
    reference.reshape_and_cache(key, value, *expected, slots)
    no_seqs = torch.empty(0, dtype=torch.int32, device="cuda")
    plan = cuda_backend.plan(slots, no_seqs.view(0, 1), no_seqs, no_seqs, 0, 0)
    plan.write_kv(key, value, (caches[0], caches[1]))
    assert torch.equal(caches[0], expected[0])
    assert torch.equal(caches[1], expected[1])


def test_worker_greedy_tokens_on_gpu_equal_the_cpu_reference(tmp_path):
    pytest.importorskip("transformers")
    from gpu_worker.checkpoint import load_checkpoint
    from gpu_worker.runner import ModelRunner
    from tests.gpu_worker.checkpoints import make_tiny_checkpoint
    from tests.gpu_worker.driver import generate_greedy

    # head_dim 64 and 4 query heads per KV head: a shape the CUDA kernels serve.
    folder = make_tiny_checkpoint(
        tmp_path, hidden_size=256, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 300, (n,), generator=gen).tolist() for n in (5, 40, 70, 17, 1)]

    def greedy(device: str, dtype: torch.dtype) -> tuple[ModelRunner, list[list[int]]]:
        model = load_checkpoint(folder, dtype=dtype, device=device)
        runner = ModelRunner(model, 96, 16)
        # chunked prefill + decode
        return runner, generate_greedy(runner, prompts, 12, max_chunk=24)

    (on_gpu, gpu_tokens), (on_cpu, cpu_tokens) = (
        greedy("cuda", torch.float16),
        greedy("cpu", torch.float32),
    )
    assert (on_gpu.backend.name, on_cpu.backend.name) == ("cuda", "torch-reference")
    assert isinstance(on_gpu.backend, CudaKernels) and on_gpu.backend.graphs.replays > 0
    assert gpu_tokens == cpu_tokens
