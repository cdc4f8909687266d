"""The methods benchmarks/kernels.py times side by side on identical inputs (HND caches).

- kvledger: the worker's path (one AttentionPlan per step: the device planner once, then one
  launch per layer), timed per layer with the step's work list already built;
- FlashInfer's BatchDecodeWithPagedKVCacheWrapper (`flashinfer-python`, when installed) on the
  same HND pages, with and without tensor cores, planned outside the timing as a worker would;
- SDPA on K/V gathered from the pages (gather included), and SDPA "gather-free" on K/V that
  already sit dense per sequence (the same bytes without paging: what paging costs).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import kernels

Inputs = dict[str, Any]
Method = Callable[[], torch.Tensor]


def kvledger(backend: kernels.AttentionBackend, inp: Inputs, max_query_len: int) -> Method:
    """One layer of a step whose plan (and work list) already exists."""
    no_slots = torch.empty(0, dtype=torch.long, device=inp["query"].device)
    plan = backend.plan(
        no_slots, inp["block_tables"], inp["seq_lens"], inp["query_start_loc"], max_query_len,
        int(inp["seq_lens"].max()),
    )  # fmt: skip
    cache = (inp["key_cache"], inp["value_cache"])
    plan.attention(inp["query"], cache, inp["scale"])  # builds the step's work list
    return lambda: plan.attention(inp["query"], cache, inp["scale"])


def kvledger_step(backend: kernels.AttentionBackend, inp: Inputs, max_query_len: int) -> Method:
    """A step's first layer: the planner launch and its allocations, then the attention."""
    no_slots = torch.empty(0, dtype=torch.long, device=inp["query"].device)
    max_seq_len = int(inp["seq_lens"].max())

    def run() -> torch.Tensor:
        plan = backend.plan(
            no_slots, inp["block_tables"], inp["seq_lens"], inp["query_start_loc"],
            max_query_len, max_seq_len,
        )  # fmt: skip
        return plan.attention(inp["query"], (inp["key_cache"], inp["value_cache"]), inp["scale"])

    return run


def sdpa_gathered(inp: Inputs) -> Method:
    """Decode: gather every sequence's pages into dense K/V, then one batched SDPA call."""
    batch, _, head_dim = inp["query"].shape
    kv_heads, block_size = inp["key_cache"].shape[1], inp["key_cache"].shape[2]
    blocks = inp["block_tables"].long()
    context = blocks.shape[1] * block_size

    def run() -> torch.Tensor:
        # [batch, pages, heads, block, dim] -> [batch, heads, context, dim]
        key = inp["key_cache"][blocks].transpose(1, 2).reshape(batch, kv_heads, context, head_dim)
        value = inp["value_cache"][blocks].transpose(1, 2).reshape(batch, kv_heads, context, -1)
        q = inp["query"][:, :, None]
        out = F.scaled_dot_product_attention(q, key, value, scale=inp["scale"], enable_gqa=True)
        return out[:, :, 0]

    return run


def dense_kv(inp: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's K and V as dense [batch, kv_heads, context, dim] (made once, untimed)."""
    blocks = inp["block_tables"].long()
    batch, pages = blocks.shape
    kv_heads, block_size, head_dim = inp["key_cache"].shape[1:]
    shape = (batch, kv_heads, pages * block_size, head_dim)
    key = inp["key_cache"][blocks].transpose(1, 2).reshape(shape).contiguous()
    value = inp["value_cache"][blocks].transpose(1, 2).reshape(shape).contiguous()
    return key, value


def sdpa_dense_decode(inp: Inputs, key: torch.Tensor, value: torch.Tensor) -> Method:
    """Decode over K/V that are already dense: SDPA's own kernels, no paging, no gather."""
    q = inp["query"][:, :, None]
    return lambda: F.scaled_dot_product_attention(
        q, key, value, scale=inp["scale"], enable_gqa=True
    )[:, :, 0]


def sdpa_dense_prefill(inp: Inputs, key: torch.Tensor, value: torch.Tensor, q_len: int) -> Method:
    """Prefill/extend of q_len tokens per sequence over dense K/V (bottom-right causal)."""
    from torch.nn.attention.bias import causal_lower_right

    batch = key.shape[0]
    q = inp["query"].view(batch, q_len, -1, key.shape[-1]).transpose(1, 2)
    mask = causal_lower_right(q_len, key.shape[2])
    return lambda: F.scaled_dot_product_attention(
        q, key, value, attn_mask=mask, scale=inp["scale"], enable_gqa=True
    )


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


class FlashInferDecode:
    """FlashInfer's batch decode over the same HND pages (its JIT compiles on first use)."""

    def __init__(self, device: torch.device, use_tensor_cores: bool) -> None:
        import flashinfer

        self.workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "HND", use_tensor_cores=use_tensor_cores
        )
        self.version = flashinfer.__version__

    def prepare(self, inp: Inputs) -> Method:
        tables, seq_lens = inp["block_tables"], inp["seq_lens"]
        block_size = inp["key_cache"].shape[2]
        pages = (seq_lens + block_size - 1) // block_size
        indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=tables.device)
        indptr[1:] = pages.cumsum(0)
        indices = torch.cat([tables[i, : int(n)] for i, n in enumerate(pages.tolist())])
        last_page_len = (seq_lens - 1) % block_size + 1
        num_heads, head_dim = inp["query"].shape[1:]
        self.wrapper.plan(
            indptr, indices.to(torch.int32), last_page_len.to(torch.int32), num_heads,
            inp["key_cache"].shape[1], head_dim, block_size, q_data_type=inp["query"].dtype,
            kv_data_type=inp["key_cache"].dtype, sm_scale=inp["scale"],
        )  # fmt: skip
        cache = (inp["key_cache"], inp["value_cache"])
        return lambda: self.wrapper.run(inp["query"], cache)
