"""How kernels/cuda.py cuts a batch into CTAs: the invariants the kernel relies on."""

from __future__ import annotations

import math

import pytest

from kernels.cuda import MAX_ROWS, MAX_SPLITS, TILE_KEYS, plan_launch

H200_SMS = 132


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("max_query_len", [1, 2, 7, 31])
@pytest.mark.parametrize("max_seq_len", [1, 31, 512, 4096, 100_000])
@pytest.mark.parametrize("num_seqs", [1, 16, 256])
def test_plan_covers_every_query_and_key(group, max_query_len, max_seq_len, num_seqs):
    plan = plan_launch(num_seqs, 8, group, max_query_len, max_seq_len, H200_SMS, 2)
    assert plan.q_tile * group <= MAX_ROWS
    assert plan.q_tile * plan.q_tiles_per_seq >= max_query_len
    assert plan.split_keys % TILE_KEYS == 0
    assert 1 <= plan.num_splits <= MAX_SPLITS
    assert plan.num_splits * plan.split_keys >= max_seq_len
    assert (plan.num_splits - 1) * plan.split_keys < max(1, max_seq_len)  # none left empty


def test_long_context_small_batch_splits_to_fill_the_gpu():
    plan = plan_launch(1, 8, 4, 1, 16384, H200_SMS, 2)
    assert plan.num_splits * 8 >= H200_SMS  # at least one CTA per SM


def test_batch_that_fills_the_gpu_is_not_split():
    # 256 sequences x 8 KV heads is ~8 full waves of 2 CTAs per SM already
    assert plan_launch(256, 8, 4, 1, 4096, H200_SMS, 2).num_splits == 1


def test_explicit_split_count_is_honoured_up_to_one_tile_per_split():
    assert plan_launch(2, 2, 4, 1, 1000, 4, 2, num_splits=5).num_splits == 5
    assert plan_launch(2, 2, 4, 1, 40, 4, 2, num_splits=5).num_splits == math.ceil(40 / TILE_KEYS)
