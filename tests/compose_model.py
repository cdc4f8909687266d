"""Reading docker compose files as compose does, for tests/compose_check.py: the `!reset` and
`!override` tags, the merge of an override file (`-f base -f override`), and small readers
for services (role, depends_on, environment, ports, health checks).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROLES = ("ledger", "gateway", "worker", "indexer")
DEFAULT_METRICS_PORT = 9100


class Reset:
    """`!reset`: removes the value the base file set."""


class Override:
    """`!override value`: replaces the base file's value instead of merging with it."""

    def __init__(self, value: Any) -> None:
        self.value = value


class ComposeLoader(yaml.SafeLoader):
    pass


def _construct_override(loader: ComposeLoader, node: yaml.Node) -> Override:
    if isinstance(node, yaml.MappingNode):
        return Override(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Override(loader.construct_sequence(node, deep=True))
    return Override(loader.construct_scalar(node))


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())
ComposeLoader.add_constructor("!override", _construct_override)

# Compose concatenates these lists across files; other lists are replaced.
_CONCATENATED = frozenset({"ports", "expose", "dns", "dns_search", "tmpfs", "external_links"})


def load_compose(path: Path) -> dict[str, Any]:
    with open(path) as f:
        document = yaml.load(f, Loader=ComposeLoader)  # SafeLoader: plain data and our two markers
    if not isinstance(document, dict):
        raise ValueError(f"{path}: not a YAML mapping")
    return document


def merge_compose(base: Any, override: Any, key: str = "") -> Any:
    """`docker compose -f base -f override`, for the merge rules our override files use."""
    if isinstance(override, Override):
        return strip_tags(override.value)
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for k, value in override.items():
            if isinstance(value, Reset):
                merged.pop(k, None)
            else:
                merged[k] = merge_compose(base.get(k), value, k) if k in base else strip_tags(value)
        return merged
    if isinstance(base, list) and isinstance(override, list) and key in _CONCATENATED:
        return base + [item for item in override if item not in base]
    return strip_tags(override)


def strip_tags(value: Any) -> Any:
    """A document without Reset/Override markers, as compose sees a single file."""
    if isinstance(value, Override):
        return strip_tags(value.value)
    if isinstance(value, dict):
        return {k: strip_tags(v) for k, v in value.items() if not isinstance(v, Reset)}
    if isinstance(value, list):
        return [strip_tags(v) for v in value if not isinstance(v, Reset)]
    return value


def is_kvledger_service(service: dict[str, Any]) -> bool:
    return "build" in service or str(service.get("image", "")).startswith("kvledger")


def role_of(service: dict[str, Any]) -> str | None:
    command = as_list(service.get("command"))
    if command and command[0] == "kvledger":  # tolerate the explicit form as well
        command = command[1:]
    return command[0] if command and command[0] in ROLES else None


def services_with_role(services: dict[str, Any], role: str) -> Iterator[dict[str, Any]]:
    return (s for s in services.values() if is_kvledger_service(s) and role_of(s) == role)


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    """depends_on in either syntax, as {target: condition}."""
    raw = service.get("depends_on") or {}
    if isinstance(raw, list):
        return {str(target): "service_started" for target in raw}
    return {str(t): (spec or {}).get("condition", "service_started") for t, spec in raw.items()}


def environment_of(service: dict[str, Any]) -> dict[str, str]:
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        pairs = (str(item).partition("=") for item in raw)
        return {key: value for key, _, value in pairs}
    return {str(k): "" if v is None else str(v) for k, v in raw.items()}


def has_healthcheck(service: dict[str, Any]) -> bool:
    check = service.get("healthcheck")
    if not isinstance(check, dict) or check.get("disable"):
        return False
    test = as_list(check.get("test"))
    return bool(test) and test[0] != "NONE"


def reserves_gpu(service: dict[str, Any]) -> bool:
    deploy = service.get("deploy") or {}
    devices = ((deploy.get("resources") or {}).get("reservations") or {}).get("devices") or []
    return any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)


def published_container_ports(service: dict[str, Any]) -> set[int]:
    return {port for entry in listed(service, "ports") for port in _container_side(entry)}


def container_ports(service: dict[str, Any]) -> set[int]:
    """Ports published or exposed (container side)."""
    exposed = {port for entry in listed(service, "expose") for port in _port_range(str(entry))}
    return published_container_ports(service) | exposed


def listening_ports(service: dict[str, Any]) -> set[int]:
    """container_ports plus the ports kvledger's own services bind from their environment."""
    ports = container_ports(service)
    environment = environment_of(service)
    if role_of(service) == "gateway" and environment.get("KVLEDGER_PORT", "").isdigit():
        ports.add(int(environment["KVLEDGER_PORT"]))
    if role_of(service) == "ledger":
        ports.add(int(environment.get("KVLEDGER_METRICS_PORT", DEFAULT_METRICS_PORT)))
    return ports


def _container_side(entry: Any) -> set[int]:
    if isinstance(entry, dict):
        return _port_range(str(entry.get("target", "")))
    return _port_range(str(entry).rsplit(":", 1)[-1])


def _port_range(text: str) -> set[int]:
    text = text.split("/")[0]
    low, _, high = text.partition("-")
    if not low.isdigit() or (high and not high.isdigit()):
        return set()
    return set(range(int(low), int(high or low) + 1))


def prometheus_targets(config_path: Path) -> list[str]:
    config = yaml.safe_load(config_path.read_text()) or {}
    return [
        target
        for job in config.get("scrape_configs", [])
        for static in job.get("static_configs", [])
        for target in static.get("targets", [])
    ]


def listed(service: dict[str, Any], key: str) -> list[Any]:
    """service[key] when it is a list; the schema check reports it when it is not."""
    value = service.get(key)
    return value if isinstance(value, list) else []


def as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return value.split() if isinstance(value, str) else list(value)
