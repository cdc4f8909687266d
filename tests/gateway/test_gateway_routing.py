"""The gateway's routing settings: weights over the defaults, and refusals that name the field."""

from __future__ import annotations

import pytest

from gateway.router import parse_weights
from services.config import GatewayConfig, from_arguments
from services.environment import ConfigError
from services.routing.policy import RoutingWeights


def test_weights_override_the_defaults_one_by_one():
    weights = parse_weights("waiting=256, kv_usage=2048")
    assert weights is not None
    assert (weights.prefix, weights.running, weights.waiting, weights.kv_usage) == (
        1.0,
        32.0,
        256.0,
        2048.0,
    )
    assert parse_weights("prefix=1") == RoutingWeights()
    assert parse_weights(None) is None  # no override: the measured costs


@pytest.mark.parametrize(
    ("text", "named"),
    [("queue=3", "'queue' is unknown"), ("running=x", "running='x'"), ("prefix=-1", "prefix")],
)
def test_a_bad_weight_is_refused_by_name(text, named):
    with pytest.raises(ValueError, match=named):
        parse_weights(text)


def test_routing_policy_comes_from_the_environment_and_is_checked(monkeypatch):
    monkeypatch.setenv("KVLEDGER_ROUTING", "least_loaded")
    monkeypatch.setenv("KVLEDGER_REPLICAS", "r0,r1")
    config = from_arguments(GatewayConfig)
    assert (config.routing, config.replicas) == ("least_loaded", "r0,r1")
    monkeypatch.setenv("KVLEDGER_ROUTING", "random")
    with pytest.raises(ConfigError, match="KVLEDGER_ROUTING: 'random': use one of round_robin"):
        from_arguments(GatewayConfig)


def test_the_gateway_routes_on_measured_costs_unless_weights_are_given():
    from gateway.router import Replicas, routing_for
    from observability import get_tracer, new_registry
    from services.routing.costs import MeasuredCosts

    def costs_of(weights: str | None):
        config = GatewayConfig(
            redis_url="redis://127.0.0.1:1/0", replicas="r0,r1", routing_weights=weights
        )
        routing = routing_for(
            config,
            None,
            "gw",
            new_registry(),
            get_tracer("t"),
            lambda _: None,  # type: ignore[arg-type]
        )
        assert isinstance(routing, Replicas)
        return routing.router.costs

    assert isinstance(costs_of(None), MeasuredCosts)
    assert costs_of("running=2,waiting=16") == RoutingWeights(running=2, waiting=16)


async def test_the_gateway_is_ready_once_every_replica_has_spoken_or_is_out(
    start_gateway, start_ledger
):
    """Several replicas: not ready (503 on /health and /ping), and no request routed, until every
    configured replica has published its status; a replica silent for the out limit stops
    holding the others up. Routing before would send everything to the first that spoke."""
    import asyncio

    r0 = await start_ledger(replica="r0")
    client = await start_gateway(
        replicas="r0,r1", route_stale_after_s=1.0, route_out_after_s=2.5, ledger_wait_s=5.0
    )
    deadline = asyncio.get_running_loop().time() + 5
    while True:  # until the gateway has read r0's first status: then r1 alone holds it back
        health = await client.get("/health")
        assert health.status == 503
        message = (await health.json())["message"]
        if "first status of replica(s) r1" in message:
            break
        assert asyncio.get_running_loop().time() < deadline, message
        await asyncio.sleep(0.05)
    assert (await client.get("/ping")).status == 503
    sent = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "hi"}))
    await asyncio.sleep(0.6)
    assert not sent.done() and r0.requests == []  # waiting for r1, not sent to r0
    r1 = await start_ledger(replica="r1")
    reply = await sent
    assert reply.status == 200, await reply.text()
    assert len(r0.requests) + len(r1.requests) == 1
    assert (await client.get("/health")).status == 200


async def test_a_replica_that_never_speaks_is_out_after_the_limit_and_holds_no_one_up(
    start_gateway, start_ledger
):
    r0 = await start_ledger(replica="r0")
    client = await start_gateway(
        replicas="r0,ghost", route_stale_after_s=0.5, route_out_after_s=1.0, ledger_wait_s=3.0
    )
    assert (await client.get("/health")).status == 503
    replies = [await client.post("/v1/completions", json={"prompt": "hi"}) for _ in range(3)]
    assert [r.status for r in replies] == [200, 200, 200]
    assert len(r0.requests) == 3  # the ghost is out: nothing routed to it
    assert (await client.get("/health")).status == 200


async def test_health_shows_each_replicas_tier_load_costs_beside_its_prefill_cost(
    start_gateway, start_ledger
):
    from services.wire.messages import TIER_CPU, TIER_SHARED, RoutingCosts

    await start_ledger(
        replica="r0", num_cpu_blocks=512, shared_tier="fleet",
        costs=RoutingCosts(prefill_tokens_per_s=4000.0,
                           load_s_per_block={TIER_CPU: 5e-5, TIER_SHARED: 1e-3}),
    )  # fmt: skip
    await start_ledger(replica="r1", costs=RoutingCosts(prefill_tokens_per_s=2000.0))
    client = await start_gateway(replicas="r0,r1")
    import asyncio

    for _ in range(100):
        health = await client.get("/health")
        if health.status == 200:
            break
        await asyncio.sleep(0.05)
    body = await health.json()
    r0, r1 = body["replicas"]["r0"], body["replicas"]["r1"]
    assert r0["prefill_s_per_token"] == 1 / 4000
    assert r0["load_s_per_block"] == {TIER_CPU: 5e-5, TIER_SHARED: 1e-3}
    assert (r0["num_cpu_blocks"], r0["shared_tier"]) == (512, "fleet")
    assert r1["prefill_s_per_token"] == 1 / 2000
    assert r1["load_s_per_block"] == {TIER_CPU: None, TIER_SHARED: None}  # no tier measured


async def test_the_route_span_and_log_carry_where_each_replicas_blocks_are(
    redis_url, prefix, start_ledger
):
    """Two replicas; r1's CPU tier holds the prompt (its real KV events, medium CPU, through the
    ledger's own stream publisher). The gateway routes the prompt there and its kvledger.route
    span and `routed` record say how many tokens each replica has on which tier; the request
    goes out expecting the loaded tokens as cached."""
    import asyncio

    from structlog.testing import capture_logs

    from engine.event_stream import KVEventStream
    from gateway.protocol import Job
    from gateway.router import Replicas, routing_for
    from ledger.block_pool import BlockPool
    from ledger.events import BlockStored
    from ledger.hashing import BlockHasher, resolve_none_hash_seed, to_event_hash
    from observability import new_registry
    from services.transport.keys import StreamNames
    from services.transport.redis_streams import connect
    from services.wire.messages import TIER_CPU, RoutingCosts
    from tests.harness.spans import SpanCollector, named

    costs = RoutingCosts(prefill_tokens_per_s=2000.0, load_s_per_block={TIER_CPU: 1e-4})
    await start_ledger(replica="r0", costs=costs)
    await start_ledger(replica="r1", costs=costs, num_cpu_blocks=64)
    prompt = list(range(10, 10 + 4 * 16 + 3))
    hasher = BlockHasher("sha256", seed=resolve_none_hash_seed("sha256"))
    blocks = [to_event_hash(h) for h in hasher.hash_blocks(prompt[:64], 16)]
    r = connect(redis_url)
    stream = KVEventStream(r, StreamNames(prefix, "r1"), max_bytes=10**7,
                           snapshot_interval_s=3600, block_size=16, hash_algo="sha256")  # fmt: skip
    on_cpu = [BlockStored([h], None, [], 0, None, "CPU", None, group_idx=0) for h in blocks]
    await stream.publish(on_cpu, BlockPool(4, enable_caching=True), "e")
    collector = SpanCollector()
    config = GatewayConfig(
        redis_url=redis_url, stream_prefix=prefix, replicas="r0,r1", model="tiny"
    )
    routing = routing_for(config, r, "gw", new_registry(), collector.tracer("kvledger-gateway"),
                          lambda _: None)  # fmt: skip
    assert isinstance(routing, Replicas)
    await routing.replica_set.start()
    try:
        for _ in range(200):
            states = routing.replica_set.replicas
            if (
                all(s.status is not None for s in states.values())
                and len(
                    routing.replica_set.cpu_blocks("r1")  # type: ignore[arg-type]
                )
                == 4
            ):
                break
            await asyncio.sleep(0.02)
        job = Job(kind="completion", prompt_token_ids=prompt, prompt_param="prompt", max_tokens=1)
        with capture_logs() as logs:
            route = routing.route(job, "q1")
        assert route.replica == "r1" and route.expected_cached_tokens == 64
        [span] = named(collector.spans, "kvledger.route")
        attributes = span["attributes"]
        assert attributes["kvledger.route.replica"] == "r1"
        assert attributes["kvledger.route.cached_tokens"] == 0
        assert attributes["kvledger.route.cpu_tokens"] == 64
        assert attributes["kvledger.route.shared_tokens"] == 0
        order = attributes["kvledger.route.replicas"]
        by_replica = dict(zip(order, attributes["kvledger.route.replica_cpu_tokens"], strict=True))
        assert by_replica == {"r0": 0, "r1": 64}
        tier_costs = dict(zip(order, attributes["kvledger.route.tier_costs"], strict=True))
        assert tier_costs["r1"] == pytest.approx(2 * 4 * 1e-4) and tier_costs["r0"] == 0
        [routed] = [entry for entry in logs if entry["event"] == "routed"]
        assert (routed["cached_tokens"], routed["cpu_tokens"], routed["shared_tokens"]) == (
            0,
            64,
            0,
        )
        assert routed["scores"]["r1"][:3] == [0, 64, 0]  # GPU, CPU, shared tokens
    finally:
        await routing.replica_set.stop()
        await r.delete(stream.streams.events, stream.streams.events_snapshot)
        await r.aclose()
