"""Capacity sizing: bytes per block, the block count from a memory budget, the start-up line.

The arithmetic is vLLM's (seeds: "Step 7", "Worked example: Llama-3.1-8B"): one block holds K and
V of `block_size` tokens for every layer, so it costs
`2 * block_size * num_layers * num_kv_heads * head_dim * dtype_bytes`; the pool is the budget
divided by that, and the capacity line reports it in tokens and in full-length requests.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype.lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(
            f"unknown KV cache dtype {dtype!r}: use one of {', '.join(sorted(DTYPE_BYTES))}"
        ) from None


def kv_cache_bytes_per_block(
    block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    return 2 * block_size * num_layers * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True, slots=True)
class KVCacheShape:
    """What one request's KV cache costs: the model's attention shape and the block size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_size: int = 16

    @property
    def bytes_per_block(self) -> int:
        return kv_cache_bytes_per_block(
            self.block_size, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes
        )

    def bytes_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size) * self.bytes_per_block


@dataclass(frozen=True, slots=True)
class BlockCost:
    """What the ledger knows of a worker's cache: the bytes one block costs, not the model."""

    bytes_per_block: int
    block_size: int = 16

    def bytes_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size) * self.bytes_per_block


def format_gib(num_bytes: int) -> str:
    return f"{round(num_bytes / GiB, 2)}"


def kv_budget_from_utilization(
    total_bytes: int,
    gpu_memory_utilization: float,
    weights_bytes: int,
    peak_activation_bytes: int,
    non_torch_bytes: int = 0,
) -> int:
    """The share of the device this instance may use, minus what the model itself needs."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    return (
        int(total_bytes * gpu_memory_utilization)
        - weights_bytes
        - peak_activation_bytes
        - non_torch_bytes
    )


def num_blocks_from_memory(
    available_bytes: int, shape: KVCacheShape, num_gpu_blocks_override: int | None = None
) -> int:
    """How many blocks the budget holds; the override replaces the count (it creates no memory)."""
    if num_gpu_blocks_override is not None:
        return num_gpu_blocks_override
    return max(available_bytes // shape.bytes_per_block, 0)


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int) -> float:
    """How many requests of max_model_len tokens the pool holds at once (null block included)."""
    return num_blocks / cdiv(max_model_len, block_size)


def capacity_line(num_blocks: int, block_size: int, max_model_len: int, device: str = "GPU") -> str:
    concurrency = max_concurrency(num_blocks, block_size, max_model_len)
    num_tokens = int(concurrency * max_model_len)
    return (
        f"{device} KV cache size: {num_tokens:,} tokens, "
        f"Maximum concurrency for {max_model_len:,} tokens per request: {concurrency:.2f}x"
    )


def tier_capacity_line(name: str, num_blocks: int, block_size: int, budget_bytes: float) -> str:
    """A KV tier's size: "CPU tier: 29,127 blocks, 466,032 tokens, 1 GiB"."""
    return (
        f"{name}: {num_blocks:,} blocks, {num_blocks * block_size:,} tokens, "
        f"{budget_bytes / 2**30:g} GiB"
    )


def estimate_max_model_len(
    available_bytes: int, shape: KVCacheShape | BlockCost, max_model_len: int
) -> int:
    """The longest request the budget can hold, by binary search as vLLM does (0 if none)."""
    if shape.bytes_for_tokens(1) > available_bytes:
        return 0
    left, right, best = 1, max_model_len, 1
    while left <= right:
        mid = (left + right) // 2
        if shape.bytes_for_tokens(mid) <= available_bytes:
            best, left = mid, mid + 1
        else:
            right = mid - 1
    return best


def check_enough_kv_cache_memory(
    available_bytes: int, shape: KVCacheShape | BlockCost, max_model_len: int
) -> None:
    """Refuse to start when one request of max_model_len cannot fit, with vLLM's messages.

    The null block is held back from the budget first, as vLLM plans against usable blocks.
    """
    usable = available_bytes - shape.bytes_per_block
    if usable <= 0:
        raise ValueError(
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
            "when initializing the engine (this flag also controls CPU memory reservation on the "
            "CPU backend, despite its name), or set `kv_cache_memory_bytes`."
        )
    needed = shape.bytes_for_tokens(max_model_len)
    if needed > usable:
        estimated = estimate_max_model_len(usable, shape, max_model_len)
        estimated_msg = (
            f"Based on the available memory, the estimated maximum model length is {estimated}. "
            if estimated > 0
            else ""
        )
        raise ValueError(
            f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"({format_gib(needed)} GiB KV cache is needed, which is larger than the available KV "
            f"cache memory ({format_gib(usable)} GiB). {estimated_msg}Try increasing "
            "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or "
            "decreasing `max_model_len` when initializing the engine."
        )


def check_enough_blocks(
    num_blocks: int, shape: KVCacheShape | BlockCost, max_model_len: int
) -> None:
    """The same refusal for a pool whose block count is already decided (override, worker report)."""
    check_enough_kv_cache_memory(num_blocks * shape.bytes_per_block, shape, max_model_len)
