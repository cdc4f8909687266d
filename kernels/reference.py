"""Pure-torch paged KV-cache ops: the semantics every CUDA kernel in `kernels/` must match.

Runs on any device. The worker runs it on the CPU (the `TorchReference` backend), on a GPU only
when asked for (`--kernels reference`); it is the ground truth the kernel tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ints (the kernels stand alone: the services' is ledger.capacity.cdiv)."""
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class SlotIndex:
    """Where a step's new K/V rows go (from its slot mapping alone): the same for every layer."""

    rows: torch.Tensor | None  # rows of the step that have a slot; None: every row
    blocks: torch.Tensor  # [rows] int64
    offsets: torch.Tensor  # [rows] int64

    @classmethod
    def of(cls, slot_mapping: torch.Tensor, block_size: int) -> SlotIndex:
        valid = slot_mapping >= 0
        rows = None if bool(valid.all()) else valid
        slots = (slot_mapping if rows is None else slot_mapping[rows]).to(torch.long)
        return cls(rows, slots // block_size, slots % block_size)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    index: SlotIndex | None = None,
) -> None:
    """Scatter new tokens' K/V rows into their slots; negative slots are padding and skipped.

    The cache is HND (`[num_blocks, num_kv_heads, block_size, head_dim]`): slot
    `block_id * block_size + offset` of token t puts head h's row at `cache[block_id, h, offset]`.
    `index` is `SlotIndex.of(slot_mapping, block_size)`, passed when it was derived already.
    """
    if index is None:
        index = SlotIndex.of(slot_mapping, key_cache.shape[2])
    for new, cache in ((key, key_cache), (value, value_cache)):
        rows = new if index.rows is None else new[index.rows]
        cache[index.blocks, :, index.offsets] = rows.to(cache.dtype)


def gather_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `seq_len` K and V rows, unpaged: two `[seq_len, kv_heads, dim]`."""
    block_size = key_cache.shape[2]
    num_blocks = cdiv(seq_len, block_size)
    blocks = block_table[:num_blocks].to(torch.long)
    key = key_cache[blocks].transpose(1, 2).flatten(0, 1)[:seq_len]
    value = value_cache[blocks].transpose(1, 2).flatten(0, 1)[:seq_len]
    return key, value


def causal_mask(q_len: int, seq_len: int, device: torch.device) -> torch.Tensor | None:
    """Bool mask `[q_len, seq_len]`: query i (at position seq_len - q_len + i) sees keys <= it.

    None when every query sees every key (a single query at the end of the sequence).
    """
    if q_len == 1:
        return None
    positions = torch.arange(seq_len - q_len, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= positions[:, None]


def attend_one_sequence(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    compute_dtype: torch.dtype | None = torch.float32,
) -> torch.Tensor:
    """Causal attention of `[q_len, heads, dim]` queries over unpaged `[seq_len, kv_heads, dim]`.

    `compute_dtype=None` keeps the inputs' dtype (so CUDA picks a fused SDPA backend); the
    default upcasts to fp32, which is what the reference means by "the right answer".
    """
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    dtype = compute_dtype or query.dtype
    q = query.transpose(0, 1).to(dtype)
    # GQA: query head h reads KV head h // group, so repeat each KV head `group` times in order.
    k = key.transpose(0, 1).to(dtype).repeat_interleave(group, dim=0)
    v = value.transpose(0, 1).to(dtype).repeat_interleave(group, dim=0)
    if q_len == seq_len and q_len > 1:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        mask = causal_mask(q_len, seq_len, query.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@dataclass(frozen=True, slots=True)
class AttentionIndex:
    """What a step's attention reads (from its block tables and lengths alone), derived once and
    shared by every layer: the query ranges, and for a decode-shaped step (one query per
    sequence) the blocks to gather and the padding to mask."""

    starts: list[int]
    lens: list[int]
    decode_blocks: torch.Tensor | None  # [seqs, blocks] int64: a decode-shaped step only
    max_len: int = 0
    valid: torch.Tensor | None = None  # [seqs, max_len]; None: no sequence is shorter

    @classmethod
    def of(
        cls,
        query_len: int,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        block_size: int,
    ) -> AttentionIndex:
        starts = query_start_loc.tolist()
        lens = seq_lens.tolist()
        num_seqs = len(lens)
        if (
            not (num_seqs and starts == list(range(num_seqs + 1)) and query_len == num_seqs)
            or min(lens) <= 0
        ):
            return cls(starts, lens, None)
        max_len = max(lens)
        blocks = block_tables[:, : cdiv(max_len, block_size)].to(torch.long)
        valid = None
        if min(lens) < max_len:
            positions = torch.arange(max_len, device=seq_lens.device)[None, :]
            valid = positions < seq_lens[:, None].long()
        return cls(starts, lens, blocks, max_len, valid)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    compute_dtype: torch.dtype | None = torch.float32,
    index: AttentionIndex | None = None,
) -> torch.Tensor:
    """Causal attention of a ragged batch over the paged cache (`kernels.AttentionPlan.attention`).

    One gather + SDPA per sequence. Rows past `query_start_loc[-1]` (padding) come back zero.
    `index` is `AttentionIndex.of(...)` of these arguments, passed when it was derived already.
    """
    del max_query_len, max_seq_len  # hints for the CUDA path; the reference syncs anyway
    if index is None:
        index = AttentionIndex.of(
            query.shape[0], block_tables, seq_lens, query_start_loc, key_cache.shape[2]
        )
    if index.decode_blocks is not None:
        return decode_batch(query, key_cache, value_cache, block_tables, seq_lens, scale, index)
    out = torch.zeros_like(query)
    starts = index.starts
    for seq, seq_len in enumerate(index.lens):
        begin, end = starts[seq], starts[seq + 1]
        q_len = end - begin
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(
                f"sequence {seq} has {q_len} new tokens but seq_len {seq_len}; seq_lens must "
                "count the context including this step's tokens"
            )
        key, value = gather_kv(key_cache, value_cache, block_tables[seq], seq_len)
        attended = attend_one_sequence(query[begin:end], key, value, scale, compute_dtype)
        out[begin:end] = attended.to(out.dtype)
    return out


def decode_batch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    index: AttentionIndex | None = None,
) -> torch.Tensor:
    """One query per sequence, all sequences in one padded SDPA call (the common decode step).

    Pads every sequence's K/V to the longest one and masks the padding out, which on CPU is far
    cheaper than a Python loop of small SDPA calls.
    """
    if index is None or index.decode_blocks is None:
        index = AttentionIndex.of(
            query.shape[0], block_tables, seq_lens,
            torch.arange(query.shape[0] + 1), key_cache.shape[2],
        )  # fmt: skip
    assert index.decode_blocks is not None
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    blocks, max_len, valid = index.decode_blocks, index.max_len, index.valid
    # [seqs, blocks, heads, block_size, dim] -> [seqs, positions, heads, dim]
    key = key_cache[blocks].transpose(2, 3).flatten(1, 2)[:, :max_len]
    value = value_cache[blocks].transpose(2, 3).flatten(1, 2)[:, :max_len]
    if valid is not None:
        # Slots past seq_len may hold anything (even NaN): zero them so 0-weight * NaN cannot
        # leak. Without a shorter sequence there is no such slot, and no mask to apply.
        pad = ~valid[:, :, None, None]
        key, value = key.masked_fill(pad, 0.0), value.masked_fill(pad, 0.0)
    # GQA without copying K/V: a KV head's query heads become its "query length" axis.
    group = num_heads // num_kv_heads
    q = query.reshape(num_seqs, num_kv_heads, group, head_dim).float()
    out = F.scaled_dot_product_attention(
        q,
        key.transpose(1, 2).float(),
        value.transpose(1, 2).float(),
        attn_mask=None if valid is None else valid[:, None, None, :],
        scale=scale,
    )
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)
