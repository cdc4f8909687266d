"""What a replica tells routers about itself: step costs fitted from its steps, the prefill
queued ahead of a new request, and the cached blocks its next allocations evict."""

from __future__ import annotations

import random

import pytest

from ledger.block_pool import BlockPool
from ledger.hashing import BlockHasher, to_event_hash
from ledger.kv_cache_manager import KVCacheManager
from ledger.request import Request
from ledger.scheduler import Scheduler, SchedulerConfig
from ledger.step_costs import MAX_EVICTION_HEAD, StepCostEstimator, eviction_horizon

HASHER = BlockHasher("sha256", seed="step-costs")


def test_the_fit_recovers_a_replicas_step_costs_from_noisy_mixed_steps() -> None:
    rng = random.Random(3)
    estimator = StepCostEstimator()
    for _ in range(2000):
        prefill = rng.choice([0, 0, rng.randrange(16, 2048)])
        decode = rng.randrange(1, 64)
        seconds = 0.008 + prefill / 20_000 + decode * 0.0004
        estimator.observe_step(prefill, decode, seconds * rng.uniform(0.95, 1.05))
    costs = estimator.estimate()
    assert costs.prefill_tokens_per_s == pytest.approx(20_000, rel=0.05)
    assert costs.step_s_per_seq == pytest.approx(0.0004, rel=0.1)
    assert costs.step_base_s == pytest.approx(0.008, rel=0.15)
    assert costs.steps == 2000


def test_a_term_no_step_exercised_stays_unknown_and_a_negative_one_is_dropped() -> None:
    decode_only = StepCostEstimator()
    for seqs in range(1, 40):
        decode_only.observe_step(0, seqs, 0.01 + seqs * 0.001)
    costs = decode_only.estimate()
    assert costs.prefill_tokens_per_s == 0.0  # never prefilled: not guessed
    assert costs.step_s_per_seq == pytest.approx(0.001)
    # Steps that get faster with more sequences (noise on a loaded machine): that term is
    # dropped, never priced below zero.
    odd = StepCostEstimator()
    for seqs in range(1, 40):
        odd.observe_step(100, seqs, 0.05 - seqs * 0.0005)
    assert odd.estimate().step_s_per_seq == 0.0
    assert StepCostEstimator().estimate().steps == 0


def test_new_workers_are_measured_afresh_and_their_warm_up_steps_left_out() -> None:
    # A replica whose worker was restarted: its old worker's steps, then the new worker's two
    # warm-up steps (seconds each), then its steady steps at the old worker's speed.
    estimator = StepCostEstimator()
    for _ in range(200):
        estimator.observe_step(128, 4, 0.004 + 128 / 20_000 + 4 * 0.001)
    estimator.observe_queue_wait(0.5)
    estimator.restart(skip_steps=2)
    assert estimator.estimate().steps == 0 and estimator.estimate().prefill_tokens_per_s == 0.0
    assert estimator.estimate().queue_wait_s == pytest.approx(0.5)  # the replica's, kept
    estimator.observe_step(139, 0, 2.5)
    estimator.observe_step(0, 1, 1.2)
    assert estimator.estimate().steps == 0  # warm-up: not a measurement
    for prefill, decode in [(139, 0), (0, 1), (139, 1), (278, 2)] * 8:
        estimator.observe_step(prefill, decode, 0.004 + prefill / 20_000 + decode * 0.001)
    costs = estimator.estimate()
    assert costs.steps == 32
    assert costs.prefill_tokens_per_s == pytest.approx(20_000, rel=0.01)
    # Without the restart, the warm-up steps alone would price it ~30x slower per token.
    unskipped = StepCostEstimator()
    unskipped.observe_step(139, 0, 2.5)
    unskipped.observe_step(0, 1, 1.2)
    for prefill, decode in [(139, 0), (0, 1), (139, 1), (278, 2)] * 8:
        unskipped.observe_step(prefill, decode, 0.004 + prefill / 20_000 + decode * 0.001)
    assert unskipped.estimate().prefill_tokens_per_s < 20_000 / 3


def test_the_queue_wait_is_a_mean_of_the_latest_waits() -> None:
    estimator = StepCostEstimator(queue_half_life=4)
    for _ in range(50):
        estimator.observe_queue_wait(2.0)
    assert estimator.estimate().queue_wait_s == pytest.approx(2.0)
    for _ in range(40):
        estimator.observe_queue_wait(0.0)
    assert estimator.estimate().queue_wait_s < 0.01


def run(scheduler: Scheduler, request: Request) -> None:
    scheduler.add_request(request)
    while request.request_id in scheduler.requests:
        out = scheduler.schedule()
        scheduler.update_from_output(out, {r: 7 for r in out.sampling_req_ids})


def test_the_eviction_head_lists_the_cached_free_blocks_in_the_order_they_go() -> None:
    manager = KVCacheManager(64, 16, 512)
    scheduler: Scheduler[None] = Scheduler(SchedulerConfig(max_model_len=512), manager)
    first, second = list(range(1000, 1000 + 64)), list(range(2000, 2000 + 48))
    run(scheduler, Request("a", first, 1, block_hasher=HASHER, block_size=16))
    run(scheduler, Request("b", second, 1, block_hasher=HASHER, block_size=16))
    pool = manager.block_pool
    positions, hashes, walked = pool.eviction_head(1000)
    assert walked == pool.get_num_free_blocks() == 63
    # The uncached blocks go first, then a's cached blocks (freed first), then b's; a request
    # frees its blocks last block first, so its tail is evicted before its head.
    expected = [to_event_hash(h) for h in HASHER.hash_blocks(first, 16)[::-1]]
    expected += [to_event_hash(h) for h in HASHER.hash_blocks(second, 16)[::-1]]
    assert hashes == expected
    assert positions == list(range(63 - len(expected), 63))
    # Allocating as many blocks as the first position evicts exactly the first listed block.
    evicted = pool.get_new_blocks(positions[0] + 1)
    assert [b.block_hash for b in evicted if b.block_hash] == []  # reset as they are evicted
    after = pool.eviction_head(1000)
    assert after[1] == expected[1:] and after[0][0] == 0  # the next to go is now in front
    assert pool.eviction_head(3) == ([0, 1, 2], expected[1:4], 3)  # a window: 3 positions
    assert isinstance(pool, BlockPool)


def test_the_prefill_queued_counts_what_waiting_requests_lack_and_running_ones_have_left() -> None:
    manager = KVCacheManager(256, 16, 2048)
    config = SchedulerConfig(max_model_len=2048, max_num_batched_tokens=100, max_num_seqs=1)
    scheduler: Scheduler[None] = Scheduler(config, manager)
    scheduler.add_request(Request("a", list(range(300)), 4, block_hasher=HASHER, block_size=16))
    scheduler.add_request(
        Request("b", list(range(500, 700)), 4, block_hasher=HASHER, block_size=16)
    )
    assert scheduler.queued_prefill_tokens() == 500
    scheduler.schedule()  # a prefills 100 of its 300 (one sequence at a time: b waits)
    assert scheduler.queued_prefill_tokens() == 199 + 200
    # A router that expected b to find 160 tokens cached says so: 40 left for b.
    expected = {"b": 160}
    assert scheduler.queued_prefill_tokens(lambda r: expected.get(r.request_id, 0)) == 199 + 40


def test_the_eviction_horizon_covers_the_queue_and_a_few_steps_and_is_capped() -> None:
    assert eviction_horizon(0, 2048, 16) == 4 * 128
    assert eviction_horizon(1600, 2048, 16) == 100 + 4 * 128
    assert eviction_horizon(10**9, 2048, 16) == MAX_EVICTION_HEAD
