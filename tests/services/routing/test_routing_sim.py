"""The at-scale simulation on small traces (the project's own and a window of the public one):
the real ledger cores, every policy, a restart, eviction awareness, several gateways."""

from __future__ import annotations

import json

import pytest

from ledger.hashing import BlockHasher
from services.routing.costs import RoutingWeights
from tests.harness.routing_sim import (
    HashedWorkload,
    ReplicaConfig,
    RoutingSimulation,
    StepModel,
    StepSpan,
    saturated_window,
)
from tests.harness.routing_workload import (
    TraceReplay,
    WorkloadConfig,
    multi_tenant_workload,
    trace_turns,
)

CONFIG = WorkloadConfig(num_conversations=90, rate=300.0, num_system_prompts=8, seed=7)


@pytest.fixture(scope="module")
def work() -> HashedWorkload:
    return HashedWorkload(multi_tenant_workload(CONFIG), BlockHasher("sha256", seed="t"), 16)


def test_the_workload_replays_from_its_seed_and_follow_ups_extend_their_conversation() -> None:
    a, b = multi_tenant_workload(CONFIG), multi_tenant_workload(CONFIG)
    assert a == b
    follow_ups = [t for t in a if t.previous is not None]
    assert follow_ups
    for turn in follow_ups:
        before = a[turn.previous]  # type: ignore[index]
        history = before.prompt_token_ids + before.output_token_ids
        assert turn.prompt_token_ids[: len(history)] == history


@pytest.fixture(scope="module")
def results(work: HashedWorkload) -> dict:
    return {
        p: RoutingSimulation(work, p, 4).run()
        for p in ("round_robin", "least_loaded", "approx", "precise", "oracle")
    }


def test_every_request_finishes_and_every_output_token_is_counted(results: dict, work) -> None:
    outputs = sum(t.max_tokens for t in work.turns)
    for result in results.values():
        assert result.requests == len(work.turns)
        assert result.output_tokens == outputs
        assert len(result.hit_by_request) == len(work.turns)


def test_cache_aware_policies_prefill_less_than_round_robin(results: dict) -> None:
    rr = results["round_robin"]
    for policy in ("approx", "precise", "oracle"):
        assert results[policy].prefill_tokens < 0.8 * rr.prefill_tokens, policy
        assert results[policy].hit_rate > rr.hit_rate + 0.05, policy
    # The events tell precise what the oracle sees, one step late.
    assert results["precise"].hit_rate >= 0.95 * results["oracle"].hit_rate


def test_a_restarted_precise_router_resumes_and_approx_starts_empty(work) -> None:
    middle = len(work.turns) // 2
    precise = RoutingSimulation(work, "precise", 4, restart_at=middle, restart_window=60).run()
    approx = RoutingSimulation(work, "approx", 4, restart_at=middle, restart_window=60).run()
    assert len(precise.restart_window) == 60
    assert (
        precise.restart_window_hit_rate is not None and approx.restart_window_hit_rate is not None
    )
    assert precise.restart_window_hit_rate > approx.restart_window_hit_rate


@pytest.mark.parametrize("status_interval_s", [0.0, 1.0])
def test_precise_keeps_up_with_approx_and_the_oracle_with_current_or_published_loads(
    work: HashedWorkload, status_interval_s: float
) -> None:
    """Precise and the oracle count what they sent and was not yet finished as cached where
    they sent it (their sources see only computed blocks); with loads published once a second,
    every policy adds what it sent since. Precise is then level with the oracle, not behind
    approx (it was, at 8 and 64 replicas, when a small LRU of sent blocks forgot queued ones)."""
    run = {
        p: RoutingSimulation(work, p, 4, status_interval_s=status_interval_s).run()
        for p in ("round_robin", "approx", "precise", "oracle")
    }
    assert run["precise"].hit_rate >= run["approx"].hit_rate
    assert run["precise"].hit_rate >= 0.99 * run["oracle"].hit_rate
    assert run["precise"].prefill_tokens < 0.6 * run["round_robin"].prefill_tokens
    assert all(r.output_tokens == sum(t.max_tokens for t in work.turns) for r in run.values())


def test_the_saturated_window_is_the_longest_stretch_with_every_replica_busy() -> None:
    steps = [
        StepSpan("r0", 0.0, 1.0, 2),  # half inside the window: 1 token
        StepSpan("r0", 1.0, 3.0, 4),
        StepSpan("r0", 3.0, 4.0, 1),  # half inside: 0.5
        StepSpan("r1", 0.5, 2.0, 0),  # a prefill step: busy, no output
        StepSpan("r1", 2.0, 3.5, 3),  # r1 idle at 3.5: the window closes
        StepSpan("r1", 5.0, 8.0, 6),
        StepSpan("r0", 6.0, 7.0, 3),  # both busy again, 1 s: shorter than the first stretch
        StepSpan("r0", 8.0, 9.0, 5),  # r1 idle at 8, r0 busy from 8: a hand-over, no window
        StepSpan("r1", 9.0, 12.0, 9),
    ]
    window = saturated_window(["r0", "r1"], steps)
    assert window is not None
    assert (window.start_s, window.end_s) == (0.5, 3.5)
    assert window.output_tokens == pytest.approx(1 + 4 + 0.5 + 3)
    assert window.throughput_tok_s == pytest.approx(8.5 / 3)
    # A replica that never steps: never all busy.
    assert saturated_window(["r0", "r1", "r2"], steps) is None


def test_each_run_reports_a_saturated_window_inside_its_makespan(results: dict) -> None:
    for result in results.values():
        window = result.saturated
        assert window is not None
        assert 0 <= window.start_s < window.end_s <= result.makespan_s
        assert 0 < window.output_tokens < result.output_tokens


# --- the public trace (Mooncake FAST'25, ../shared/traces) ---------------------------------

TRACE_WINDOW = TraceReplay(first=3300, count=600)  # a window where reuse is high (60%)


@pytest.fixture(scope="module")
def trace() -> HashedWorkload:
    if not TRACE_WINDOW.path.exists():
        pytest.skip(f"the public trace is not at {TRACE_WINDOW.path}")
    return HashedWorkload(trace_turns(TRACE_WINDOW), BlockHasher("sha256", seed="t"), 16)


def test_the_trace_replays_each_hash_id_as_a_fixed_run_of_tokens() -> None:
    if not TRACE_WINDOW.path.exists():
        pytest.skip("no public trace here")
    turns = trace_turns(TraceReplay(count=30))
    again = trace_turns(TraceReplay(first=10, count=5))
    assert turns[10:15] == again  # a window is the same requests, token for token
    assert all(len(t.prompt_token_ids) % 16 == 0 for t in turns)
    assert all(len(t.prompt_token_ids) <= 32 * 16 and t.max_tokens == 4 for t in turns)
    # Two requests that share their leading hash ids share exactly those token runs.
    rows = [json.loads(line) for line in TRACE_WINDOW.path.open().readlines()[:30]]
    for first in range(30):
        for second in range(first + 1, 30):
            ids_a, ids_b = rows[first]["hash_ids"][:32], rows[second]["hash_ids"][:32]
            shortest = min(len(ids_a), len(ids_b))
            common = next((k for k in range(shortest) if ids_a[k] != ids_b[k]), shortest)
            tokens_a = turns[first].prompt_token_ids
            tokens_b = turns[second].prompt_token_ids
            assert tokens_a[: 16 * common] == tokens_b[: 16 * common]
            if common < shortest:
                cut = slice(16 * common, 16 * common + 16)
                assert tokens_a[cut] != tokens_b[cut]


def test_precise_on_the_public_trace_holds_what_one_replicas_cache_would(trace) -> None:
    """Closed loop at 8, 4 replicas each with the cache that holds the window, steps timed as
    the tiny model's on a CPU (fitted on the real runs), loads and eviction heads published as
    the ledgers do (1 s, 0.2 s): precise with the measured costs hits >= 95% of what one
    replica's single cache hits, with a lower TTFT p99 than round robin (the issue's 9.7-11.2%
    of 17.3% came from the hand-set default weights, which the same run shows falling short)."""
    replica = ReplicaConfig(num_blocks=8192)
    cpu = StepModel(base_s=0.0, prefill_token_s=0.00054, decode_seq_s=0.013)
    single = RoutingSimulation(
        trace, "round_robin", 1, replica=replica, steps=cpu, concurrency=8
    ).run()
    run = {
        label: RoutingSimulation(
            trace,
            policy,
            4,
            replica=replica,
            steps=cpu,
            concurrency=8,
            status_interval_s=1.0,
            costs=costs,
        ).run()
        for label, policy, costs in (
            ("round_robin", "round_robin", None),
            ("precise", "precise", None),
            ("weights", "precise", RoutingWeights()),
        )
    }
    assert single.hit_rate > 0.4
    assert run["precise"].hit_rate >= 0.95 * single.hit_rate
    assert run["weights"].hit_rate < 0.9 * single.hit_rate
    assert run["precise"].prefill_tokens < 0.7 * run["round_robin"].prefill_tokens
    assert run["precise"].ttft_p99_s <= 1.1 * run["round_robin"].ttft_p99_s


def test_eviction_awareness_keeps_routed_hits_from_falling_short(trace) -> None:
    """Small caches, a queue at every replica (64 in flight over 4): a cached block near the
    front of the free queue is evicted by the prefills queued ahead of the request. Counting
    only what survives them, precise sends fewer requests to a prefix that will be gone."""
    replica = ReplicaConfig(num_blocks=600)
    runs = {
        aware: RoutingSimulation(
            trace, "precise", 4, replica=replica, concurrency=64, eviction_aware=aware
        ).run()
        for aware in (True, False)
    }
    assert runs[True].routed_hit_blocks > 0 and runs[True].evicted_blocks > 0
    assert runs[False].evicted_blocks == 0
    assert runs[True].shortfall_share <= 0.01 < runs[False].shortfall_share
    assert runs[True].shortfall_blocks * 5 < runs[False].shortfall_blocks


def test_three_gateways_sharing_what_they_sent_route_as_one(trace) -> None:
    replica = ReplicaConfig(num_blocks=8192)
    settings = {"replica": replica, "concurrency": 8, "status_interval_s": 1.0}
    one = RoutingSimulation(trace, "precise", 4, **settings).run()
    three = RoutingSimulation(trace, "precise", 4, gateways=3, **settings).run()
    assert three.hit_rate >= 0.98 * one.hit_rate


def test_gateways_that_share_what_they_sent_keep_a_burst_together(work: HashedWorkload) -> None:
    """The tenants' bursts of one new system prompt, dealt to 3 gateways in turn: sharing what
    each sent (through Redis, 1 ms late) they route as one gateway does; each on its own they
    spread the burst and prefill more."""
    settings = {"status_interval_s": 1.0}
    one = RoutingSimulation(work, "precise", 4, **settings).run()
    shared = RoutingSimulation(work, "precise", 4, gateways=3, **settings).run()
    alone = RoutingSimulation(work, "precise", 4, gateways=3, share_pending=False, **settings).run()
    assert shared.hit_rate >= 0.98 * one.hit_rate
    assert alone.prefill_tokens > 1.05 * shared.prefill_tokens
