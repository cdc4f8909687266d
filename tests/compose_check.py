"""Static checks of the docker compose stack for machines without a Docker engine: the
compose-spec schema (vendored by check-jsonschema) plus what compose would only find at `up`
time: missing services, ports, undeclared variables, dependencies without health checks.

    python tests/compose_check.py docker-compose.yml [docker-compose.cpu.yml]
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from services.environment import ENV_VARS  # noqa: E402
from tests.compose_model import (  # noqa: E402
    DEFAULT_METRICS_PORT,
    ROLES,
    as_list,
    container_ports,
    depends_on,
    environment_of,
    has_healthcheck,
    is_kvledger_service,
    listed,
    listening_ports,
    load_compose,
    merge_compose,
    prometheus_targets,
    published_container_ports,
    reserves_gpu,
    role_of,
    services_with_role,
    strip_tags,
)
from tests.compose_replicas import replica_problems  # noqa: E402

# Set in kvledger containers although kvledger itself never reads them: Python's own switches.
ALLOWED_EXTRA_ENV = frozenset({"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONFAULTHANDLER"})
JAEGER_IMAGE = "cr.jaegertracing.io/jaegertracing/jaeger"
JAEGER_PORTS = (4317, 4318, 16686, 13133)
OTLP_PORT_BY_PROTOCOL = {"http/protobuf": 4318, "grpc": 4317}
REDIS_PORT = 6379
_LOCAL_URL_PORT = re.compile(r"(?:localhost|127\.0\.0\.1):(\d+)")
_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)")


# --- the schema ---------------------------------------------------------------------------------


def compose_schema() -> dict[str, Any]:
    vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads(vendor.joinpath("compose-spec.json").read_text())


def schema_problems(document: dict[str, Any]) -> list[str]:
    validator = Draft202012Validator(compose_schema())
    found = [(_where(e), e) for e in (_closest(e) for e in validator.iter_errors(document))]
    problems = []
    for where, error in sorted(found, key=lambda pair: pair[0]):
        # A service with any invalid key also fails unevaluatedProperties, which then names every
        # key of that service; the specific error beneath it is the one worth reading.
        if error.validator == "unevaluatedProperties" and any(
            other.startswith(f"{where}.") for other, _ in found
        ):
            continue
        problems.append(f"schema: {where}: {error.message}")
    return problems


def _closest(error: ValidationError) -> ValidationError:
    """For oneOf/anyOf, the branch that matched the value's type and failed deepest."""
    while error.context:
        branches = [e for e in error.context if e.relative_path or e.validator != "type"]
        error = max(branches or error.context, key=lambda e: len(e.absolute_path))
    return error


def _where(error: ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


# --- cross-references ---------------------------------------------------------------------------


def reference_problems(
    document: dict[str, Any], *, require_gpu_worker: bool = True, root: Path = ROOT
) -> list[str]:
    services = document.get("services")
    if not isinstance(services, dict) or not services:
        return ["services: the file defines no services"]
    problems: list[str] = []
    for name, service in services.items():
        problems += _dependency_problems(name, service, services)
        if is_kvledger_service(service):
            problems += _kvledger_problems(name, service, services, root)
        image = str(service.get("image", ""))
        if image.startswith(JAEGER_IMAGE):
            problems += _jaeger_problems(name, service)
        if image.startswith("redis") and not has_healthcheck(service):
            problems.append(f"services.{name}: Redis needs a healthcheck (redis-cli ping)")
        problems += _prometheus_problems(name, service, services, root)
    problems += _cycle_problems(services)
    problems += replica_problems(services)
    if require_gpu_worker and not any(
        reserves_gpu(s) for s in services_with_role(services, "worker")
    ):
        problems.append(
            "services: no worker reserves an NVIDIA GPU "
            "(deploy.resources.reservations.devices with driver nvidia)"
        )
    if not any(str(s.get("image", "")).startswith(JAEGER_IMAGE) for s in services.values()):
        problems.append(f"services: no Jaeger service ({JAEGER_IMAGE})")
    for role in ("ledger", "gateway", "worker"):  # the indexer is optional
        if not list(services_with_role(services, role)):
            problems.append(f"services: no service runs `kvledger {role}`")
    return problems


def _dependency_problems(name: str, service: dict[str, Any], services: dict[str, Any]) -> list[str]:
    problems = []
    for target, condition in depends_on(service).items():
        if target not in services:
            problems.append(
                f"services.{name}.depends_on: {target!r} is not a service in this "
                f"file (services: {', '.join(sorted(services))})"
            )
        elif condition == "service_healthy" and not has_healthcheck(services[target]):
            problems.append(
                f"services.{name}.depends_on.{target}: waits for service_healthy, "
                f"but services.{target} has no healthcheck"
            )
    return problems


def _kvledger_problems(
    name: str, service: dict[str, Any], services: dict[str, Any], root: Path
) -> list[str]:
    where = f"services.{name}"
    environment = environment_of(service)
    problems = [
        f"{where}.environment: {var} is not declared in services.environment.ENV_VARS "
        f"(nor allowed in tests/compose_check.py: {', '.join(sorted(ALLOWED_EXTRA_ENV))})"
        for var in environment
        if var not in ENV_VARS and var not in ALLOWED_EXTRA_ENV
    ]
    problems += [
        f"{where}.environment: ${{{var}}} interpolates a variable that is not declared "
        "in services.environment.ENV_VARS"
        for value in environment.values()
        for var in _INTERPOLATION.findall(str(value))
        if var not in ENV_VARS and var not in ALLOWED_EXTRA_ENV
    ]
    if "env_file" in service:
        problems.append(
            f"{where}.env_file: variables must be listed in the file, where this check can see them"
        )
    problems += _build_problems(where, service, root)
    problems += _url_problems(where, service, services, environment)
    role = role_of(service)
    if role is None:
        problems.append(
            f"{where}.command: {service.get('command')!r} does not start with a "
            f"kvledger sub-command ({', '.join(ROLES)})"
        )
    elif role == "gateway":
        problems += _gateway_problems(where, service, environment)
    elif role == "ledger":
        problems += _ledger_problems(where, service, environment)
    elif role == "worker":
        problems += _worker_problems(where, service, environment)
    return problems


def _build_problems(where: str, service: dict[str, Any], root: Path) -> list[str]:
    build = service.get("build")
    if build is None:
        return []
    context = root / (build if isinstance(build, str) else build.get("context", "."))
    dockerfile = context / (
        "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
    )
    if not dockerfile.is_file():
        return [f"{where}.build: {dockerfile.relative_to(root)} does not exist"]
    return []


def _url_problems(
    where: str, service: dict[str, Any], services: dict[str, Any], environment: dict[str, str]
) -> list[str]:
    problems = []
    dependencies = depends_on(service)
    redis_url = environment.get("KVLEDGER_REDIS_URL")
    if redis_url:
        url = urlsplit(redis_url)
        if url.hostname not in services:
            problems.append(
                f"{where}.environment.KVLEDGER_REDIS_URL: host {url.hostname!r} is "
                "not a service in this file"
            )
        elif (url.port or REDIS_PORT) != REDIS_PORT:
            problems.append(
                f"{where}.environment.KVLEDGER_REDIS_URL: port {url.port} is not "
                f"Redis's {REDIS_PORT}"
            )
        elif dependencies.get(url.hostname) != "service_healthy":
            problems.append(
                f"{where}.depends_on: must wait for {url.hostname} "
                "(condition: service_healthy), the Redis it connects to"
            )
    endpoint = environment.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if endpoint:
        problems += _otlp_problems(where, services, environment, endpoint, dependencies)
    return problems


def _otlp_problems(
    where: str,
    services: dict[str, Any],
    environment: dict[str, str],
    endpoint: str,
    dependencies: dict[str, str],
) -> list[str]:
    label = f"{where}.environment.OTEL_EXPORTER_OTLP_ENDPOINT"
    protocol = environment.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    if protocol not in OTLP_PORT_BY_PROTOCOL:
        return [
            f"{where}.environment.OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not one of "
            f"{', '.join(OTLP_PORT_BY_PROTOCOL)}"
        ]
    url = urlsplit(endpoint)
    target = services.get(url.hostname)
    want = OTLP_PORT_BY_PROTOCOL[protocol]
    if url.scheme not in ("http", "https"):
        return [f"{label}: {endpoint!r} must be a URL such as http://jaeger:{want}"]
    if target is None or not str(target.get("image", "")).startswith(JAEGER_IMAGE):
        return [f"{label}: host {url.hostname!r} is not the Jaeger service of this file"]
    if url.port != want:
        return [
            f"{label}: port {url.port} does not take OTLP over {protocol}; Jaeger listens "
            f"on {want} for it"
        ]
    if want not in container_ports(target):
        return [f"{label}: services.{url.hostname} does not declare port {want}"]
    if url.hostname not in dependencies:
        return [f"{where}.depends_on: must include {url.hostname}, where its spans go"]
    return []


def _gateway_problems(
    where: str, service: dict[str, Any], environment: dict[str, str]
) -> list[str]:
    port = environment.get("KVLEDGER_PORT")
    problems = []
    if environment.get("KVLEDGER_HOST") not in ("0.0.0.0", "::"):
        problems.append(
            f"{where}.environment.KVLEDGER_HOST: must be 0.0.0.0; the default "
            "127.0.0.1 cannot be reached from outside the container"
        )
    if port is None or not port.isdigit():
        return [
            *problems,
            f"{where}.environment: KVLEDGER_PORT must be set to the port it publishes",
        ]
    if int(port) not in published_container_ports(service):
        problems.append(
            f"{where}.ports: no published port maps to KVLEDGER_PORT={port} "
            f"(publishes {sorted(published_container_ports(service))})"
        )
    problems += _healthcheck_port_problems(where, service, int(port), "KVLEDGER_PORT")
    return problems


def _ledger_problems(where: str, service: dict[str, Any], environment: dict[str, str]) -> list[str]:
    port = int(environment.get("KVLEDGER_METRICS_PORT", DEFAULT_METRICS_PORT))
    if port == 0:
        return [
            f"{where}.environment.KVLEDGER_METRICS_PORT: 0 turns off /health, which the "
            "healthcheck needs"
        ]
    problems = []
    if port not in container_ports(service):
        problems.append(f"{where}.expose: KVLEDGER_METRICS_PORT={port} is not exposed")
    problems += _healthcheck_port_problems(where, service, port, "KVLEDGER_METRICS_PORT")
    return problems


def _worker_problems(where: str, service: dict[str, Any], environment: dict[str, str]) -> list[str]:
    device = environment.get("KVLEDGER_DEVICE", "auto")
    if reserves_gpu(service) and device == "cpu":
        return [f"{where}: reserves a GPU but KVLEDGER_DEVICE=cpu"]
    if not reserves_gpu(service) and device == "cuda":
        return [
            f"{where}.environment.KVLEDGER_DEVICE: cuda without a GPU reservation "
            "(deploy.resources.reservations.devices) fails at start"
        ]
    return []


def _healthcheck_port_problems(
    where: str, service: dict[str, Any], port: int, variable: str
) -> list[str]:
    if not has_healthcheck(service):
        return [f"{where}: needs a healthcheck (GET /health on {variable}={port})"]
    test = " ".join(map(str, as_list(service["healthcheck"].get("test"))))
    probed = {int(p) for p in _LOCAL_URL_PORT.findall(test)}
    if probed and probed != {port}:
        return [f"{where}.healthcheck: probes port {sorted(probed)}, but {variable}={port}"]
    return []


def _jaeger_problems(name: str, service: dict[str, Any]) -> list[str]:
    missing = [p for p in JAEGER_PORTS if p not in container_ports(service)]
    problems = [f"services.{name}.ports: Jaeger's port {p} is not declared" for p in missing]
    if not has_healthcheck(service):
        problems.append(f"services.{name}: needs a healthcheck (http://localhost:13133/status)")
    return problems


def _prometheus_problems(
    name: str, service: dict[str, Any], services: dict[str, Any], root: Path
) -> list[str]:
    problems = []
    for volume in listed(service, "volumes"):
        source = str(volume).split(":")[0] if isinstance(volume, str) else volume.get("source", "")
        if not source.endswith("prometheus.yml"):
            continue
        config_path = root / source
        if not config_path.is_file():
            problems.append(f"services.{name}.volumes: {source} does not exist")
            continue
        for target in prometheus_targets(config_path):
            host, _, port = target.rpartition(":")
            if host not in services:
                problems.append(f"{source}: target {target}: {host!r} is not a service")
            elif int(port) not in listening_ports(services[host]):
                problems.append(
                    f"{source}: target {target}: services.{host} does not listen "
                    f"on {port} (listens on {sorted(listening_ports(services[host]))})"
                )
    return problems


def _cycle_problems(services: dict[str, Any]) -> list[str]:
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> list[str]:
        if state.get(name) == "done" or name not in services:
            return []
        if state.get(name) == "visiting":
            return [f"services: depends_on cycle {' -> '.join([*path, name])}"]
        state[name] = "visiting"
        found = [p for dep in depends_on(services[name]) for p in visit(dep, [*path, name])]
        state[name] = "done"
        return found

    return [problem for name in services for problem in visit(name, [])]


# --- the Dockerfile the compose file builds -----------------------------------------------------


def dockerfile_problems(root: Path = ROOT) -> list[str]:
    """The image must run `kvledger <role>` and contain every package pyproject installs."""
    dockerfile = (root / "Dockerfile").read_text()
    problems = []
    if not re.search(r'^ENTRYPOINT \["kvledger"\]\s*$', dockerfile, re.MULTILINE):
        problems.append(
            'Dockerfile: ENTRYPOINT must be ["kvledger"]; compose commands are its sub-commands'
        )
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    packages = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = set(re.findall(r"^COPY (\S+) ", dockerfile, re.MULTILINE))
    problems += [
        f"Dockerfile: package {p.rstrip('*')} (pyproject.toml) is never copied"
        for p in packages
        if p.rstrip("*") not in copied
    ]
    ignored = (
        (root / ".dockerignore").read_text().split() if (root / ".dockerignore").exists() else []
    )
    problems += [
        f".dockerignore: {entry} must be excluded from the build context"
        for entry in (".venv", ".git")
        if entry not in ignored
    ]
    return problems


# --- entry points -------------------------------------------------------------------------------


def check_compose(
    document: dict[str, Any], *, require_gpu_worker: bool = True, root: Path = ROOT
) -> list[str]:
    """Every problem with one (merged) compose document; empty when it is sound."""
    plain = strip_tags(document)
    return schema_problems(plain) + reference_problems(
        plain, require_gpu_worker=require_gpu_worker, root=root
    )


def check_files(base: Path, *overrides: Path) -> list[str]:
    """The base file alone (it must reserve a GPU), then base plus each override file."""
    document = load_compose(base)
    problems = [f"{base.name}: {p}" for p in check_compose(document, root=base.parent)]
    for override in overrides:
        merged = merge_compose(document, load_compose(override))
        problems += [
            f"{base.name} + {override.name}: {p}"
            for p in check_compose(merged, require_gpu_worker=False, root=base.parent)
        ]
    return problems + dockerfile_problems(base.parent)


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])]
    if not paths:
        paths = [ROOT / "docker-compose.yml", ROOT / "docker-compose.cpu.yml"]
    problems = check_files(*paths)
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"compose check: {len(problems)} problem(s) in {', '.join(map(str, paths))}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
