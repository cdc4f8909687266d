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
