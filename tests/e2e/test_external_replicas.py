"""Issue 26's routing for vLLM servers, end to end as separate processes on one redis-server.

The routing gateway (`--replicas r0 --external-replica ext=URL`) routes between r0, a kvledger
replica (a ledger and a worker), and `ext`, another server it only knows by URL: here a second
kvledger stack standing in for a vLLM server (its own ledger, worker and gateway under another
key prefix), whose ledger publishes its KV events over ZMQ as vLLM does (--kv-events-config) and
`kvledger bridge` writes them to replica ext's keys. A repeated prompt lands where its prefix is
cached, on either; a stream from ext passes through as its gateway wrote it, and so does its
401 with its header; killed mid-stream, ext's stream ends in an error event, ext goes out, and
r0 serves what follows."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from services.transport.redis_server import RedisServer, free_port
from tests.e2e.conftest import _hermetic_env, _http_status
from tests.harness.processes import ServiceProcess

UPSTREAM_KEY = "upstream-secret"


def _post(url: str, body: dict, key: str | None = UPSTREAM_KEY) -> tuple[int, dict, bytes]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _complete(url: str, prompt: str, **extra) -> tuple[int, dict, bytes]:
    body = {"model": "kvledger-tiny-llama", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    return _post(url, body | extra)


def _wait_for(condition, timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, why
        time.sleep(0.1)


def _replicas(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
        return json.loads(reply.read())["replicas"]


def _ok(url: str) -> bool:
    return _http_status(f"{url}/health") == 200


@pytest.mark.slow  # two workers load torch and the tiny model: ~20-30 s on two cores
def test_routing_between_a_kvledger_replica_and_an_external_server():
    with RedisServer() as server:
        base = {
            **_hermetic_env(), "KVLEDGER_REDIS_URL": server.url, "KVLEDGER_DEVICE": "cpu",
            "KVLEDGER_NUM_GPU_BLOCKS_OVERRIDE": "64", "KVLEDGER_MAX_MODEL_LEN": "512",
            "OMP_NUM_THREADS": "1", "KVLEDGER_MODEL": "tiny", "KVLEDGER_LOG_LEVEL": "debug",
        }  # fmt: skip
        pub, replay, up_port, port = free_port(), free_port(), free_port(), free_port()
        # Bound with '*' (vLLM binds a wildcard address and connects to any other), dialled by
        # the bridge at the host.
        kv_events = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://*:{pub}",
            "replay_endpoint": f"tcp://*:{replay}",
        }
        # The stand-in for a vLLM server: its own keys, its events over ZMQ, a key on /v1.
        upstream_env = {**base, "KVLEDGER_STREAM_PREFIX": "up", "KVLEDGER_REPLICA": "default"}
        routed_env = {**base, "KVLEDGER_STREAM_PREFIX": "route"}
        procs = {
            "up-ledger": ServiceProcess(
                "ledger",
                {
                    **upstream_env,
                    "KVLEDGER_KV_EVENTS_CONFIG": json.dumps(kv_events),
                    "KVLEDGER_METRICS_PORT": "0",
                },
            ),
            "up-worker": ServiceProcess("worker", upstream_env),
            "up-gateway": ServiceProcess(
                "gateway",
                {**upstream_env, "KVLEDGER_PORT": str(up_port), "KVLEDGER_API_KEY": UPSTREAM_KEY},
            ),
            "bridge": ServiceProcess(
                "bridge",
                {
                    **routed_env,
                    "KVLEDGER_REPLICA": "ext",
                    "KVLEDGER_BRIDGE_ENDPOINT": f"tcp://127.0.0.1:{pub}",
                    "KVLEDGER_BRIDGE_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}",
                    "KVLEDGER_MODEL_NAME": "kvledger-tiny-llama",
                },
            ),
            "r0-ledger": ServiceProcess(
                "ledger", {**routed_env, "KVLEDGER_REPLICA": "r0", "KVLEDGER_METRICS_PORT": "0"}
            ),
            "r0-worker": ServiceProcess("worker", {**routed_env, "KVLEDGER_REPLICA": "r0"}),
            "gateway": ServiceProcess(
                "gateway",
                {
                    **routed_env,
                    "KVLEDGER_PORT": str(port),
                    "KVLEDGER_REPLICAS": "r0",
                    "KVLEDGER_EXTERNAL_REPLICAS": f"ext=http://127.0.0.1:{up_port}",
                },
            ),
        }
        url, upstream = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{up_port}"
        gateway = procs["gateway"]
        try:
            for proc in procs.values():
                proc.start()
            _wait_for(lambda: _ok(upstream) and _ok(url), 120, "the stacks never got ready")
            # The gateway probes ext's /health once a second: it may have found it not ready.
            _wait_for(lambda: _replicas(url)["ext"]["health"] == "live", 10, "ext never live")

            def routed(prompt: str) -> dict:
                """Send `prompt` (200 expected) and return the gateway's routing record of it."""
                before = len(gateway.records("routed"))
                status, _, body = _complete(url, prompt)
                assert status == 200, body
                return gateway.records("routed")[before]

            # New prefixes until each replica holds one (where a new one goes is the policy's
            # choice between equals); then each, repeated, lands where it is cached.
            first: dict[str, str] = {}
            for index in range(8):
                prompt = f"Tenant {index} has a long system prompt that nobody has seen yet. " * 2
                first[prompt] = routed(prompt)["replica"]
                if set(first.values()) == {"ext", "r0"}:
                    break
            assert set(first.values()) == {"ext", "r0"}, gateway.records("replica_out")
            held = {replica: prompt for prompt, replica in first.items()}
            time.sleep(1.0)  # the events: ZMQ -> bridge -> Redis -> the gateway's follower
            for replica, prompt in held.items():
                again = routed(prompt)
                assert again["replica"] == replica, (replica, again)
                assert again["cached_tokens"] >= 16, (again, procs["bridge"].output())  # a hit
            on_ext = held["ext"]

            # The upstream's own refusal passes through: its status, body and header.
            before = len(gateway.records("routed"))
            status, headers, body = _post(
                url, {"model": "kvledger-tiny-llama", "prompt": on_ext, "max_tokens": 4}, key=None
            )
            assert gateway.records("routed")[before]["replica"] == "ext"
            assert status == 401 and headers.get("WWW-Authenticate") == "Bearer", body
            assert "missing or wrong API key" in json.loads(body)["error"]["message"]

            # A stream from ext comes through as its gateway wrote it.
            status, headers, body = _complete(url, on_ext, stream=True)
            assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
            events = [line for line in body.decode().split("\n\n") if line]
            assert events[-1] == "data: [DONE]" and len(events) >= 3
            chunk = json.loads(events[0].removeprefix("data: "))
            assert chunk["object"] == "text_completion" and chunk["id"].startswith("cmpl-")

            # ext dies mid-stream: its stream ends in an error event, and it is out.
            body_json = {
                "model": "kvledger-tiny-llama", "prompt": on_ext, "max_tokens": 300,
                "ignore_eos": True, "stream": True,
            }  # fmt: skip
            request = urllib.request.Request(
                f"{url}/v1/completions", data=json.dumps(body_json).encode(),
                headers={"Content-Type": "application/json",
                         "Authorization": f"Bearer {UPSTREAM_KEY}"},
            )  # fmt: skip
            with urllib.request.urlopen(request, timeout=60) as reply:
                assert reply.readline().startswith(b"data: ")
                procs["up-gateway"].kill9()
                rest = reply.read().decode()
            error = json.loads(rest.split("data: ")[-2].strip())["error"]
            assert rest.endswith("data: [DONE]\n\n")
            assert error["code"] == 502 and "replica ext" in error["message"], rest[-500:]

            # What follows goes to r0, even the prompt ext held; the gateway says why.
            again = routed(on_ext)
            assert again["replica"] == "r0" and again["healths"]["ext"] == "out", again
            assert any(r["replica"] == "ext" for r in gateway.records("upstream_out"))
            assert _ok(url)
        finally:
            for proc in reversed(procs.values()):
                proc.stop()
