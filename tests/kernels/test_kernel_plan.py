"""The device-side planner (csrc/attention_plan.cuh, run under the host emulation): the work
list covers every query token and every key it sees exactly once, stays inside its buffers,
and splits long contexts only when that fills an otherwise idle GPU."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
import torch

from kernels import cuda
from kernels.library import CHUNK_ALIGN, KernelLibrary

H200_SMS = 132


@dataclass
class Item:
    seq: int
    q_begin: int
    n_tok: int
    first_pos: int
    kv_begin: int
    kv_end: int
    tile: int
    num_chunks: int
    chunk: int
    first_slot: int


def plan(
    library: KernelLibrary,
    seq_lens: list[int],
    q_lens: list[int],
    heads: int = 32,
    kv_heads: int = 8,
    num_sms: int = H200_SMS,
    padding_tokens: int = 0,
) -> tuple[cuda.WorkList, list[Item]]:
    qsl = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    work = cuda.plan_work(
        library, torch.tensor(seq_lens, dtype=torch.int32), qsl,
        sum(q_lens) + padding_tokens, heads, kv_heads, 128, torch.bfloat16, 16, max(q_lens),
        num_sms, stream=0,
    )  # fmt: skip
    rows = work.items[: int(work.num_items.item())].tolist()
    return work, [Item(*row[:10]) for row in rows]


def check_covers_everything_once(
    work: cuda.WorkList, items: list[Item], seq_lens: list[int], q_lens: list[int]
) -> None:
    assert len(items) <= work.items.shape[0]
    tiles: dict[int, list[Item]] = {}
    for item in items:
        tiles.setdefault(item.tile, []).append(item)
    # Query tokens: every sequence's, in tiles of at most q_tile, each token in one tile.
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    covered = []
    slots_used: set[int] = set()
    for tile, chunks in tiles.items():
        assert tile < work.tiles.shape[0]
        first = chunks[0]
        assert 1 <= first.n_tok <= work.q_tile
        assert [c.chunk for c in chunks] == list(range(first.num_chunks))
        seq = first.seq
        offset = first.q_begin - starts[seq]
        assert first.first_pos == seq_lens[seq] - q_lens[seq] + offset
        covered += [(seq, offset + i) for i in range(first.n_tok)]
        # Keys: the chunks cut [0, extent) in order, each starting on a chunk boundary.
        extent = first.first_pos + first.n_tok
        assert next((c.kv_begin, c.kv_end) for c in chunks)[0] == 0
        assert chunks[-1].kv_end == extent
        for a, b in itertools.pairwise(chunks):
            assert a.kv_end == b.kv_begin
        assert all(c.kv_begin % CHUNK_ALIGN == 0 and c.kv_begin < c.kv_end for c in chunks)
        if first.num_chunks == 1:
            assert first.first_slot == -1
        else:
            assert first.n_tok * 4 <= work.slot_rows  # only tiles whose rows fit a slot split
            slots = set(range(first.first_slot, first.first_slot + first.num_chunks))
            assert not slots & slots_used and max(slots) < work.max_slots
            slots_used |= slots
    expected = [(s, i) for s, n in enumerate(q_lens) for i in range(n)]
    assert sorted(covered) == expected


RANDOM_BATCHES = [(seed, random.Random(seed).choice([1, 4, 40, 300])) for seed in range(12)]


@pytest.mark.parametrize(("seed", "num_seqs"), RANDOM_BATCHES)
def test_work_list_covers_every_token_and_key_once(library, seed, num_seqs):
    rng = random.Random(seed)
    seq_lens = [rng.choice([1, 2, 63, 64, 65, 700, 5000, 40_000]) for _ in range(num_seqs)]
    q_lens = [rng.choice([0, 1, 1, 1, 3, 17, 200]) for _ in range(num_seqs)]
    q_lens = [min(q, n) for q, n in zip(q_lens, seq_lens, strict=True)]
    q_lens[0] = max(q_lens[0], 1)
    work, items = plan(library, seq_lens, q_lens, num_sms=rng.choice([4, 132]), padding_tokens=3)
    check_covers_everything_once(work, items, seq_lens, q_lens)


def test_long_context_small_batch_splits_to_fill_the_gpu(library):
    _, items = plan(library, [16384], [1], kv_heads=8)
    assert 132 <= len(items) * 8 <= 2 * 2 * 132  # about one wave of 2 CTAs per SM


def test_batch_that_fills_the_gpu_is_not_split(library):
    # 256 sequences x 8 KV heads is ~8 waves of 2 CTAs per SM already.
    _, items = plan(library, [4096] * 256, [1] * 256, kv_heads=8)
    assert len(items) == 256 and all(i.num_chunks == 1 for i in items)


def test_split_chunk_sizes_follow_each_sequences_own_length(library):
    # One long and many short sequences: only the long one is cut, not the batch's maximum.
    _, items = plan(library, [100_000] + [200] * 31, [1] * 32, kv_heads=8)
    chunks = {i.seq: i.num_chunks for i in items}
    assert chunks[0] > 1 and all(chunks[s] == 1 for s in range(1, 32))


def test_prefill_tiles_take_the_tile_rows_and_never_split_past_their_slots(library):
    work, items = plan(library, [3000, 9], [3000, 1], heads=32, kv_heads=8)
    assert work.q_tile == 16  # 64 rows / 4 query heads per KV head
    assert sum(i.n_tok for i in items if i.chunk == 0) == 3001
