"""The start-up memory profile: CPU budget arithmetic, fixed budgets, the override, the
no-memory error, and (on a GPU) the profiled budget."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.profile import (
    GiB,
    KVCacheMemoryError,
    ProfileSettings,
    blocks_for_budget,
    cpu_kv_budget,
    cuda_kv_budget,
    dummy_batch,
    profile_memory,
    read_mem_available,
)
from gpu_worker.runner import ModelRunner, RunnerConfig
from kernels import BackendError, TorchReference

# default model, float32: 2 (K, V) x 16 tokens x 4 layers x 2 kv heads x 32 dims x 4 bytes
BYTES_PER_BLOCK = 2 * 16 * 4 * 2 * 32 * 4


def test_cpu_budget_is_a_capped_share_of_available_ram(tiny_model):
    assert cpu_kv_budget(10 * GiB, 0.10, 2 * GiB) == int(10 * GiB * 0.10)
    assert cpu_kv_budget(100 * GiB, 0.10, 2 * GiB) == 2 * GiB
    profile = profile_memory(tiny_model, ProfileSettings(), mem_available=GiB)
    assert profile.source == "ram_share" and profile.total_bytes == GiB
    assert profile.bytes_per_block == BYTES_PER_BLOCK == 32768
    assert profile.available_kv_bytes == int(GiB * 0.10)
    assert profile.num_gpu_blocks == int(GiB * 0.10) // BYTES_PER_BLOCK == 3276
    capped = profile_memory(tiny_model, ProfileSettings(), mem_available=64 * GiB)
    assert capped.num_gpu_blocks == 2 * GiB // BYTES_PER_BLOCK == 65536


def test_fixed_budget_and_override(tiny_model):
    fixed = profile_memory(tiny_model, ProfileSettings(kv_cache_memory_bytes=64 << 20))
    assert (fixed.source, fixed.num_gpu_blocks) == ("kv_cache_memory_bytes", 2048)
    pinned = profile_memory(
        tiny_model, ProfileSettings(kv_cache_memory_bytes=64 << 20, num_gpu_blocks_override=7)
    )
    assert pinned.num_gpu_blocks == 7 and pinned.available_kv_bytes == 64 << 20
    assert "num_gpu_blocks_override=7" in pinned.describe()


def test_no_memory_raises_the_seeds_error(tiny_model):
    with pytest.raises(
        KVCacheMemoryError,
        match=r"^No available memory for the cache blocks\. "
        r"Try increasing `gpu_memory_utilization`",
    ):
        profile_memory(tiny_model, ProfileSettings(kv_cache_memory_bytes=0))
    budget = cuda_kv_budget(
        80 * GiB, 0.5, weights=30 * GiB, peak_activation=8 * GiB, non_torch=3 * GiB
    )
    assert budget == -1 * GiB
    with pytest.raises(KVCacheMemoryError, match="No available memory"):
        blocks_for_budget(budget, BYTES_PER_BLOCK, override=100)


def test_cuda_budget_arithmetic():
    budget = cuda_kv_budget(
        80 * GiB, 0.92, weights=15 * GiB, peak_activation=2 * GiB, non_torch=GiB // 2
    )
    assert budget == int(80 * GiB * 0.92) - 15 * GiB - 2 * GiB - GiB // 2
    assert blocks_for_budget(budget, 2 << 20, None) == budget // (2 << 20)


def test_read_mem_available(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  32000 kB\nMemFree:  1000 kB\nMemAvailable:  20480 kB\n")
    assert read_mem_available(str(meminfo)) == 20480 * 1024
    assert read_mem_available() > 0


def test_runner_create_sizes_the_cache_from_the_profile():
    cfg = RunnerConfig(
        device="cpu", block_size=8, profile=ProfileSettings(kv_cache_memory_bytes=1 << 20)
    )
    runner = ModelRunner.create(cfg)
    assert runner.num_blocks == (1 << 20) // (BYTES_PER_BLOCK // 2) == 64
    assert runner.kv_caches[0][0].shape == (64, 1, 8, 64) and len(runner.kv_caches) == 4
    assert runner.name == "kvledger-tiny-llama" and runner.profile.num_gpu_blocks == 64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_profile_subtracts_weights_and_peak_activation():
    settings = ProfileSettings(gpu_memory_utilization=0.5, max_num_batched_tokens=512)
    runner = ModelRunner.create(RunnerConfig(device="cuda", profile=settings))
    p = runner.profile
    assert p.source == "profiled" and p.peak_activation_bytes > 0
    assert p.weights_bytes == sum(t.numel() * t.element_size() for t in runner.model.parameters())
    assert p.available_kv_bytes == int(p.total_bytes * 0.5) - p.weights_bytes - (
        p.peak_activation_bytes + p.non_torch_bytes
    )
    assert p.num_gpu_blocks == p.available_kv_bytes // p.bytes_per_block


def test_profile_dummy_batch_is_a_valid_paged_prefill(tiny_model):
    # The CUDA profile runs this batch; on CPU it must already be a correct step.
    input_ids, positions, caches, plan = dummy_batch(tiny_model, 21, 4, 4, TorchReference())
    assert plan.seq_lens.tolist() == [6, 5, 5, 5]
    assert plan.query_start_loc.tolist() == [0, 6, 11, 16, 21]
    with torch.inference_mode():
        hidden = tiny_model(input_ids, positions, caches, plan)
        logits = tiny_model.compute_logits(hidden)
    for begin, end in [(0, 6), (6, 11)]:
        dense = tiny_model.dense_logits(input_ids[begin:end])
        torch.testing.assert_close(logits[begin:end], dense, atol=1e-4, rtol=1e-4)


def test_the_runner_chooses_its_attention_backend_once_and_fails_fast():
    config = RunnerConfig(device="cpu", block_size=16, max_model_len=256)
    config.profile.kv_cache_memory_bytes = 1 << 20
    runner = ModelRunner.create(config)
    assert runner.backend.name == "torch-reference"  # the CPU runs the reference
    config.kernels = "cuda"
    with pytest.raises(BackendError, match="need a CUDA device"):
        ModelRunner.create(config)
