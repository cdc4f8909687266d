"""Routing across tiers: where each block of a prompt lives on a replica (its GPU, its CPU tier,
the shared tier of its namespace, nowhere), walked in order, and priced as the loads of what it
would load beside the prefill of what it would compute. The CPU tier's blocks come from real KV
events: the ledger core's block pool for the GPU and the CPU tier's own manager
(`ledger.offloading`), published as vLLM's OffloadingConnector publishes them."""

from __future__ import annotations

import pytest

from ledger.events import BlockStored, KVEventBatch, encode_batch
from ledger.hashing import BlockHasher, to_event_hash
from ledger.offloading.base import RequestContext, make_offload_key
from ledger.offloading.events import to_kv_events
from ledger.offloading.manager import CPUOffloadingManager
from ledger.step_costs import StepCosts
from services.events.subscriber import PrefixIndex
from services.routing.costs import LOAD_PRIOR_SHARE, EvictionView, parse_weights
from services.routing.policy import (
    ReplicaHealth,
    ReplicaLoad,
    Router,
    RouteRequest,
    TierBlocks,
    routable_block_hashes,
    walk_tiers,
)
from services.wire.messages import TIER_CPU, TIER_SHARED
from tests.services.routing.test_policy import serve

BS = 16
HASHER = BlockHasher("sha256", seed="test-routing")  # test_policy's: serve() hashes with it
PROMPT = list(range(1000, 1000 + 32 * BS))  # 512 tokens: 32 full blocks
NAMES = ["r0", "r1"]


def offloaded(tokens: list[int], num_chunks: int = 64) -> KVEventBatch:
    """The CPU tier storing every full block of `tokens`: vLLM 0.33's CPU offloading manager
    (kvledger's, exact to it), its BlockStored events of medium CPU."""
    manager = CPUOffloadingManager(num_chunks, enable_events=True)
    context = RequestContext("a")
    keys = [make_offload_key(h) for h in HASHER.hash_blocks(tokens[: len(tokens) // BS * BS], BS)]
    prepared = manager.prepare_store(keys, context)
    assert prepared is not None
    manager.complete_store(prepared.keys_to_store, context)
    return KVEventBatch(0.0, to_kv_events(manager.take_events()))


class Replicas:
    """Each replica's index, fed the bytes its ledger would publish (a subscriber's path)."""

    def __init__(self) -> None:
        self.index = {name: PrefixIndex() for name in NAMES}

    def publish(self, replica: str, batch: KVEventBatch) -> None:
        self.index[replica].apply_bytes(encode_batch(batch))

    def router(self, policy: str = "precise", **kw) -> Router:
        return Router(
            policy,
            NAMES,
            prefix_source=lambda r, hashes: self.index[r].leading_blocks(hashes),
            tier_source=lambda r: self.index[r].tier("CPU"),
            **kw,
        )


def request(tokens: list[int]) -> RouteRequest:
    return RouteRequest(len(tokens), routable_block_hashes(tokens, HASHER, BS), BS)


def loads(tokens_per_s: float = 2_000.0, cpu_s: float | None = 1e-4, **by_replica) -> dict:
    """Every replica idle with measured step costs and CPU-tier load cost, unless overridden."""
    base = {
        name: ReplicaLoad(
            costs=StepCosts(tokens_per_s, step_s_per_seq=0.0005),
            load_s_per_block={TIER_CPU: cpu_s} if cpu_s is not None else {},
        )
        for name in NAMES
    }
    return base | by_replica


def test_the_cpu_tiers_events_index_the_blocks_a_replica_can_load() -> None:
    replicas = Replicas()
    replicas.publish("r1", offloaded(PROMPT))
    req = request(PROMPT + [1, 2, 3])
    cpu = replicas.index["r1"].tier("CPU")
    assert len(cpu) == 32 and replicas.index["r1"].counts == {}  # none on its GPU
    assert walk_tiers(req.block_hashes, 0, cpu, None) == TierBlocks(cpu=32)
    assert replicas.index["r1"].tier_blocks("CPU", req.block_hashes) == 32


@pytest.mark.parametrize("tokens_per_s", [2_000.0, 20_000.0])
def test_a_replica_holding_the_prompt_on_cpu_beats_one_holding_nothing_until_its_queue_outweighs(
    tokens_per_s: float,
) -> None:
    """Loading 32 blocks at 0.1 ms costs 2 * 3.2 ms, prefilling 512 tokens 2 * 512 / rate: the
    CPU tier's replica keeps the prompt while what is queued there takes less than the
    difference."""
    replicas = Replicas()
    replicas.publish("r1", offloaded(PROMPT))
    req = request(PROMPT + [1, 2, 3])
    cpu_s = 1e-4
    decision = replicas.router().route(req, loads(tokens_per_s, cpu_s))
    assert decision.replica == "r1"
    r0, r1 = decision.score_of("r0"), decision.score_of("r1")
    assert (r1.cached_blocks, r1.cpu_blocks, r1.shared_blocks) == (0, 32, 0)
    assert r1.tier_cost == pytest.approx(2 * 32 * cpu_s)
    assert r1.cost == pytest.approx(2 * 3 / tokens_per_s + 2 * 32 * cpu_s)
    assert r0.cost == pytest.approx(2 * 515 / tokens_per_s)
    assert r1.hit_tokens == 512 and r1.cpu_tokens == 512

    saved = 2 * 512 / tokens_per_s - 2 * 32 * cpu_s  # seconds the tier saves there

    def chosen(queued_on_r1: int) -> str:
        busy = ReplicaLoad(
            waiting=1, queued_prefill_tokens=queued_on_r1,
            costs=StepCosts(tokens_per_s, step_s_per_seq=0.0005),
            load_s_per_block={TIER_CPU: cpu_s},
        )  # fmt: skip
        return replicas.router().route(req, loads(tokens_per_s, cpu_s, r1=busy)).replica

    below, above = int(saved * tokens_per_s * 0.97), int(saved * tokens_per_s * 1.03)
    assert chosen(below) == "r1"
    assert chosen(above) == "r0"


def test_a_load_dearer_than_the_prefill_loses_to_computing() -> None:
    """The cost model is honest about slow tiers: a block that takes longer to load than its 16
    tokens to prefill (8 ms at 2,000 tokens/s) is computed elsewhere."""
    replicas = Replicas()
    replicas.publish("r1", offloaded(PROMPT))
    req = request(PROMPT + [1])
    assert replicas.router().route(req, loads(2_000.0, cpu_s=0.004)).replica == "r1"
    decision = replicas.router().route(req, loads(2_000.0, cpu_s=0.02))
    assert decision.replica == "r0"
    assert decision.score_of("r1").cpu_blocks == 32  # it still says where the blocks are


class Catalog:
    """A shared tier, as its catalog follower would answer (by KV-event hash)."""

    def __init__(self, hashes: list[int]) -> None:
        self.hashes = set(hashes)

    def contains(self, event_hash: int) -> bool:
        return event_hash in self.hashes


def test_the_walk_takes_the_gpu_prefix_then_cpu_or_shared_blocks_and_stops_at_one_found_nowhere():
    """Blocks 0-3 on r1's GPU, 4-7 in its CPU tier, 8-9 in the shared tier (4 and 5 too: the
    CPU tier's copy is nearer), 10 nowhere, 11 on CPU again: 4 + 4 + 2, and 11 does not count
    (the ledger's lookup stops at the first miss)."""
    replicas = Replicas()
    replicas.publish("r1", serve(PROMPT[: 4 * BS] + [7]))  # the GPU: the first 4 blocks
    blocks = [to_event_hash(h) for h in HASHER.hash_blocks(PROMPT, BS)]
    cpu = offloaded(PROMPT[: 12 * BS])
    keep = set(blocks[4:8] + blocks[11:12])
    cpu.events = [e for e in cpu.events if isinstance(e, BlockStored) and e.block_hashes[0] in keep]
    replicas.publish("r1", cpu)
    shared = {"fleet": Catalog(blocks[4:10])}
    req = request(PROMPT)
    with_ns = ReplicaLoad(shared_tier="fleet", load_s_per_block={TIER_SHARED: 0.001})
    decision = replicas.router(shared_tiers=shared).route(
        req, loads(r0=ReplicaLoad(shared_tier="fleet"), r1=with_ns)
    )
    r0, r1 = decision.score_of("r0"), decision.score_of("r1")
    assert (r1.cached_blocks, r1.cpu_blocks, r1.shared_blocks) == (4, 4, 2)
    assert r1.hit_tokens == 10 * BS
    # r0 holds nothing of its own, but loads from the same namespace: blocks 0-3 are not in
    # the shared tier, so its walk stops at once.
    assert (r0.cached_blocks, r0.cpu_blocks, r0.shared_blocks) == (0, 0, 0)
    # A replica whose status names no shared tier (or another one) never counts it.
    for namespace in (None, "other"):
        load = ReplicaLoad(shared_tier=namespace)
        score = replicas.router(shared_tiers=shared).route(req, loads(r1=load)).score_of("r1")
        assert (score.cpu_blocks, score.shared_blocks) == (4, 0)


def test_the_shared_tier_lets_a_replica_with_nothing_of_its_own_load_another_replicas_blocks():
    replicas = Replicas()
    blocks = [to_event_hash(h) for h in HASHER.hash_blocks(PROMPT, BS)]
    shared = {"fleet": Catalog(blocks)}
    req = request(PROMPT + [1])
    fleet = {
        n: ReplicaLoad(costs=StepCosts(2_000.0), shared_tier="fleet",
                       load_s_per_block={TIER_SHARED: 5e-4}) for n in NAMES
    }  # fmt: skip
    busy = ReplicaLoad(waiting=1, queued_prefill_tokens=4_000, costs=StepCosts(2_000.0),
                       shared_tier="fleet", load_s_per_block={TIER_SHARED: 5e-4})  # fmt: skip
    decision = replicas.router(shared_tiers=shared).route(req, fleet | {"r0": busy})
    assert decision.replica == "r1"  # the idle one: both can load it
    r1 = decision.score_of("r1")
    assert (r1.cached_blocks, r1.cpu_blocks, r1.shared_blocks) == (0, 0, 32)
    assert r1.cost == pytest.approx(2 * 1 / 2_000 + 2 * 32 * 5e-4 + 0.0)


def test_blocks_the_eviction_head_takes_from_the_gpu_still_load_from_the_cpu_tier() -> None:
    """The 4 leading GPU blocks go first in r1's free queue and the prefill queued there takes
    them; the CPU tier holds them too, so they load instead of being computed."""
    replicas = Replicas()
    replicas.publish("r1", serve(PROMPT[: 4 * BS] + [7]))
    replicas.publish("r1", offloaded(PROMPT))
    req = request(PROMPT + [1])
    hashes = req.block_hashes
    head = EvictionView.of([0, 1, 2, 3], hashes[:4], horizon=8, queued_prefill_tokens=4 * BS)
    r1 = ReplicaLoad(costs=StepCosts(2_000.0), eviction=head, load_s_per_block={TIER_CPU: 1e-4})
    score = replicas.router().route(req, loads(r1=r1)).score_of("r1")
    assert (score.evicted_blocks, score.cached_blocks, score.cpu_blocks) == (4, 0, 32)


def test_a_stale_replicas_cpu_tier_is_not_trusted_and_pending_blocks_lead_the_walk() -> None:
    replicas = Replicas()
    replicas.publish("r1", offloaded(PROMPT))
    req = request(PROMPT + [1])
    router = replicas.router()
    stale = {"r0": ReplicaHealth.LIVE, "r1": ReplicaHealth.STALE}
    score = router.route(req, loads(), stale).score_of("r1")
    assert (score.cached_blocks, score.cpu_blocks) == (0, 0)  # its events may be old
    # A request routed there and not ended holds its blocks on the GPU: the walk starts after.
    router = replicas.router()
    router.pending.add("p", "r1", req.block_hashes[:8], 0.0)
    score = router.score("r1", req, loads(), None, 0.0)
    assert (score.cached_blocks, score.cpu_blocks) == (8, 24)


def test_a_replica_not_measured_yet_borrows_the_fleets_load_cost_else_a_share_of_the_prefill():
    replicas = Replicas()
    for name in NAMES:
        replicas.publish(name, offloaded(PROMPT))
    req = request(PROMPT + [1])
    measured = ReplicaLoad(costs=StepCosts(2_000.0), load_s_per_block={TIER_CPU: 3e-4})
    unmeasured = ReplicaLoad(costs=StepCosts(2_000.0))
    decision = replicas.router().route(req, {"r0": measured, "r1": unmeasured})
    assert decision.score_of("r1").tier_cost == pytest.approx(2 * 32 * 3e-4)
    # Nobody measured: a load of a block costs LOAD_PRIOR_SHARE of its prefill there.
    decision = replicas.router().route(req, {"r0": unmeasured, "r1": unmeasured})
    assert decision.score_of("r1").tier_cost == pytest.approx(
        2 * 32 * LOAD_PRIOR_SHARE * BS / 2_000.0
    )


def test_hand_set_weights_price_a_loaded_token_at_the_tiers_weight_in_prefill_tokens() -> None:
    replicas = Replicas()
    replicas.publish("r1", serve(PROMPT[: 4 * BS] + [7]))
    replicas.publish("r1", offloaded(PROMPT[: 10 * BS]))
    blocks = [to_event_hash(h) for h in HASHER.hash_blocks(PROMPT, BS)]
    shared = {"fleet": Catalog(blocks[10:20])}
    req = request(PROMPT + [1])
    load = {n: ReplicaLoad(shared_tier="fleet") for n in NAMES}
    for text, cpu, shared_w in ((None, 0.1, 0.25), ("cpu=0.5,shared=1", 0.5, 1.0)):
        weights = parse_weights(text or "prefix=1")
        assert weights is not None and (weights.cpu, weights.shared) == (cpu, shared_w)
        decision = replicas.router(costs=weights, shared_tiers=shared).route(req, load)
        assert decision.unit == "tokens"
        r1 = decision.score_of("r1")
        assert (r1.cached_blocks, r1.cpu_blocks, r1.shared_blocks) == (4, 6, 10)
        # 12 blocks and 1 token computed, 6 blocks loaded from CPU, 10 from the shared tier.
        assert r1.cost == pytest.approx((12 * BS + 1) + cpu * 6 * BS + shared_w * 10 * BS)
    with pytest.raises(ValueError, match="use prefix, running, waiting, kv_usage, cpu or shared"):
        parse_weights("disk=1")


def test_the_router_books_what_it_expects_loaded_as_not_to_prefill() -> None:
    """A request sent to the CPU tier's replica is pending there with only its uncached tail
    to prefill: the loaded blocks count as cached, as the ledger reports them."""
    replicas = Replicas()
    replicas.publish("r1", offloaded(PROMPT))
    router = replicas.router()
    decision = router.route(request(PROMPT + [1, 2]), loads(), request_id="q", now=1.0)
    assert decision.replica == "r1"
    pending = router.pending.get("q")
    assert pending is not None and pending.prefill_tokens == 2
