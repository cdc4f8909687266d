"""The gateway's routing settings: weights over the defaults, and refusals that name the field."""

from __future__ import annotations

import pytest

from gateway.router import parse_weights
from services.config import GatewayConfig, from_arguments
from services.environment import ConfigError
from services.routing.policy import RoutingWeights


def test_weights_override_the_defaults_one_by_one():
    weights = parse_weights("waiting=256, kv_usage=2048")
    assert (weights.prefix, weights.running, weights.waiting, weights.kv_usage) == (
        1.0,
        32.0,
        256.0,
        2048.0,
    )
    assert parse_weights(None) == RoutingWeights()


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
