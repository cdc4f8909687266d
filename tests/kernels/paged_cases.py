"""Random paged batches for the kernel tests: dense K/V per sequence scattered into shuffled
pages of a NaN-filled cache, so any read outside a sequence's own slots poisons the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import AttentionBackend, AttentionPlan, kv_cache_shape, reference


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_dim] (HND)
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    slot_mapping: torch.Tensor  # [num_tokens_written] int64, the slots of every K/V row
    keys: list[torch.Tensor]  # per sequence, unpaged [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    scale: float

    @property
    def q_lens(self) -> list[int]:
        return self.query_start_loc.diff().tolist()

    @property
    def kv_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key_cache, self.value_cache

    def plan(
        self,
        backend: AttentionBackend,
        max_query_len: int | None = None,
        max_seq_len: int | None = None,
    ) -> AttentionPlan:
        """The step plan a worker would build for this batch (maxima computed when not given)."""
        return backend.plan(
            self.slot_mapping,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            max(self.q_lens, default=0) if max_query_len is None else max_query_len,
            int(self.seq_lens.max()) if max_seq_len is None else max_seq_len,
        )

    def attend(self, backend: AttentionBackend, **hints: int) -> torch.Tensor:
        """The batch's attention through `backend`'s plan, as a model layer runs it."""
        return self.plan(backend, **hints).attention(self.query, self.kv_cache, self.scale)

    def attention_args(self) -> tuple:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
        )


def make_batch(
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    padding_tokens: int = 0,
) -> PagedBatch:
    """A batch whose sequence s has seq_lens[s] cached tokens, the last q_lens[s] of them new.

    Blocks are handed out in a random order, block-table rows are padded with a spare NaN
    block, and every slot past a sequence's length is NaN too.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # + spare pages that only padding points at
    order = torch.randperm(num_blocks, generator=gen).tolist()
    spare = order.pop()
    max_blocks = max(blocks_per_seq) + 1
    table = torch.full((len(seq_lens), max_blocks), spare, dtype=torch.int32)
    for seq, count in enumerate(blocks_per_seq):
        table[seq, :count] = torch.tensor([order.pop() for _ in range(count)])

    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
    slots = torch.cat(
        [
            table[s, torch.arange(n) // block_size].long() * block_size
            + torch.arange(n) % block_size
            for s, n in enumerate(seq_lens)
        ]
    )
    reference.reshape_and_cache(torch.cat(keys), torch.cat(values), key_cache, value_cache, slots)

    num_tokens = sum(q_lens) + padding_tokens
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    put = lambda t: t.to(device)  # noqa: E731
    return PagedBatch(
        query=put(query),
        key_cache=put(key_cache),
        value_cache=put(value_cache),
        block_tables=put(table),
        seq_lens=put(torch.tensor(seq_lens, dtype=torch.int32)),
        query_start_loc=put(starts),
        slot_mapping=put(slots),
        keys=[put(k) for k in keys],
        values=[put(v) for v in values],
        scale=head_dim**-0.5,
    )


def dense_attention(batch: PagedBatch, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The expected output, from the unpaged K/V with SDPA and a `tril` causal mask.

    Written independently of `kernels.reference`: a different mask construction and explicit
    GQA expansion with `expand`, computed in float64. Padding rows are zero.
    """
    out = torch.zeros(batch.query.shape, dtype=dtype, device=batch.query.device)
    starts = batch.query_start_loc.tolist()
    num_heads = batch.query.shape[1]
    for seq, (key, value) in enumerate(zip(batch.keys, batch.values, strict=True)):
        q = batch.query[starts[seq] : starts[seq + 1]].to(dtype)
        q_len, seq_len, kv_heads = q.shape[0], key.shape[0], key.shape[1]
        if q_len == 0:
            continue
        group = num_heads // kv_heads
        k = key.to(dtype)[:, :, None].expand(-1, -1, group, -1).reshape(seq_len, num_heads, -1)
        v = value.to(dtype)[:, :, None].expand(-1, -1, group, -1).reshape(seq_len, num_heads, -1)
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device)
        mask = mask.tril(diagonal=seq_len - q_len)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            scale=batch.scale,
        )
        out[starts[seq] : starts[seq + 1]] = o.transpose(0, 1)
    return out


# Ragged shapes every attention test covers: a long prefill, an extend over a cached prefix
# ending exactly on a block boundary, decodes (one of length 1), and an idle sequence.
def ragged_lengths(block_size: int) -> tuple[list[int], list[int]]:
    seq_lens = [3 * block_size + 5, 2 * block_size, 1, 5 * block_size - 3, 7, block_size + 1]
    q_lens = [3 * block_size + 5, block_size + 3, 1, 1, 0, 2]
    return seq_lens, q_lens


def decode_lengths(block_size: int) -> tuple[list[int], list[int]]:
    seq_lens = [1, block_size, 2 * block_size, 7 * block_size + 9, 300, 33]
    return seq_lens, [1] * len(seq_lens)
