"""The routing core: hashing as the ledger does, the index from KV events, every policy's pick."""

from __future__ import annotations

import pytest

from ledger.events import KVEventBatch
from ledger.hashing import BlockHasher
from ledger.kv_cache_manager import KVCacheManager
from ledger.request import Request
from ledger.scheduler import Scheduler, SchedulerConfig
from ledger.step_costs import StepCosts
from services.routing.costs import EvictionView, parse_weights
from services.routing.policy import (
    POLICIES,
    HealthLimits,
    NoReplicaError,
    PendingRequests,
    ReplicaHealth,
    ReplicaLoad,
    ReplicaPrefixIndex,
    ReplicaScore,
    Router,
    RouteRequest,
    RoutingWeights,
    Scorer,
    SentPrefixLRU,
    routable_block_hashes,
)

BS = 16
HASHER = BlockHasher("sha256", seed="test-routing")


def serve(tokens: list[int], salt: str | None = None) -> KVEventBatch:
    """Run one request to the end on a real ledger core; the KV events it published."""
    manager = KVCacheManager(256, BS, 2048, enable_kv_cache_events=True)
    scheduler: Scheduler[None] = Scheduler(SchedulerConfig(max_model_len=2048), manager)
    scheduler.add_request(
        Request("a", tokens, 1, block_hasher=HASHER, block_size=BS, cache_salt=salt)
    )
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"a": 7})
    return KVEventBatch(0.0, manager.take_events())


def request(tokens: list[int], salt: str | None = None) -> RouteRequest:
    return RouteRequest(len(tokens), routable_block_hashes(tokens, HASHER, BS, salt), BS)


def test_routable_hashes_stop_before_the_last_token_as_the_ledger_does() -> None:
    assert len(routable_block_hashes(list(range(64)), HASHER, BS)) == 3  # 4 full, last recomputed
    assert len(routable_block_hashes(list(range(65)), HASHER, BS)) == 4
    assert routable_block_hashes(list(range(64)), HASHER, BS, "salt") != routable_block_hashes(
        list(range(64)), HASHER, BS
    )


def test_index_from_real_events_finds_the_prefix_on_its_replica_only() -> None:
    prompt = list(range(100, 180))  # 5 full blocks
    index = ReplicaPrefixIndex()
    index.apply("r1", serve(prompt))
    follow_up = request(prompt + list(range(40)))
    assert index.cached_blocks("r1", follow_up.block_hashes) == 5
    assert index.cached_blocks("r0", follow_up.block_hashes) == 0
    assert index.cached_blocks("r1", request(list(range(500, 600))).block_hashes) == 0
    # A salted prompt's blocks differ from the first on: nothing to share.
    salted = request(prompt + [1], salt="tenant-b")
    assert index.cached_blocks("r1", salted.block_hashes) == 0


def measured(prefill_tokens_per_s: float, queued: int = 0, running: int = 0, **kw) -> ReplicaLoad:
    """A replica's load as its ledger publishes it, with its measured step costs."""
    costs = StepCosts(prefill_tokens_per_s, step_s_per_seq=kw.pop("step_s_per_seq", 0.0005))
    waiting = kw.pop("waiting", 1 if queued else 0)
    return ReplicaLoad(running, waiting, costs=costs, queued_prefill_tokens=queued, **kw)


@pytest.mark.parametrize("tokens_per_s", [2_000.0, 20_000.0, 200_000.0])
def test_precise_keeps_the_prefix_until_the_measured_queue_outweighs_twice_its_prefill(
    tokens_per_s: float,
) -> None:
    """In seconds from what the replicas measure: the replica holding 512 of a 515-token prompt
    saves 2 * 512 tokens' prefill time; it keeps the request while the prefill queued ahead
    there takes less, on any hardware (the same decisions at 2k, 20k and 200k tokens/s)."""
    names = ["r0", "r1", "r2"]
    prompt = list(range(1000, 1000 + 32 * BS))  # 512 tokens
    index = ReplicaPrefixIndex()
    index.apply("r2", serve(prompt))
    req = request(prompt + [1, 2, 3])
    idle = {n: measured(tokens_per_s) for n in names}

    def chosen(queued_on_r2: int) -> str:
        loads = dict(idle, r2=measured(tokens_per_s, queued=queued_on_r2))
        router = Router("precise", names, prefix_source=index.cached_blocks)
        decision = router.route(req, loads)
        assert decision.unit == "s"
        assert decision.score_of("r2").cached_tokens == 512
        return decision.replica

    assert chosen(0) == "r2"
    assert chosen(1000) == "r2"  # 1,000 queued tokens wait less than 2 * 512 prefilled
    assert chosen(1100) != "r2"
    decision = Router("precise", names, prefix_source=index.cached_blocks).route(req, idle)
    r0, r2 = decision.score_of("r0"), decision.score_of("r2")
    assert r2.cost == pytest.approx(2 * 3 / tokens_per_s)
    assert r0.cost == pytest.approx(2 * 515 / tokens_per_s)


def test_replicas_not_measured_yet_borrow_the_others_costs_and_a_slower_one_costs_more() -> None:
    names = ["fast", "slow", "new"]
    req = request(list(range(400)))
    loads = {
        "fast": measured(20_000.0, queued=2_000),
        "slow": measured(5_000.0, queued=200),
        "new": ReplicaLoad(running=0, waiting=0),  # no costs published yet
    }
    router = Router("least_loaded", names)
    decision = router.route(req, loads)
    # The newcomer prices its prefill at the measured replicas' mean time per token.
    mean_spt = (1 / 20_000 + 1 / 5_000) / 2
    assert decision.score_of("new").cost == pytest.approx(2 * 400 * mean_spt)
    assert decision.score_of("fast").load_cost == pytest.approx(2_000 / 20_000)
    assert decision.score_of("slow").load_cost == pytest.approx(200 / 5_000)
    assert decision.replica == "new"
    # Before any replica has measured anything, a token is a token: the least queued wins.
    bare = {
        n: ReplicaLoad(queued_prefill_tokens=q) for n, q in zip(names, (50, 10, 30), strict=True)
    }
    assert Router("least_loaded", names).route(req, bare).replica == "slow"


def test_the_measured_queue_wait_counts_while_requests_wait_and_running_ones_slow_each_step():
    names = ["r0", "r1"]
    req = request(list(range(200)))
    waiting = ReplicaLoad(
        running=0, waiting=3, queued_prefill_tokens=10,
        costs=StepCosts(10_000.0, step_s_per_seq=0.001, queue_wait_s=0.5),
    )  # fmt: skip
    busy = measured(10_000.0, running=40, step_s_per_seq=0.001)
    decision = Router("least_loaded", names).route(req, {"r0": waiting, "r1": busy})
    assert decision.score_of("r0").load_cost == pytest.approx(0.5)  # the wait it measured
    assert decision.score_of("r1").load_cost == pytest.approx(0.04)  # 40 sequences per step
    assert decision.replica == "r1"


def test_hand_set_weights_override_the_measured_costs_in_prefill_tokens() -> None:
    prompt = list(range(1000, 1000 + 32 * BS))  # 512 tokens
    index = ReplicaPrefixIndex()
    index.apply("r2", serve(prompt))
    names = ["r0", "r1", "r2"]
    req = request(prompt + [1, 2, 3])
    idle = {n: ReplicaLoad() for n in names}
    weighted = Router("precise", names, prefix_source=index.cached_blocks, costs=RoutingWeights())
    decision = weighted.route(req, idle)
    assert (decision.replica, decision.unit) == ("r2", "tokens")
    assert decision.score_of("r2").cost == 3
    # Two waiting requests (2 * 512 token-equivalents) cost more than the 512 cached tokens.
    busy = dict(idle, r2=ReplicaLoad(running=0, waiting=2))
    fresh = Router("precise", names, prefix_source=index.cached_blocks, costs=RoutingWeights())
    assert fresh.route(req, busy).replica != "r2"
    assert parse_weights(None) is None and parse_weights(" ") is None
    assert parse_weights("waiting=16") == RoutingWeights(waiting=16)


def test_a_stale_replicas_events_are_not_trusted_and_an_out_one_never_chosen() -> None:
    prompt = list(range(64 * BS))
    index = ReplicaPrefixIndex()
    index.apply("r1", serve(prompt))
    router = Router("precise", ["r0", "r1"], prefix_source=index.cached_blocks)
    loads = {"r0": ReplicaLoad(), "r1": ReplicaLoad()}
    req = request(prompt + [5])
    stale = router.route(req, loads, {"r1": ReplicaHealth.STALE})
    assert stale.score_of("r1").cached_tokens == 0
    out = router.route(req, loads, {"r1": ReplicaHealth.OUT})
    assert out.replica == "r0"
    with pytest.raises(NoReplicaError, match="all 2 are out"):
        router.route(req, loads, {"r0": ReplicaHealth.OUT, "r1": ReplicaHealth.OUT})


def test_a_burst_keeps_following_its_first_copy_while_that_replica_is_stale() -> None:
    """A loaded machine delays a ledger's 1 s status heartbeat past stale_after_s while it is
    prefilling a new system prompt: its events are not trusted then, but the blocks this router
    just sent it are known, so the burst sharing that prompt stays there instead of spreading."""
    names = ["r0", "r1", "r2", "r3"]
    index = ReplicaPrefixIndex()  # no event yet: the first copy is still being prefilled
    idle = {n: ReplicaLoad() for n in names}
    system = list(range(2000, 2000 + 48 * BS))
    for policy in ("precise", "approx"):
        router = Router(policy, names, prefix_source=index.cached_blocks)
        first = router.route(request(system + [1, 2]), idle).replica
        stale = {first: ReplicaHealth.STALE}
        burst = [router.route(request(system + [10 + k, 3]), idle, stale) for k in range(6)]
        assert [d.replica for d in burst] == [first] * 6, policy
        assert burst[0].score_of(first).cached_tokens == 48 * BS
        # An out replica gets nothing, whatever was sent to it.
        out = router.route(request(system + [99]), idle, {first: ReplicaHealth.OUT})
        assert out.replica != first
        assert out.score_of(first).cached_tokens == 0


def test_round_robin_cycles_and_least_loaded_avoids_the_queue() -> None:
    names = ["r0", "r1", "r2"]
    req = request(list(range(40)))
    loads = {n: ReplicaLoad() for n in names}
    rr = Router("round_robin", names)
    assert [rr.route(req, loads).replica for _ in range(4)] == ["r0", "r1", "r2", "r0"]
    ll = Router("least_loaded", names)
    loads = {
        "r0": ReplicaLoad(4, 2, 0.5),
        "r1": ReplicaLoad(1, 0, 0.1),
        "r2": ReplicaLoad(2, 0, 0.1),
    }
    assert ll.route(req, loads).replica == "r1"


def test_approx_remembers_what_it_sent_and_forgets_the_oldest() -> None:
    names = ["r0", "r1", "r2"]
    loads = {n: ReplicaLoad() for n in names}
    approx = Router("approx", names)
    first = request(list(range(10_000, 10_000 + 20 * BS)))
    chosen = approx.route(first, loads).replica
    assert all(approx.route(first, loads).replica == chosen for _ in range(5))
    lru = SentPrefixLRU(capacity_blocks=4)
    lru.record("r0", [1, 2, 3])
    lru.record("r1", [7, 8])
    assert lru.cached_blocks("r0", [1, 2, 3]) == 0  # block 1 went first
    assert lru.cached_blocks("r1", [7, 8, 9]) == 2


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="routing policy must be one of"):
        Router("random", ["r0"])
    with pytest.raises(ValueError, match="needs a prefix source"):
        Router("precise", ["r0"])
    with pytest.raises(ValueError, match="routing weight waiting"):
        RoutingWeights(waiting=-1)
    with pytest.raises(ValueError, match="at least one replica"):
        Router("round_robin", [])
    with pytest.raises(ValueError, match="0 < stale_after_s <= out_after_s"):
        HealthLimits(stale_after_s=5.0, out_after_s=2.0)


def test_a_burst_to_one_hot_prefix_spreads_once_load_sent_since_the_status_outweighs_it() -> None:
    """Under hand-set weights: every replica's last status (as_of 0) shows it idle; the router
    sends a burst sharing a new 768-token system prompt at t=1, before any status or event can
    show it. Each request it sent after that status is a waiting one the status misses (512):
    the first copy's replica takes one more (512 < 768 cached), then the next costs more than
    prefilling elsewhere."""
    names = ["r0", "r1", "r2", "r3"]
    index = ReplicaPrefixIndex()  # no event yet: nothing has been prefilled
    system = list(range(3000, 3000 + 48 * BS))
    published = {n: ReplicaLoad(as_of=0.0) for n in names}
    router = Router("precise", names, prefix_source=index.cached_blocks, costs=RoutingWeights())
    burst = [
        router.route(request(system + [k, 1]), published, request_id=f"b{k}", now=1.0)
        for k in range(8)
    ]
    assert [d.replica for d in burst] == ["r0", "r0", "r1", "r1", "r2", "r2", "r3", "r3"]
    second, third = burst[1].score_of("r0"), burst[2].score_of("r0")
    assert (second.cached_tokens, second.sent_since_status, second.load_cost) == (768, 1, 512)
    assert (third.cached_tokens, third.sent_since_status, third.load_cost) == (768, 2, 1024)
    # A status measured after the burst counts those requests itself: nothing is added twice.
    fresh = {n: ReplicaLoad(waiting=2, as_of=2.0) for n in names}
    after = router.route(request(system + [99]), fresh, request_id="late", now=2.5)
    assert all(s.sent_since_status == 0 for s in after.scores)
    # Loads without a measuring time (current, as the simulation's default): no overlay.
    current = {n: ReplicaLoad() for n in names}
    plain = Router("precise", names, prefix_source=index.cached_blocks, costs=RoutingWeights())
    assert {plain.route(request(system + [k]), current, now=1.0).replica for k in range(8)} == {
        "r0"
    }


def test_pending_blocks_count_until_the_request_ends_however_many_are_sent_between() -> None:
    """The blocks of a request still queued on a replica count as cached there, for precise and
    the oracle (whose sources see only computed blocks), until it is released: then the events
    are the truth. Thousands of other requests in between do not push them out (a 4,096-block
    LRU did, at 64 replicas: precise hit 0.858 against approx's 0.920 in the simulation)."""
    names = [f"r{i}" for i in range(64)]
    index = ReplicaPrefixIndex()
    hot = list(range(50_000, 50_000 + 96 * BS))
    idle = {n: ReplicaLoad() for n in names}
    for policy in ("precise", "oracle"):
        router = Router(policy, names, prefix_source=index.cached_blocks)
        home = router.route(request(hot + [1]), idle, request_id="hot").replica
        for k in range(2000):  # 2,000 other prompts of 64 blocks: 128k pending blocks
            other = list(range(100_000 + k * 2000, 100_000 + k * 2000 + 64 * BS + 1))
            router.route(request(other), idle, request_id=f"o{k}")
        follow = router.route(request(hot + [2, 3]), idle, request_id="hot-2")
        assert follow.replica == home, policy
        assert follow.score_of(home).cached_tokens == 96 * BS
        router.release("hot")
        router.release("hot-2")
        gone = router.route(request(hot + [4]), idle, request_id="hot-3")
        assert gone.score_of(home).cached_tokens == 0, policy  # no event says it is cached


def test_pending_requests_count_blocks_per_request_and_drop_the_oldest_past_capacity() -> None:
    pending = PendingRequests(capacity=2)
    pending.add("a", "r0", [1, 2, 3], at=1.0)
    pending.add("b", "r0", [1, 2], at=2.0)
    assert pending.cached_blocks("r0", [1, 2, 3, 4]) == 3
    assert pending.release("a") and not pending.release("a")
    assert pending.cached_blocks("r0", [1, 2, 3]) == 2  # b still holds 1 and 2
    assert pending.sent_since("r0", 1.5).requests == 1
    assert pending.sent_since("r0", 2.0).requests == 0
    pending.add("c", "r1", [7], at=3.0)
    pending.add("d", "r1", [8], at=4.0)  # over capacity: b, the oldest, goes
    assert len(pending) == 2 and pending.cached_blocks("r0", [1]) == 0
    assert pending.sent_since("r1", 0.0).requests == 2


def test_measured_costs_keep_a_burst_on_the_first_copy_while_its_prefill_is_the_shorter_wait():
    """Measured costs count what was sent since the status by the prefill it brings: the first
    copy of a new 768-token prompt queues 770 tokens on r0; each copy after it needs 2 more
    there, against 770 elsewhere: the whole burst follows the first copy, until the tokens
    queued on r0 would take longer than prefilling the prompt twice elsewhere."""
    names = ["r0", "r1", "r2", "r3"]
    index = ReplicaPrefixIndex()
    system = list(range(3000, 3000 + 48 * BS))
    published = {n: ReplicaLoad(as_of=0.0, costs=StepCosts(10_000.0)) for n in names}
    router = Router("precise", names, prefix_source=index.cached_blocks)
    burst = [
        router.route(request(system + [k, 1]), published, request_id=f"b{k}", now=1.0)
        for k in range(8)
    ]
    assert [d.replica for d in burst] == ["r0"] * 8
    last = burst[-1].score_of("r0")
    assert (last.cached_tokens, last.sent_since_status) == (768, 7)
    # 782 tokens queued, and 7 more sequences per step (none measured: a token's time each).
    assert last.load_cost == pytest.approx((770 + 6 * 2) / 10_000 + 7 / 10_000)
    # A status measured after the burst counts those requests itself: nothing added twice.
    after = router.route(request(system + [99]), published | {"r0": ReplicaLoad(as_of=2.0)},
                         request_id="late", now=2.5)  # fmt: skip
    assert after.score_of("r0").sent_since_status == 0
    # A long, different prompt spreads: r0's queue is the longest wait.
    other = router.route(request(list(range(9000, 9400))), published, request_id="o", now=1.0)
    assert other.replica != "r0"


def test_a_cached_prefix_counts_only_as_far_as_it_survives_the_allocations_queued_before_it():
    """The replica's eviction head: its block 3 is 5th in the free queue; 13 blocks of prefill
    queued there evict it before this request is admitted, so precise counts 3 blocks, not 10
    (and says so), and sends the request where the whole prefix will still be."""
    names = ["r0", "r1"]
    prompt = list(range(5000, 5000 + 10 * BS))
    hashes = routable_block_hashes(prompt + [1], HASHER, BS)
    index = ReplicaPrefixIndex()
    index.apply("r0", serve(prompt))
    index.apply("r1", serve(prompt))

    def head(queued_blocks: int, as_of: float | None = None) -> EvictionView:
        return EvictionView.of([2, 5], [12345, hashes[3]], 64, as_of, queued_blocks * BS)

    costs = StepCosts(10_000.0)
    loads = {
        "r0": ReplicaLoad(costs=costs, queued_prefill_tokens=13 * BS, waiting=1, eviction=head(13)),
        "r1": ReplicaLoad(costs=costs, queued_prefill_tokens=13 * BS, waiting=1),
    }
    aware = Router("precise", names, prefix_source=index.cached_blocks)
    decision = aware.route(request(prompt + [1]), loads)
    r0 = decision.score_of("r0")
    assert (r0.cached_blocks, r0.evicted_blocks) == (3, 7)
    assert decision.replica == "r1" and decision.score_of("r1").cached_blocks == 10
    # Fewer allocations ahead (4 blocks): block 3 at position 5 survives them...
    light = dict(loads, r0=ReplicaLoad(costs=costs, eviction=head(4, as_of=1.0)))
    router = Router("precise", names, prefix_source=index.cached_blocks)
    assert router.route(request(prompt + [1]), light, now=2.0).score_of("r0").cached_blocks == 10
    # ...until r0 is sent a new prompt of 2 blocks after the head was written (by this
    # gateway or another): 6 allocations then, and block 3 goes.
    fresh = Router("precise", names, prefix_source=index.cached_blocks)
    fresh.pending.add("x", "r0", [], at=1.5, prefill_tokens=2 * BS)
    again = fresh.route(request(prompt + [1]), light, now=2.0).score_of("r0")
    assert (again.cached_blocks, again.evicted_blocks) == (3, 7)
    blind = Router("precise", names, prefix_source=index.cached_blocks, eviction_aware=False)
    assert blind.route(request(prompt + [1]), loads).score_of("r0").cached_blocks == 10


def test_a_policy_is_an_object_behind_the_scorer_interface() -> None:
    """The router asks any `Scorer` what each replica holds and lets it pick; a new policy is a
    subclass, not a branch on a policy string."""

    class Sticky(Scorer):
        name = "sticky"

        def cached_blocks(self, replica, request, health):
            return len(request.block_hashes) if replica == "r1" else 0

        def pick(self, scores: list[ReplicaScore]) -> ReplicaScore:
            return max(scores, key=lambda s: s.cached_blocks)

    names = ["r0", "r1", "r2"]
    req = request(list(range(100)))
    decision = Router(Sticky(), names).route(req, {n: ReplicaLoad() for n in names})
    assert (decision.replica, decision.policy) == ("r1", "sticky")
    assert decision.score_of("r1").cached_tokens == 6 * BS
    assert sorted(POLICIES) == ["approx", "least_loaded", "precise", "round_robin"]
    assert all(issubclass(cls, Scorer) and cls.name == name for name, cls in POLICIES.items())


def test_pending_requests_from_other_gateways_keep_time_order_and_their_prefill() -> None:
    pending = PendingRequests()
    pending.add("a", "r0", [1], at=5.0, prefill_tokens=100)
    pending.add("b", "r0", [2], at=3.0, prefill_tokens=40, owner="gw-2")  # read late
    pending.add("c", "r0", [3], at=6.0, prefill_tokens=7)
    sent = pending.sent_since("r0", 4.0)
    assert (sent.requests, sent.prefill_tokens) == (2, 107)
    assert pending.sent_since("r0", 2.0).prefill_tokens == 147
    assert pending.ids(owner="gw-2") == ["b"] and pending.on("r0") == 3
