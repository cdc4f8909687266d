"""The compose stack run for real with podman: the images built by docker/local/build.sh, the
repository's docker-compose.yml and docker-compose.cpu.yml, and an override written here that
puts every service on the host network (each on a free 127.0.0.1 port), swaps the public images
for the local ones and points OTLP at a receiver on the host.

podman 4.3 (Debian 12) has no `podman wait --condition=healthy` and, without systemd, no timer
that runs health checks; podman-compose then starts every container at once and the services'
own retries cover the order. `Stack.wait_healthy` runs the compose file's health checks
(`podman healthcheck run`) until each container passes, which is what compose's service_healthy
would have waited for.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from services.transport.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "docker" / "local" / "build.sh"
CONTAINERS_CONF = ROOT / "docker" / "local" / "containers.conf"
KVLEDGER_IMAGE = "localhost/kvledger:local-debian"
REDIS_IMAGE = "localhost/kvledger-redis:local"
PROMETHEUS_IMAGE = "localhost/kvledger-prometheus:local"
# Where scripts and people put podman-compose when it is not on PATH (a venv of its own: the
# project's venv does not need it).
PODMAN_COMPOSE_VENV = Path.home() / ".cache" / "kvledger" / "podman-compose"
KVLEDGER_SERVICES = ("ledger-r0", "ledger-r1", "worker-r0", "worker-r1", "gateway", "gateway-2")


def podman_compose() -> str | None:
    explicit = os.environ.get("KVLEDGER_PODMAN_COMPOSE")
    if explicit:
        return explicit
    found = shutil.which("podman-compose")
    if found:
        return found
    candidate = PODMAN_COMPOSE_VENV / "bin" / "podman-compose"
    return str(candidate) if candidate.is_file() else None


def missing_tools() -> list[str]:
    """Why the stack cannot run here (empty when it can)."""
    missing = [tool for tool in ("podman", "mmdebstrap") if shutil.which(tool) is None]
    if podman_compose() is None:
        missing.append(
            f"podman-compose (pip install podman-compose into {PODMAN_COMPOSE_VENV}, "
            "or set KVLEDGER_PODMAN_COMPOSE)"
        )
    if os.geteuid() != 0:
        missing.append("root (podman here runs rootful: host network, imported base images)")
    return missing


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
    return env


def build_images(python: str) -> None:
    subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        env={**engine_env(), "PYTHON": python},
        check=True,
        timeout=1200,
    )


@dataclass
class Ports:
    redis: int = field(default_factory=free_port)
    gateway: int = field(default_factory=free_port)
    gateway_2: int = field(default_factory=free_port)
    ledger_r0: int = field(default_factory=free_port)
    ledger_r1: int = field(default_factory=free_port)
    indexer: int = field(default_factory=free_port)
    prometheus: int = field(default_factory=free_port)


def _check(*test: str) -> _Tag:
    """A health check that replaces the base file's whole (podman-compose 1.6 would otherwise
    append this `test` list to the base one)."""
    return _Tag(
        "!override", {"test": ["CMD", *test], "interval": "5s", "timeout": "5s", "retries": 24}
    )


def _http_check(port: int, path: str = "/health") -> _Tag:
    probe = (
        f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}{path}', timeout=3)"
    )
    return _check("python", "-c", probe)


class _Tagged(yaml.SafeDumper):
    """Writes compose's !reset / !override tags, each value in full (no YAML aliases)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


@dataclass
class _Tag:
    tag: str
    value: Any


def _represent_tag(dumper: yaml.SafeDumper, data: _Tag) -> yaml.Node:
    if isinstance(data.value, list):
        return dumper.represent_sequence(data.tag, data.value)
    return dumper.represent_mapping(data.tag, data.value)


_Tagged.add_representer(_Tag, _represent_tag)


def override(ports: Ports, otlp_port: int, prometheus_config: Path) -> dict[str, Any]:
    """The host-network override: every port free on 127.0.0.1, local images, OTLP to the host."""
    redis_url = f"redis://127.0.0.1:{ports.redis}/0"
    # The base file's `ports:` stay: podman discards port mappings under the host network.
    host = {"network_mode": "host"}
    kvledger = {
        **host,
        "image": KVLEDGER_IMAGE,
        "pull_policy": "never",
    }

    def env(**extra: str) -> dict[str, str]:
        return {
            "KVLEDGER_REDIS_URL": redis_url,
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
            **extra,
        }

    services: dict[str, Any] = {
        "redis": {
            **host,
            "image": REDIS_IMAGE,
            "pull_policy": "never",
            "command": [
                "redis-server",
                "--bind",
                "127.0.0.1",
                "--port",
                str(ports.redis),
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            "healthcheck": _check("redis-cli", "-p", str(ports.redis), "ping"),
        },
        # Jaeger's image cannot be had here: a stand-in that is healthy once the host's OTLP
        # receiver accepts connections, so the services' wait for it keeps its meaning.
        "jaeger": {
            **host,
            "image": KVLEDGER_IMAGE,
            "pull_policy": "never",
            "entrypoint": ["python", "-c", "import signal; signal.pause()"],
            "healthcheck": _check(
                "python",
                "-c",
                f"import socket; socket.create_connection(('127.0.0.1', {otlp_port}), 3)",
            ),
        },
        "ledger-r0": {
            **kvledger,
            "environment": env(
                KVLEDGER_METRICS_PORT=str(ports.ledger_r0), KVLEDGER_METRICS_HOST="127.0.0.1"
            ),
            "healthcheck": _http_check(ports.ledger_r0),
        },
        "ledger-r1": {
            **kvledger,
            "environment": env(
                KVLEDGER_METRICS_PORT=str(ports.ledger_r1), KVLEDGER_METRICS_HOST="127.0.0.1"
            ),
            "healthcheck": _http_check(ports.ledger_r1),
        },
        "gateway": {
            **kvledger,
            "environment": env(KVLEDGER_HOST="127.0.0.1", KVLEDGER_PORT=str(ports.gateway)),
            "healthcheck": _http_check(ports.gateway),
        },
        "gateway-2": {
            **kvledger,
            "environment": env(KVLEDGER_HOST="127.0.0.1", KVLEDGER_PORT=str(ports.gateway_2)),
            "healthcheck": _http_check(ports.gateway_2),
        },
        "indexer": {
            **kvledger,
            "environment": env(),
            "command": [
                "indexer",
                "--host",
                "127.0.0.1",
                "--port",
                str(ports.indexer),
                "--replicas",
                "r0,r1",
            ],
            "healthcheck": _http_check(ports.indexer),
        },
        "worker-r0": {**kvledger, "environment": env()},
        "worker-r1": {**kvledger, "environment": env()},
        "prometheus": {
            **host,
            "image": PROMETHEUS_IMAGE,
            "pull_policy": "never",
            "volumes": _Tag(
                "!override", [f"{prometheus_config}:/etc/prometheus/prometheus.yml:ro"]
            ),
            "command": [
                "--config.file=/etc/prometheus/prometheus.yml",
                "--storage.tsdb.path=/tmp/prometheus",
                f"--web.listen-address=127.0.0.1:{ports.prometheus}",
            ],
        },
    }
    return {"services": services}


def prometheus_config(ports: Ports) -> dict[str, Any]:
    """docker/prometheus.yml's jobs with the host-network addresses."""
    base = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    addresses = {
        "gateway:8000": ports.gateway,
        "gateway-2:8001": ports.gateway_2,
        "ledger-r0:9100": ports.ledger_r0,
        "ledger-r1:9100": ports.ledger_r1,
    }
    for job in base["scrape_configs"]:
        for static in job["static_configs"]:
            static["targets"] = [f"127.0.0.1:{addresses[t]}" for t in static["targets"]]
    return base


class Stack:
    """One compose project on podman: `up`, the health checks, the containers, `down`."""

    def __init__(self, workdir: Path, otlp_port: int) -> None:
        self.ports = Ports()
        self.project = f"kvledger-test-{os.getpid()}"
        config = workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(prometheus_config(self.ports)))
        self.override = workdir / "docker-compose.test.yml"
        self.override.write_text(
            yaml.dump(override(self.ports, otlp_port, config), Dumper=_Tagged, sort_keys=False)
        )
        self.log = workdir / "podman-compose.log"

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        command = [
            str(podman_compose()),
            "--project-name",
            self.project,
            "--profile",
            "monitoring",
            "-f",
            str(ROOT / "docker-compose.yml"),
            "-f",
            str(ROOT / "docker-compose.cpu.yml"),
            "-f",
            str(self.override),
            *args,
        ]
        # The model is named here, not left to the caller's shell: the seeded tiny Llama.
        env = {**engine_env(), "KVLEDGER_MODEL": "tiny", "KVLEDGER_API_KEY": ""}
        done = subprocess.run(
            command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
        with self.log.open("a") as log:
            log.write(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}\n")
        return done

    def up(self) -> None:
        done = self.compose("up", "-d")
        if done.returncode != 0:
            raise RuntimeError(f"podman-compose up failed:\n{done.stdout}\n{done.stderr}")

    def down(self) -> None:
        self.compose("down", "-t", "10")
        # Whatever `down` left (a container restarting at that moment).
        for name in self.containers():
            podman("rm", "-f", "-t", "0", name)

    def containers(self) -> dict[str, str]:
        """{service: container name} of this project, running or not."""
        out = podman(
            "ps",
            "-a",
            "--filter",
            f"label=io.podman.compose.project={self.project}",
            "--format",
            "json",
        )
        found = {}
        for entry in json.loads(out or "[]"):
            service = entry.get("Labels", {}).get("com.docker.compose.service")
            if service:
                found[service] = entry["Names"][0]
        return found

    def inspect(self, service: str) -> dict[str, Any]:
        return json.loads(podman("inspect", self.containers()[service]))[0]

    def wait_healthy(self, services: list[str], timeout_s: float) -> None:
        """Runs each service's health check until it passes (podman 4.3 has no timer for it)."""
        pending = list(services)
        deadline = time.monotonic() + timeout_s
        while pending:
            names = self.containers()
            pending = [
                s
                for s in pending
                if s not in names
                or subprocess.run(
                    ["podman", "healthcheck", "run", names[s]],
                    env=engine_env(),
                    capture_output=True,
                    timeout=30,
                ).returncode
                != 0
            ]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {timeout_s:.0f} s: {pending}\n{self.logs()}")
            time.sleep(2)

    def logs(self, tail: int = 25) -> str:
        parts = []
        for service, name in sorted(self.containers().items()):
            done = subprocess.run(
                ["podman", "logs", "--tail", str(tail), name],
                env=engine_env(),
                capture_output=True,
                text=True,
                timeout=30,
            )
            parts.append(f"--- {service} ({name})\n{done.stdout}{done.stderr}")
        return "\n".join(parts)


def podman(*args: str) -> str:
    done = subprocess.run(
        ["podman", *args], env=engine_env(), capture_output=True, text=True, timeout=120
    )
    return done.stdout
