"""One naming scheme: every metric is vLLM's `vllm:*` (spelled as vLLM spells it) or kvledger's
own `kvledger:*`; every span attribute a role sets goes through `observability.Attr`."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from gateway.router import routing_for
from observability import Attr, GatewayMetrics, LedgerMetrics, get_tracer, new_registry
from services.config import GatewayConfig

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("engine", "gateway", "gpu_worker", "indexer", "services", "ledger", "kvledger")


def metric_names(registry: CollectorRegistry) -> set[str]:
    return {metric.name for metric in registry.collect()}


def test_every_metric_is_vllms_or_kvledgers_own_colon_name():
    ledger, gateway = new_registry(), new_registry()
    LedgerMetrics(ledger, "m")
    GatewayMetrics(gateway, "m")
    config = GatewayConfig(redis_url="redis://127.0.0.1:1/0", replicas="r0,r1")
    routing_for(config, None, "gw", gateway, get_tracer("t"), lambda _: None)  # type: ignore[arg-type]
    names = metric_names(ledger) | metric_names(gateway)
    assert len(names) > 20
    assert {"kvledger:routed_requests", "kvledger:evicted_blocks", "vllm:num_preemptions"} <= names
    strays = sorted(n for n in names if not re.fullmatch(r"(vllm|kvledger):[a-z0-9_]+", n))
    assert strays == []


def test_span_attributes_are_set_through_attr():
    literal = re.compile(
        r"set_attribute\(\s*\"|set_attributes\(\s*\{\s*\"|^\s*\"(gen_ai|kvledger|http|url|error|"
        r"messaging)\.[a-z_.]+\"\s*:",
        re.MULTILINE,
    )
    offenders = [
        f"{path.relative_to(ROOT)}:{source[: m.start()].count(chr(10)) + 1}"
        for package in ROLES
        for path in sorted((ROOT / package).rglob("*.py"))
        for source in [path.read_text()]
        for m in literal.finditer(source)
        if path.name != "tracing.py"  # where Attr declares them
    ]
    assert offenders == []
    keys = [v for k, v in vars(Attr).items() if k.isupper()]
    assert len(keys) == len(set(keys)), "two Attr names for one key"
