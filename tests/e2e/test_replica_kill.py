"""A replica killed behind the routing gateway, as separate processes on one redis-server.

Two replicas (a ledger and a worker process each) and one gateway (`--replicas r0,r1`, precise).
Under a steady load, r0's ledger (or, separately, its worker) gets SIGKILL. Every request ends in
a result or an explicit error within a bound; the router scores r0 by load alone while its
status is stale, then takes it out (no request goes to it while out); restarted, r0 comes back
in and is chosen again; at the end every KV block of both replicas is free."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest
import redis

from services.transport.keys import StreamNames
from services.transport.redis_server import RedisServer, free_port
from services.wire import codec
from services.wire.messages import LedgerStatus
from tests.e2e.conftest import _hermetic_env
from tests.harness.processes import ServiceProcess

TIMEOUT_S = 30.0  # the gateway's request timeout: the bound on a request's end, plus slack
PREFIX = "kill"
ARRIVAL_S = 0.4


@dataclass
class Outcome:
    started: float
    ended: float
    status: int
    body: dict


def _complete(url: str, index: int) -> Outcome:
    prompt = f"Request {index:04d} asks the replicas for a few tokens of their tiny model. " * 2
    body = {"model": "kvledger-tiny-llama", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S + 30) as reply:
            return Outcome(started, time.monotonic(), reply.status, json.loads(reply.read()))
    except urllib.error.HTTPError as exc:
        return Outcome(started, time.monotonic(), exc.code, json.loads(exc.read()))


def _status(client: redis.Redis, replica: str) -> LedgerStatus | None:
    data = client.get(StreamNames(PREFIX, replica).ledger_status)
    return codec.decode(data, LedgerStatus) if data else None


@pytest.mark.slow  # ~25 s (ledger) and over a minute (worker): in-process siblings in
# tests/gateway/test_gateway_routing.py and tests/indexer/test_indexer.py run in every run
@pytest.mark.parametrize("victim", ["ledger", "worker"])
def test_a_killed_replica_is_scored_by_load_then_out_then_back_and_every_request_ends(victim):
    with RedisServer() as server:
        base = {
            **_hermetic_env(), "KVLEDGER_REDIS_URL": server.url, "KVLEDGER_STREAM_PREFIX": PREFIX,
            "KVLEDGER_DEVICE": "cpu", "KVLEDGER_NUM_GPU_BLOCKS_OVERRIDE": "48",
            "KVLEDGER_MAX_MODEL_LEN": "256", "OMP_NUM_THREADS": "1", "KVLEDGER_MODEL": "tiny",
        }  # fmt: skip
        procs: dict[str, ServiceProcess] = {}
        for name in ("r0", "r1"):
            env = {**base, "KVLEDGER_REPLICA": name, "KVLEDGER_METRICS_PORT": str(free_port())}
            procs[f"ledger-{name}"] = ServiceProcess("ledger", env).start()
            procs[f"worker-{name}"] = ServiceProcess("worker", env).start()
        port = free_port()
        gateway = ServiceProcess(
            "gateway",
            {**base, "KVLEDGER_PORT": str(port), "KVLEDGER_REPLICAS": "r0,r1",
             "KVLEDGER_REQUEST_TIMEOUT": str(TIMEOUT_S), "KVLEDGER_LOG_LEVEL": "debug"},
        ).start()  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        client = redis.Redis.from_url(server.url)
        outcomes: list[Outcome] = []
        stop = threading.Event()
        try:
            deadline = time.monotonic() + 120
            while _complete_ok(url) is False:
                assert time.monotonic() < deadline, gateway.lines[-20:]
                time.sleep(0.5)

            # Open-loop load: a request every ARRIVAL_S whatever the earlier ones are waiting on,
            # so requests keep being routed while the dead replica holds some.
            threads: list[threading.Thread] = []

            def load() -> None:
                index = 0
                while not stop.is_set():
                    thread = threading.Thread(
                        target=lambda i=index: outcomes.append(_complete(url, i))
                    )
                    thread.start()
                    threads.append(thread)
                    index += 1
                    time.sleep(ARRIVAL_S)

            loader = threading.Thread(target=load)
            loader.start()
            time.sleep(3)
            procs[f"{victim}-r0"].kill9()
            killed_at = time.monotonic()
            # Out: the ledger's status stops (10 s), or the ledger drops the worker (6 s TTL).
            _wait_for(lambda: _last_health(gateway) == "out", 40, "r0 never went out")
            out_at = time.monotonic()
            time.sleep(3)
            procs[f"{victim}-r0"].start()
            _wait_for(
                lambda: any(
                    r["replica"] == "r0" for r in gateway.records("routed")[-20:]
                ) and _last_health(gateway) == "live",
                120,  # a restarted worker loads torch and its model
                lambda: f"r0 never came back: status {_status(client, 'r0')}, last routed "
                f"{gateway.records('routed')[-3:]}, {victim} {procs[f'{victim}-r0'].lines[-15:]}",
            )  # fmt: skip
            time.sleep(2)
            stop.set()
            loader.join()
            for thread in threads:
                thread.join(timeout=TIMEOUT_S + 40)

            # Every request ended: a result, or an explicit error naming why, within the bound.
            assert len(outcomes) > 10
            for outcome in outcomes:
                assert outcome.ended - outcome.started < TIMEOUT_S + 15
                if outcome.status == 200:
                    assert outcome.body["choices"][0]["finish_reason"] in ("length", "stop")
                else:
                    assert outcome.status in (500, 503, 504), outcome
                    assert outcome.body["error"]["message"]
            routed = gateway.records("routed")
            healths = [r["healths"]["r0"] for r in routed]
            # From r0's first live record on: at start-up the first request may be routed before
            # the gateway has read r0's status once (out until then), which is not the kill.
            first_out = healths.index("out", healths.index("live"))
            # Scored by load alone first (the ledger's status goes quiet: stale before out).
            if victim == "ledger":
                assert "stale" in healths[healths.index("live") : first_out]
            # Out: no request went to r0 until it was live again.
            for record in routed:
                if record["healths"]["r0"] == "out":
                    assert record["replica"] == "r1"
            back = [i for i, r in enumerate(routed) if i > first_out and r["replica"] == "r0"]
            assert back and routed[back[0]]["healths"]["r0"] == "live"
            assert out_at - killed_at < 25

            # Every block free on both replicas once the last requests finished.
            def drained() -> bool:
                states = [_status(client, name) for name in ("r0", "r1")]
                return all(
                    s is not None and s.num_running == 0 and s.num_waiting == 0
                    and (s.metrics or {}).get("kv_cache_usage", 1.0) == 0.0
                    for s in states
                )  # fmt: skip

            _wait_for(drained, 30, "blocks still held at the end")
        finally:
            stop.set()
            gateway.stop()
            for proc in procs.values():
                proc.stop()
            client.close()


def _complete_ok(url: str) -> bool:
    try:
        return _complete(url, -1).status == 200
    except OSError:
        return False


def _last_health(gateway: ServiceProcess) -> str | None:
    routed = gateway.records("routed")
    return routed[-1]["healths"]["r0"] if routed else None


def _wait_for(condition, timeout: float, why) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, why() if callable(why) else why
        time.sleep(0.2)
