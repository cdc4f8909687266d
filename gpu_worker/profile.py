"""The worker's memory profile at start-up: how many KV blocks its memory can hold.

CPU: `kv_cache_memory_bytes`, else a share of MemAvailable. CUDA: `gpu_memory_utilization` of
the card minus weights, the profiled peak activation and non-torch memory, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.model import LlamaForCausalLM
from kernels import AttentionBackend, AttentionPlan, KVCache, TorchReference, kv_cache_shape
from ledger.capacity import cdiv, kv_cache_bytes_per_block

GiB = 1 << 30
NO_MEMORY = (
    "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
    "initializing the engine."
)


class KVCacheMemoryError(ValueError):
    """The budget left for the KV cache is zero or negative."""


@dataclass(slots=True)
class ProfileSettings:
    block_size: int = 16
    max_num_batched_tokens: int = 2048  # size of the CUDA profile run
    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.92
    kv_cache_memory_bytes: int | None = None  # fixed budget; skips profiling
    num_gpu_blocks_override: int | None = None
    cpu_kv_share: float = 0.10  # of MemAvailable, when no fixed budget is given on CPU
    cpu_kv_cap_bytes: int = 2 * GiB


@dataclass(slots=True)
class CudaSnapshot:
    """Device memory before the worker loaded anything: what others (and the context) hold."""

    free_bytes: int
    total_bytes: int
    torch_reserved_bytes: int


@dataclass(slots=True)
class MemoryProfile:
    num_gpu_blocks: int
    bytes_per_block: int
    available_kv_bytes: int  # the KV budget the block count came from
    device: str
    source: str  # kv_cache_memory_bytes | ram_share | profiled
    total_bytes: int = 0  # MemAvailable on CPU, the card on CUDA
    requested_bytes: int = 0  # gpu_memory_utilization x total (CUDA)
    weights_bytes: int = 0
    peak_activation_bytes: int = 0
    non_torch_bytes: int = 0
    num_gpu_blocks_override: int | None = None

    def describe(self) -> str:
        text = (
            f"KV budget {_gib(self.available_kv_bytes)} ({self.source} on {self.device}: total "
            f"{_gib(self.total_bytes)}, weights {_gib(self.weights_bytes)}, peak activation "
            f"{_gib(self.peak_activation_bytes)}, non-torch {_gib(self.non_torch_bytes)}) / "
            f"{self.bytes_per_block} bytes per block = {self.num_gpu_blocks} blocks"
        )
        if self.num_gpu_blocks_override is not None:
            text += f" (num_gpu_blocks_override={self.num_gpu_blocks_override})"
        return text


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def read_mem_available(meminfo: str = "/proc/meminfo") -> int:
    with open(meminfo, encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file counts kB
    raise RuntimeError(f"no MemAvailable line in {meminfo}")


def cpu_kv_budget(mem_available: int, share: float, cap: int) -> int:
    return min(int(mem_available * share), cap)


def cuda_kv_budget(
    total: int, utilization: float, weights: int, peak_activation: int, non_torch: int
) -> int:
    return int(total * utilization) - weights - peak_activation - non_torch


def blocks_for_budget(
    budget: int, bytes_per_block: int, override: int | None, hint: str = ""
) -> int:
    if budget <= 0:
        raise KVCacheMemoryError(f"{NO_MEMORY}{hint}")
    return override if override is not None else budget // bytes_per_block


def profile_memory(
    model: LlamaForCausalLM,
    settings: ProfileSettings,
    start: CudaSnapshot | None = None,
    mem_available: int | None = None,
    backend: AttentionBackend | None = None,
) -> MemoryProfile:
    """Size the KV cache for `model` on its device (block count, budget and the inputs used).
    On CUDA the profile run's attention is the worker's own `backend`."""
    cfg = model.config
    param = next(model.parameters())
    device = param.device
    bytes_per_block = kv_cache_bytes_per_block(
        settings.block_size,
        cfg.num_hidden_layers,
        model.num_local_kv_heads,  # per rank under tensor parallelism
        cfg.head_dim,
        param.element_size(),
    )
    profile = MemoryProfile(
        num_gpu_blocks=0,
        bytes_per_block=bytes_per_block,
        available_kv_bytes=0,
        device=str(device),
        source="kv_cache_memory_bytes",
        weights_bytes=weights_bytes(model),
        num_gpu_blocks_override=settings.num_gpu_blocks_override,
    )
    hint = ""
    if settings.kv_cache_memory_bytes is not None:
        profile.available_kv_bytes = settings.kv_cache_memory_bytes
        hint = " (`kv_cache_memory_bytes` is zero or negative)"
    elif device.type == "cuda":
        _profile_cuda(model, settings, start, profile, backend or TorchReference())
        hint = (
            f" Weights {profile.weights_bytes / GiB:.2f} GiB, peak activation "
            f"{profile.peak_activation_bytes / GiB:.2f} GiB and non-torch "
            f"{profile.non_torch_bytes / GiB:.2f} GiB exceed {settings.gpu_memory_utilization} x "
            f"{profile.total_bytes / GiB:.2f} GiB; lowering `max_num_batched_tokens` shrinks the "
            "profile run."
        )
    else:
        total = read_mem_available() if mem_available is None else mem_available
        profile.source, profile.total_bytes = "ram_share", total
        profile.available_kv_bytes = cpu_kv_budget(
            total, settings.cpu_kv_share, settings.cpu_kv_cap_bytes
        )
        hint = f" (CPU: MemAvailable is {total} bytes; set `kv_cache_memory_bytes`)"
    profile.num_gpu_blocks = blocks_for_budget(
        profile.available_kv_bytes, bytes_per_block, settings.num_gpu_blocks_override, hint
    )
    return profile


def weights_bytes(model: torch.nn.Module) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def cuda_snapshot(device: torch.device | str) -> CudaSnapshot:
    free, total = torch.cuda.mem_get_info(device)
    return CudaSnapshot(free, total, torch.cuda.memory_reserved(device))


def check_cuda_free_memory(start: CudaSnapshot, utilization: float) -> None:
    """Refuse to start when others hold memory this worker's share counts on (vLLM's check)."""
    wanted = start.total_bytes * utilization
    if start.free_bytes < wanted:
        raise KVCacheMemoryError(
            f"Free memory on device ({start.free_bytes / GiB:.2f}/{start.total_bytes / GiB:.2f} "
            f"GiB) on startup is less than desired GPU memory utilization ({utilization}, "
            f"{wanted / GiB:.2f} GiB). Decrease `gpu_memory_utilization` or reduce GPU memory "
            "used by other processes."
        )


def _profile_cuda(
    model: LlamaForCausalLM,
    settings: ProfileSettings,
    start: CudaSnapshot | None,
    profile: MemoryProfile,
    backend: AttentionBackend,
) -> None:
    device = next(model.parameters()).device
    start = start or cuda_snapshot(device)  # taken late: weights count as torch, not others
    # Both shapes a full step can take: attention kernels differ in which one peaks higher.
    num_tokens = settings.max_num_batched_tokens
    shapes = {1, max(1, min(settings.max_num_seqs, num_tokens))}
    profile.peak_activation_bytes = max(
        _peak_activation(model, num_tokens, n, settings.block_size, backend) for n in shapes
    )
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    others_at_start = start.total_bytes - start.free_bytes - start.torch_reserved_bytes
    profile.non_torch_bytes = max(
        0, (total - free) - torch.cuda.memory_reserved(device) - others_at_start
    )
    profile.source, profile.total_bytes = "profiled", total
    profile.requested_bytes = int(total * settings.gpu_memory_utilization)
    profile.available_kv_bytes = cuda_kv_budget(
        total,
        settings.gpu_memory_utilization,
        profile.weights_bytes,
        profile.peak_activation_bytes,
        profile.non_torch_bytes,
    )


@torch.inference_mode()
def _peak_activation(
    model: LlamaForCausalLM,
    num_tokens: int,
    num_seqs: int,
    block_size: int,
    backend: AttentionBackend,
) -> int:
    """Peak bytes a dummy prefill step allocates beyond what existed before (its cache too)."""
    device = next(model.parameters()).device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    input_ids, positions, caches, plan = dummy_batch(
        model, num_tokens, num_seqs, block_size, backend
    )
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    hidden = model(input_ids, positions, caches, plan)
    logits = model.compute_logits(hidden[plan.query_start_loc[1:].long() - 1])
    logits.float().softmax(dim=-1)  # the sampler's float32 copy
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def dummy_batch(
    model: LlamaForCausalLM,
    num_tokens: int,
    num_seqs: int,
    block_size: int,
    backend: AttentionBackend,
) -> tuple[torch.Tensor, torch.Tensor, list[KVCache], AttentionPlan]:
    """A prefill step of num_tokens split evenly over num_seqs sequences, with a cache of just
    enough blocks: (input_ids, positions, kv_caches, the step's plan) on the model's device."""
    cfg, bs = model.config, block_size
    param = next(model.parameters())
    device = param.device
    lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    blocks_per_seq = cdiv(max(lens), bs)
    shape = kv_cache_shape(blocks_per_seq * num_seqs, bs, model.num_local_kv_heads, cfg.head_dim)
    caches = [
        (
            torch.zeros(shape, dtype=param.dtype, device=device),
            torch.zeros(shape, dtype=param.dtype, device=device),
        )
        for _ in range(cfg.num_hidden_layers)
    ]
    tables = torch.arange(shape[0], dtype=torch.int32, device=device).view(num_seqs, -1)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), seq_lens)
    slots = tables[seq_of_token, positions // bs].long() * bs + positions % bs
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32, device=device)
    qsl[1:] = torch.cumsum(seq_lens, 0)
    plan = backend.plan(slots, tables, seq_lens, qsl, max(lens), max(lens))
    return positions % cfg.vocab_size, positions, caches, plan
