"""The attention backend a worker runs for its whole life (the interface and the torch
reference), and the plan of one step. `kernels.select` picks the backend at start-up and
`kernels.cuda_backend` holds the CUDA one.

A step builds one `AttentionPlan` (the paged-attention inputs every layer shares) through
`backend.plan(...)`; the model's layers only call `plan.write_kv` and `plan.attention`, and the
worker runs the model through `backend.execute`, which replays CUDA graphs for decode steps on
the CUDA backend. The KV cache is HND: `kv_cache_shape` gives it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kernels import reference

BACKEND_CHOICES = ("auto", "cuda", "reference")
KVCache = tuple[torch.Tensor, torch.Tensor]  # (key_cache, value_cache), each kv_cache_shape(...)
Forward = Callable[[torch.Tensor, torch.Tensor, "AttentionPlan"], torch.Tensor]


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """The shape of one layer's key (and value) cache: HND, [num_blocks, num_kv_heads,
    block_size, head_dim], so one KV head's page is one contiguous block_size * head_dim run
    that a warp of the kernels copies in whole (docs/kernels.md, "The KV cache layout")."""
    return (num_blocks, num_kv_heads, block_size, head_dim)


class BackendError(RuntimeError):
    """The requested attention backend cannot run here; the text says what to change."""


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """What the kernels must cover: the model's attention shape, its dtype and the device."""

    device: torch.device
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


@dataclass(slots=True)
class AttentionPlan:
    """The paged-attention inputs of one step, shared by every layer (built by `backend.plan`).

    slot_mapping: [num_tokens] int64, block_id * block_size + offset (negative: padding);
    block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32, each context length
    INCLUDING this step's tokens; query_start_loc: [num_seqs + 1] int32, cumulative query
    lengths; max_query_len / max_seq_len: the host-side maxima (upper bounds are fine).
    `prepared` is what the backend builds once for the step at the first layer's call (the
    CUDA kernels' work list) and every later layer reuses.
    """

    backend: AttentionBackend
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    prepared: Any = None

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache) -> None:
        """Write this step's K/V ([num_tokens, num_kv_heads, head_dim]) into their slots."""
        self.backend.write_kv(key, value, kv_cache, self)

    def attention(self, query: torch.Tensor, kv_cache: KVCache, scale: float) -> torch.Tensor:
        """Causal attention of the step's queries over the paged cache (K/V already written).

        The i-th of sequence s's q_len queries sits at position seq_len - q_len + i and attends
        to positions 0..that position. Returns [num_tokens, num_heads, head_dim]."""
        return self.backend.attention(query, kv_cache, self, scale)


class AttentionBackend(abc.ABC):
    """One way to run paged attention; a worker picks one at start-up (`select_backend`)."""

    name: ClassVar[str]  # reported in the worker's hello, the ledger's /health and metrics

    def plan(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        max_query_len: int,
        max_seq_len: int,
    ) -> AttentionPlan:
        """The one plan object of a step (built once, used by every layer)."""
        return AttentionPlan(
            self, slot_mapping, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len
        )

    def execute(
        self,
        forward: Forward,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        """Runs `forward(input_ids, positions, plan)`, the model's step (hidden states out)."""
        return forward(input_ids, positions, plan)

    def use_cuda_graphs(self, forward: Forward, block_size: int, max_blocks_per_seq: int) -> None:
        """Replay `forward`'s decode steps from CUDA graphs where the backend can (a no-op
        here); `max_blocks_per_seq` bounds the block tables the graphs take."""
        del forward, block_size, max_blocks_per_seq

    @abc.abstractmethod
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, plan: AttentionPlan
    ) -> None: ...

    @abc.abstractmethod
    def attention(
        self, query: torch.Tensor, kv_cache: KVCache, plan: AttentionPlan, scale: float
    ) -> torch.Tensor: ...


class TorchReference(AttentionBackend):
    """`kernels.reference` on any device: the semantics the CUDA kernels must match."""

    name = "torch-reference"

    # `plan.prepared`: (SlotIndex, AttentionIndex), derived at the first layer's call from the
    # plan alone and reused by every later layer (the indices, masks and host copies of the
    # lengths were a third of a decode step's CPU time on SmolLM2's 30 layers).

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, plan: AttentionPlan
    ) -> None:
        slots, _ = self._prepared(plan, key.shape[0], kv_cache[0].shape[2])
        reference.reshape_and_cache(key, value, *kv_cache, plan.slot_mapping, slots)

    def attention(
        self, query: torch.Tensor, kv_cache: KVCache, plan: AttentionPlan, scale: float
    ) -> torch.Tensor:
        _, attention = self._prepared(plan, query.shape[0], kv_cache[0].shape[2])
        return reference.paged_attention(
            query, *kv_cache, plan.block_tables, plan.seq_lens, plan.query_start_loc, scale,
            plan.max_query_len, plan.max_seq_len, index=attention,
        )  # fmt: skip

    @staticmethod
    def _prepared(
        plan: AttentionPlan, num_tokens: int, block_size: int
    ) -> tuple[reference.SlotIndex, reference.AttentionIndex]:
        if plan.prepared is None:
            plan.prepared = (
                reference.SlotIndex.of(plan.slot_mapping, block_size),
                reference.AttentionIndex.of(
                    num_tokens, plan.block_tables, plan.seq_lens, plan.query_start_loc,
                    block_size,
                ),
            )  # fmt: skip
        return plan.prepared
