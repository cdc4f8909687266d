"""The compose stack, checked without a Docker engine: the real files pass, and deliberately
broken copies of them (built here from the real file) fail with a message naming the fault."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import compose_check
from tests.compose_check import check_compose, check_files
from tests.compose_model import (
    ComposeLoader,
    environment_of,
    load_compose,
    merge_compose,
    strip_tags,
)

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
CPU_OVERRIDE = ROOT / "docker-compose.cpu.yml"

Doc = dict[str, Any]


@pytest.fixture(scope="module")
def compose() -> Doc:
    return strip_tags(load_compose(COMPOSE))


def test_compose_files_and_dockerfile_pass_every_check() -> None:
    assert check_files(COMPOSE, CPU_OVERRIDE) == []


def test_stack_has_the_promised_services_wired_together(compose: Doc) -> None:
    services = compose["services"]
    assert set(services) >= {"redis", "jaeger", "gateway", "indexer"}
    assert services["jaeger"]["image"].startswith("cr.jaegertracing.io/jaegertracing/jaeger:2.")
    assert {"4317:4317", "4318:4318", "16686:16686", "13133:13133"} <= set(
        services["jaeger"]["ports"]
    )
    assert services["gateway"]["ports"] == ["8000:8000"]
    for replica in ("r0", "r1"):
        assert services["gateway"]["depends_on"][f"ledger-{replica}"] == {
            "condition": "service_healthy"
        }
        assert services[f"ledger-{replica}"]["command"] == ["ledger", "--replica", replica]
        assert services[f"worker-{replica}"]["command"] == ["worker", "--replica", replica]
        for role in ("ledger", "worker"):
            environment = environment_of(services[f"{role}-{replica}"])
            assert environment["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
            assert environment["OTEL_SERVICE_NAME"] == f"kvledger-{role}"
    assert services["gateway"]["command"] == [
        "gateway",
        "--replicas",
        "r0,r1",
        "--routing",
        "precise",
    ]
    assert services["indexer"]["command"][-2:] == ["--replicas", "r0,r1"]
    assert services["indexer"]["ports"] == ["8300:8300"]
    devices = [
        services[f"worker-{r}"]["deploy"]["resources"]["reservations"]["devices"]
        for r in ("r0", "r1")
    ]
    assert devices == [
        [{"driver": "nvidia", "device_ids": [gpu], "capabilities": ["gpu"]}] for gpu in ("0", "1")
    ]


def test_cpu_override_drops_the_gpu_reservation_and_runs_the_worker_on_cpu(compose: Doc) -> None:
    merged = merge_compose(load_compose(COMPOSE), load_compose(CPU_OVERRIDE))
    for name in ("worker-r0", "worker-r1"):
        worker = merged["services"][name]
        assert "deploy" not in worker
        assert environment_of(worker)["KVLEDGER_DEVICE"] == "cpu"
        assert environment_of(worker)["KVLEDGER_REDIS_URL"] == "redis://redis:6379/0"  # kept
    assert check_compose(merged, require_gpu_worker=False) == []


def _set(path: str, value: Any) -> Callable[[Doc], None]:
    def mutate(document: Doc) -> None:
        *parents, last = path.split(".")
        node = document
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value

    return mutate


def _delete(path: str) -> Callable[[Doc], None]:
    def mutate(document: Doc) -> None:
        *parents, last = path.split(".")
        node = document
        for key in parents:
            node = node[key]
        del node[last]

    return mutate


BROKEN = {
    "depends_on a missing service": (
        _set("services.gateway.depends_on.ledgr", {"condition": "service_healthy"}),
        "services.gateway.depends_on: 'ledgr' is not a service in this file",
    ),
    "undeclared environment variable": (
        _set("services.ledger-r0.environment.KVLEDGER_LEDGER_THREADS", "4"),
        "services.ledger-r0.environment: KVLEDGER_LEDGER_THREADS is not declared in "
        "services.environment.ENV_VARS",
    ),
    "undeclared interpolated variable": (
        _set("services.gateway.environment.KVLEDGER_API_KEY", "${GATEWAY_KEY}"),
        "${GATEWAY_KEY} interpolates a variable that is not declared",
    ),
    "schema: misspelt service key": (
        _set("services.gateway.healtcheck", {"test": ["CMD", "true"]}),
        "schema: services.gateway: Unevaluated properties are not allowed ('healtcheck' was "
        "unexpected)",
    ),
    "schema: unknown depends_on condition": (
        _set("services.gateway.depends_on.ledger-r0.condition", "service_ready"),
        "schema: services.gateway.depends_on.ledger-r0.condition: 'service_ready' is not one of",
    ),
    "schema: ports as a string": (
        _set("services.gateway.ports", "8000:8000"),
        "schema: services.gateway.ports: '8000:8000' is not of type 'array'",
    ),
    "published port differs from KVLEDGER_PORT": (
        _set("services.gateway.ports", ["8080:8080"]),
        "services.gateway.ports: no published port maps to KVLEDGER_PORT=8000",
    ),
    "metrics port changed but not exposed": (
        _set("services.ledger-r0.environment.KVLEDGER_METRICS_PORT", "9200"),
        "services.ledger-r0.expose: KVLEDGER_METRICS_PORT=9200 is not exposed",
    ),
    "healthcheck probes another port": (
        _set(
            "services.gateway.healthcheck.test",
            [
                "CMD",
                "python",
                "-c",
                "import urllib.request as u; u.urlopen('http://localhost:8080/health')",
            ],
        ),
        "services.gateway.healthcheck: probes port [8080], but KVLEDGER_PORT=8000",
    ),
    "gateway bound to loopback": (
        _delete("services.gateway.environment.KVLEDGER_HOST"),
        "services.gateway.environment.KVLEDGER_HOST: must be 0.0.0.0",
    ),
    "OTLP over HTTP sent to the gRPC port": (
        _set("services.worker-r0.environment.OTEL_EXPORTER_OTLP_ENDPOINT", "http://jaeger:4317"),
        "services.worker-r0.environment.OTEL_EXPORTER_OTLP_ENDPOINT: port 4317 does not take OTLP "
        "over http/protobuf; Jaeger listens on 4318",
    ),
    "OTLP sent to a service that is not Jaeger": (
        _set("services.ledger-r0.environment.OTEL_EXPORTER_OTLP_ENDPOINT", "http://redis:4318"),
        "host 'redis' is not the Jaeger service of this file",
    ),
    "service_healthy on a service without a healthcheck": (
        _delete("services.ledger-r0.healthcheck"),
        "services.gateway.depends_on.ledger-r0: waits for service_healthy, but services.ledger-r0 "
        "has no healthcheck",
    ),
    "Redis without a healthcheck": (
        _delete("services.redis.healthcheck"),
        "services.redis: Redis needs a healthcheck",
    ),
    "worker without a GPU reservation": (
        lambda d: [_delete(f"services.worker-r{i}.deploy")(d) for i in range(2)],
        "services: no worker reserves an NVIDIA GPU",
    ),
    "Redis URL to a missing host": (
        _set("services.worker-r0.environment.KVLEDGER_REDIS_URL", "redis://cache:6379/0"),
        "services.worker-r0.environment.KVLEDGER_REDIS_URL: host 'cache' is not a service",
    ),
    "command that is not a kvledger role": (
        _set("services.worker-r0.command", ["serve"]),
        "services.worker-r0.command: ['serve'] does not start with a kvledger sub-command",
    ),
    "dependency cycle": (
        _set("services.ledger-r0.depends_on.gateway", {"condition": "service_started"}),
        "services: depends_on cycle ledger-r0 -> gateway -> ledger-r0",
    ),
    "gateway routes to a replica with no ledger": (
        _set("services.gateway.command", ["gateway", "--replicas", "r0,r2"]),
        "services.gateway.command: follows replica 'r2', which no ledger serves",
    ),
    "replica without a worker": (
        _set("services.worker-r1.command", ["worker", "--replica", "r0"]),
        "services.ledger-r1: replica 'r1' has no worker",
    ),
    "two ledgers for one replica": (
        _set("services.ledger-r1.command", ["ledger", "--replica", "r0"]),
        "services: replica 'r0' has two ledgers (ledger-r0, ledger-r1)",
    ),
    "indexer follows a replica with no ledger": (
        _set("services.indexer.command", ["indexer", "--replicas", "default"]),
        "services.indexer.command: follows replica 'default', which no ledger serves",
    ),
    "Jaeger without its UI port": (
        _set("services.jaeger.ports", ["4317:4317", "4318:4318", "13133:13133"]),
        "services.jaeger.ports: Jaeger's port 16686 is not declared",
    ),
}


@pytest.mark.parametrize("fault", list(BROKEN))
def test_broken_variant_is_rejected_with_a_precise_message(compose: Doc, fault: str) -> None:
    mutate, expected = BROKEN[fault]
    broken = copy.deepcopy(compose)
    mutate(broken)
    problems = check_compose(broken)
    assert any(expected in problem for problem in problems), problems


def test_command_line_fails_on_a_broken_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = strip_tags(load_compose(COMPOSE))
    broken["services"]["gateway"]["depends_on"]["ledgr"] = {"condition": "service_healthy"}
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    for needed in ("Dockerfile", "pyproject.toml", ".dockerignore"):
        (tmp_path / needed).write_text((ROOT / needed).read_text())

    assert compose_check.main([str(path)]) == 1
    assert "services.gateway.depends_on: 'ledgr' is not a service" in capsys.readouterr().err
    assert compose_check.main([str(COMPOSE), str(CPU_OVERRIDE)]) == 0


def test_override_tags_follow_compose_merge_rules() -> None:
    base = {
        "services": {
            "w": {
                "ports": ["1:1"],
                "command": ["a"],
                "deploy": {"x": 1},
                "environment": {"A": "1", "B": "2"},
            }
        }
    }
    override = yaml.load(
        "services:\n  w:\n    ports: ['2:2']\n    command: [b]\n    deploy: !reset null\n"
        "    environment: !override {C: '3'}\n",
        Loader=ComposeLoader,
    )
    assert merge_compose(base, override) == {
        "services": {"w": {"ports": ["1:1", "2:2"], "command": ["b"], "environment": {"C": "3"}}}
    }
