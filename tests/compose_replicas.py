"""The replicas of a compose stack, for tests/compose_check.py: which replica each ledger and
worker serves (`--replica NAME` or KVLEDGER_REPLICA, `default` otherwise) and which ones each
gateway routes to and each indexer follows (`--replicas a,b` or KVLEDGER_REPLICAS). A replica a
gateway sends to must have a ledger and a worker, or its requests wait for nobody."""

from __future__ import annotations

from typing import Any

from tests.compose_model import as_list, environment_of, is_kvledger_service, role_of


def _flag(service: dict[str, Any], flag: str) -> str | None:
    command = [str(part) for part in as_list(service.get("command"))]
    for k, part in enumerate(command):
        if part == flag and k + 1 < len(command):
            return command[k + 1]
        if part.startswith(flag + "="):
            return part.split("=", 1)[1]
    return None


def replica_of(service: dict[str, Any]) -> str:
    found = _flag(service, "--replica") or environment_of(service).get("KVLEDGER_REPLICA")
    return found or "default"


def replicas_followed(service: dict[str, Any]) -> list[str]:
    names = _flag(service, "--replicas") or environment_of(service).get("KVLEDGER_REPLICAS")
    return [n.strip() for n in (names or replica_of(service)).split(",") if n.strip()]


def replica_problems(services: dict[str, Any]) -> list[str]:
    ledgers: dict[str, list[str]] = {}
    workers: dict[str, list[str]] = {}
    for name, service in services.items():
        if not is_kvledger_service(service):
            continue
        role = role_of(service)
        if role in ("ledger", "worker"):
            (ledgers if role == "ledger" else workers).setdefault(replica_of(service), []).append(
                name
            )
    problems = [
        f"services: replica {replica!r} has two ledgers ({', '.join(names)}); one per replica"
        for replica, names in ledgers.items()
        if len(names) > 1
    ]
    problems += [
        f"services.{names[0]}: replica {replica!r} has no worker (command worker --replica "
        f"{replica}): its ledger cannot run a step"
        for replica, names in ledgers.items()
        if replica not in workers
    ]
    problems += [
        f"services.{names[0]}: replica {replica!r} has no ledger: nothing schedules its worker"
        for replica, names in workers.items()
        if replica not in ledgers
    ]
    for name, service in services.items():
        if is_kvledger_service(service) and role_of(service) in ("gateway", "indexer"):
            problems += [
                f"services.{name}.command: follows replica {replica!r}, which no ledger serves "
                f"(ledgers serve {', '.join(sorted(ledgers)) or 'nothing'})"
                for replica in replicas_followed(service)
                if replica not in ledgers
            ]
    return problems
