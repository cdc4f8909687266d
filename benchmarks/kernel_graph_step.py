"""A decode step of a small random Llama on the CUDA kernels, eager against replayed from the
CUDA graph of its batch bucket (kernels.graphs.DecodeGraphs, what the worker does): wall time
per step with the GPU synchronised, so the host's launch overhead counts."""

from __future__ import annotations

import functools
import math
import statistics
import time

import torch

import kernels
from gpu_worker.model import LlamaForCausalLM, ModelConfig
from kernels.graphs import DecodeGraphs

BLOCK_SIZE = 16


@functools.cache
def small_llama() -> LlamaForCausalLM:
    """8 layers of a Llama-3-8B-like shape (32 query / 8 KV heads of 128), random, on the GPU."""
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=4096, hidden_size=4096,
        intermediate_size=4096, num_hidden_layers=8, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialised on the GPU: seconds, not a minute on the host
        return LlamaForCausalLM(cfg).to(dtype=torch.bfloat16)


def _median_ms(fn, iters: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def decode_step_times(backend: kernels.AttentionBackend, batch: int, context: int) -> dict:
    model = small_llama()
    cfg = model.config
    pages = math.ceil((context + 1) / BLOCK_SIZE)
    shape = kernels.kv_cache_shape(batch * pages, BLOCK_SIZE, cfg.num_key_value_heads, 128)
    caches = [
        (torch.randn(shape, device="cuda", dtype=torch.bfloat16),
         torch.randn(shape, device="cuda", dtype=torch.bfloat16))
        for _ in range(cfg.num_hidden_layers)
    ]  # fmt: skip
    tables = torch.arange(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
    positions = torch.full((batch,), context, device="cuda")
    slots = tables[:, context // BLOCK_SIZE].long() * BLOCK_SIZE + context % BLOCK_SIZE
    seq_lens = torch.full((batch,), context + 1, device="cuda", dtype=torch.int32)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    input_ids = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")

    def forward(ids: torch.Tensor, pos: torch.Tensor, plan: kernels.AttentionPlan) -> torch.Tensor:
        return model(ids, pos, caches, plan)

    def step_plan() -> kernels.AttentionPlan:
        return backend.plan(slots, tables, seq_lens, qsl, 1, context + 1)

    graphs = DecodeGraphs(backend, forward, BLOCK_SIZE, pages, torch.device("cuda"))
    bucket = graphs.bucket_for(step_plan(), batch)
    assert bucket is not None
    eager = forward(input_ids, positions, step_plan())
    replayed = graphs.run(bucket, input_ids, positions, step_plan())
    row = {"batch": batch, "context": context, "layers": cfg.num_hidden_layers, "bucket": bucket}
    row["max_abs_diff"] = (eager.float() - replayed.float()).abs().max().item()
    row["eager_ms"] = _median_ms(lambda: forward(input_ids, positions, step_plan()))
    row["graph_ms"] = _median_ms(lambda: graphs.run(bucket, input_ids, positions, step_plan()))
    return row
