"""A ledger and a worker started before their Redis wait for it (the loops' backoff, one line
when the wait begins and one when it ends) instead of crashing; once Redis is up, and a gateway
with it, the stack serves. The services run as separate processes (no supervisor to hide a crash).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from services.transport.redis_server import free_port
from tests.e2e.conftest import launch
from tests.faults.conftest import MODEL, Redis, complete
from tests.harness.processes import ServiceProcess

ROLES = ("ledger", "worker", "gateway")
WAIT_BEFORE_REDIS_S = 3.0  # long enough for several backoff rounds (50 ms doubling to 2 s)


@contextlib.contextmanager
def started(role: str, env: dict[str, str]) -> Iterator[ServiceProcess]:
    service = ServiceProcess(role, env).start()
    try:
        yield service
    finally:
        service.stop(timeout=20)


def _env(redis_url: str, gateway_port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEDGER_", "OTEL_"))}
    env.update(
        KVLEDGER_REDIS_URL=redis_url, KVLEDGER_LOG_FORMAT="json", PYTHONUNBUFFERED="1",
        KVLEDGER_DEVICE="cpu", KVLEDGER_NUM_GPU_BLOCKS_OVERRIDE="64",
        KVLEDGER_KV_CACHE_MEMORY_BYTES="16MiB", KVLEDGER_MAX_MODEL_LEN="128",
        KVLEDGER_METRICS_PORT="0", KVLEDGER_PORT=str(gateway_port),
        KVLEDGER_REQUEST_TIMEOUT="30", KVLEDGER_MODEL="tiny",
    )  # fmt: skip
    return env


@pytest.mark.slow
def test_ledger_and_worker_started_before_redis_wait_for_it_and_serve():
    redis = Redis(aof=False)  # its port is chosen, nothing listens on it yet
    port = free_port()
    env = _env(redis.url, port)
    try:
        with started("ledger", env) as ledger, started("worker", env) as worker:
            deadline = time.monotonic() + 60  # the worker builds its model first
            while not (ledger.records("redis_unavailable") and worker.records("redis_unavailable")):
                for service in (ledger, worker):
                    assert service.process.poll() is None, (
                        f"the {service.role} exited without Redis:\n{service.output()}"
                    )
                assert time.monotonic() < deadline, "no service reported waiting for Redis"
                time.sleep(0.1)
            time.sleep(WAIT_BEFORE_REDIS_S)
            for service in (ledger, worker):
                assert service.process.poll() is None, service.output()
            redis.start()
            with started("gateway", env) as gateway:
                url = f"http://127.0.0.1:{port}"
                deadline = time.monotonic() + 60
                while True:
                    out = complete(url, 0, stream=False, timeout=30)
                    if out.text is not None:
                        break
                    assert gateway.process.poll() is None, gateway.output()
                    assert time.monotonic() < deadline, f"not serving: {out.error}"
                    time.sleep(0.5)
                streamed = complete(url, 0, stream=True, timeout=30)
                assert streamed.text == out.text, streamed.error
            # The ledger first waits for its leadership lease, the worker to join.
            for service, loop in ((ledger, "leadership"), (worker, "startup")):
                waits = service.records("redis_unavailable")
                # One line for the whole wait (not one per attempt), and one when it ends.
                assert [w["loop"] for w in waits] == [loop], waits
                back = service.records("redis_reconnected")
                assert [b["loop"] for b in back] == [loop], back
                assert back[0]["attempts"] >= 3 and back[0]["down_s"] >= WAIT_BEFORE_REDIS_S
                assert service.process.poll() is None, service.output()
            print(f"served {MODEL} after waiting {back[0]['down_s']} s for Redis")
    finally:
        redis.stop()


@pytest.mark.slow
def test_kvledger_up_on_an_external_redis_not_up_yet_waits_for_it_then_serves():
    """`kvledger up` with KVLEDGER_REDIS_URL naming a Redis that comes up later: the launcher
    and every child (the gateway too) wait for it instead of crashing, then the stack serves."""
    redis = Redis(aof=False)  # its port is chosen, nothing listens on it yet
    served = launch(
        "tiny", num_gpu_blocks=64, max_model_len=128,
        env={"KVLEDGER_REDIS_URL": redis.url, "KVLEDGER_LOG_FORMAT": "json"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60  # the worker builds its model first
        while True:
            waiting = {r.get("service") for r in served.log_records("redis_unavailable")}
            if {f"kvledger-{role}" for role in ROLES} <= waiting and any(
                "kvledger up: waiting for Redis" in line for line in served.lines
            ):
                break
            assert served.process.poll() is None, f"kvledger up exited:\n{served.output()}"
            assert time.monotonic() < deadline, f"not all waiting for Redis:\n{served.output()}"
            time.sleep(0.1)
        time.sleep(WAIT_BEFORE_REDIS_S)
        assert served.process.poll() is None, served.output()
        assert " exited with code " not in served.output(), served.output()  # no restart
        redis.start()
        served.wait_until_serving()
        assert any("kvledger up: Redis answered after" in line for line in served.lines)
        out = complete(served.url, 0, stream=False, timeout=30)
        streamed = complete(served.url, 0, stream=True, timeout=30)
        assert out.text is not None and streamed.text == out.text, (out.error, streamed.error)
        for role, loop in (("ledger", "leadership"), ("worker", "startup"), ("gateway", "startup")):
            service = f"kvledger-{role}"
            waits = [r for r in served.log_records("redis_unavailable") if r["service"] == service]
            assert [w["loop"] for w in waits] == [loop], (role, waits)  # one line, not per try
            back = [r for r in served.log_records("redis_reconnected") if r["service"] == service]
            assert [b["loop"] for b in back] == [loop], (role, back)
            assert back[0]["down_s"] >= WAIT_BEFORE_REDIS_S
    finally:
        served.stop()
        redis.stop()
    assert served.process.returncode == 0, served.output()


@pytest.mark.parametrize("role", ["ledger", "gateway"])
def test_a_wrong_redis_password_fails_at_once_instead_of_waiting_forever(role):
    # A refused password is not an outage: retrying would wait for ever behind a log line.
    from services.transport.redis_server import RedisServer

    server = RedisServer(extra_args=("--requirepass", "right-password")).start()
    try:
        env = _env(f"redis://:wrong-password@127.0.0.1:{server.port}/0", free_port())
        with started(role, env) as service:
            try:
                code = service.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the {role} kept waiting with a wrong password:\n{service.output()}")
            assert code != 0
            output = service.output()
            assert "WRONGPASS" in output or "invalid username-password" in output, output
            assert "wrong-password" not in output  # the password itself is never printed
            assert not service.records("redis_unavailable"), output
    finally:
        server.stop()
