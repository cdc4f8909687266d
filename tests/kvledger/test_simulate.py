"""The blog's allocator tables reproduce exactly on our BlockPool, and our scheduler drains them."""

from __future__ import annotations

import pytest

from kvledger.simulate import prefix_granularity, run_blog_paged, run_contiguous, run_vllm
from kvledger.workloads import blog_lengths, blog_workload, shared_prefix_workload


@pytest.fixture(scope="module")
def lengths():
    return blog_lengths()


def test_blog_workload_matches_its_description(lengths):
    total = sum(p + o for p, o in lengths)
    assert len(lengths) == 400 and total == 276_007
    assert max(p + o for p, o in lengths) == 2_219


def test_contiguous_vs_paged_headline(lengths):
    contiguous = run_contiguous(lengths)
    paged = run_blog_paged(lengths)
    assert (contiguous.peak_concurrency, contiguous.steps, contiguous.avg_wait_steps) == (
        24,
        3_524,
        178.9,
    )
    assert (paged.peak_concurrency, paged.steps, paged.avg_wait_steps) == (157, 1_264, 180.3)
    assert (paged.preemptions, paged.internal_waste_pct) == (4, 1.02)
    assert (paged.peak_blocks_used, paged.total_blocks) == (6_247, 6_250)


@pytest.mark.parametrize(
    ("block_size", "peak", "waste", "preemptions", "steps"),
    [
        (8, 158, 0.50, 6, 1264),
        (16, 157, 1.02, 4, 1264),
        (32, 155, 2.18, 2, 1264),
        (64, 153, 4.58, 7, 1264),
        (128, 147, 9.08, 8, 1295),
    ],
)
def test_block_size_sweep(lengths, block_size, peak, waste, preemptions, steps):
    r = run_blog_paged(lengths, block_size)
    assert (r.peak_concurrency, r.internal_waste_pct, r.preemptions, r.steps, r.done) == (
        peak,
        waste,
        preemptions,
        steps,
        400,
    )


@pytest.mark.parametrize(
    ("watermark", "peak", "preemptions", "steps"),
    [
        (0.0, 157, 4, 1264),
        (0.01, 156, 0, 1264),
        (0.02, 154, 0, 1264),
        (0.05, 152, 0, 1265),
        (0.10, 145, 0, 1279),
    ],
)
def test_watermark_sweep(lengths, watermark, peak, preemptions, steps):
    r = run_blog_paged(lengths, 16, watermark)
    assert (r.peak_concurrency, r.preemptions, r.steps) == (peak, preemptions, steps)


def test_prefix_granularity_table():
    assert prefix_granularity(777, 16) == (768, 9, 1.16)
    assert prefix_granularity(1000, 16) == (992, 8, 0.80)
    assert prefix_granularity(1000, 64) == (960, 40, 4.00)
    assert prefix_granularity(3000, 8) == (3000, 0, 0.0)


def test_vllm_policy_finishes_every_request_and_returns_every_block():
    r = run_vllm(blog_workload())
    assert r.done == 400
    assert r.peak_blocks_used <= r.total_blocks
    assert r.peak_concurrency > 24  # paged beats the contiguous reservation


def test_prefix_caching_saves_prefill_on_a_shared_prefix_workload():
    workload = shared_prefix_workload(n=120, num_prefixes=4, prefix_len=512)
    cached = run_vllm(workload, enable_caching=True)
    uncached = run_vllm(workload, enable_caching=False)
    assert cached.done == uncached.done == 120
    assert uncached.prefix_hit_tokens == 0
    # Every request after the first of its prefix can reuse 512 // 16 = 32 blocks.
    assert cached.prefix_hit_tokens >= (120 - 4) * 512 * 0.9
    assert (
        cached.prefill_tokens_computed
        <= uncached.prefill_tokens_computed - cached.prefix_hit_tokens * 0.9
    )
    assert cached.blocks_allocated < uncached.blocks_allocated
