"""docker-compose.yml with its CPU override, run for real under podman (issue 24): every image
built here without a registry (docker/local/build.sh), every service on the host network.

Redis, the two replicas (ledger + worker each), both gateways, the indexer and Prometheus come
up healthy; the gateway answers a completion of the seeded tiny Llama and a repeat of it hits
the prefix cache; the KV events are read from the host with `kvledger events`; the indexer
scores the prompt where it sits; spans of every service reach an OTLP receiver on the host;
a worker container killed (SIGKILL to its init, as a crash or the OOM killer would) is
restarted by its restart policy and the stack serves again.

    python -m pytest tests/compose -m compose      (root, podman, runc, mmdebstrap, podman-compose)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.compose.stack import ROOT, Stack, build_images, missing_tools
from tests.otlp_receiver import OtlpReceiver

pytestmark = [pytest.mark.compose, pytest.mark.timeout(1800)]

SERVICES_WITH_HEALTH = [
    "redis",
    "jaeger",
    "ledger-r0",
    "ledger-r1",
    "gateway",
    "gateway-2",
    "indexer",
]
# Two replicas' worth of block-aligned prompt: the tiny model's byte tokenizer, 16-token blocks.
PROMPT = "The compose stack serves this prompt twice, and the second time it hits the cache. " * 2
BLOCK_SIZE = 16


def _post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        assert reply.status == 200
        return json.loads(reply.read())


def _get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.read().decode()


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as found:
        yield found


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[Stack]:
    missing = missing_tools()
    if missing:
        pytest.skip(f"the compose stack needs {', '.join(missing)}")
    started = time.monotonic()
    build_images(sys.executable)
    print(f"\n[compose] images built in {time.monotonic() - started:.0f} s")
    port = urlsplit(receiver.endpoint).port
    assert port is not None
    running = Stack(tmp_path_factory.mktemp("compose"), port)
    try:
        started = time.monotonic()
        running.up()
        running.wait_healthy(SERVICES_WITH_HEALTH, timeout_s=300)
        print(f"[compose] stack healthy in {time.monotonic() - started:.0f} s")
        yield running
    finally:
        running.down()


@pytest.fixture(scope="module")
def model(stack: Stack) -> str:
    models = json.loads(_get(f"http://127.0.0.1:{stack.ports.gateway}/v1/models"))
    return models["data"][0]["id"]


def _complete(stack: Stack, model: str, port: int | None = None) -> dict[str, Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    return _post(f"http://127.0.0.1:{port or stack.ports.gateway}/v1/completions", body)


def test_every_service_runs_from_the_local_images(stack: Stack) -> None:
    containers = stack.containers()
    assert set(containers) == {
        "redis",
        "jaeger",
        "ledger-r0",
        "ledger-r1",
        "worker-r0",
        "worker-r1",
        "gateway",
        "gateway-2",
        "indexer",
        "prometheus",
    }
    for service in containers:
        state = stack.inspect(service)
        assert state["State"]["Status"] == "running", (service, state["State"])
        assert state["HostConfig"]["NetworkMode"] == "host"


def test_a_completion_is_served_and_its_repeat_hits_the_prefix_cache(
    stack: Stack, model: str
) -> None:
    assert model == "kvledger-tiny-llama"  # the CPU override's model, named by the test
    first = _complete(stack, model)
    again = _complete(stack, model, stack.ports.gateway_2)  # the second gateway routes as one
    num_prompt = first["usage"]["prompt_tokens"]
    assert num_prompt > 4 * BLOCK_SIZE
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["completion_tokens"] == 4
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Every full block before the last token, found where the first request left it.
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert again["choices"][0]["text"] == first["choices"][0]["text"]  # greedy, same prompt


def _tail_events(stack: Stack, replica: str, timeout_s: float = 30) -> list[str]:
    """`kvledger events` on the host, from the start of one replica's stream, until a
    BlockStored line (or the timeout): the lines it printed."""
    command = [
        sys.executable,
        "-m",
        "kvledger",
        "events",
        "--redis-url",
        f"redis://127.0.0.1:{stack.ports.redis}/0",
        "--stream-prefix",
        "kvl",
        "--replica",
        replica,
        "--from",
        "start",
    ]
    lines: list[str] = []
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    ) as tail:
        assert tail.stdout is not None
        timer = threading.Timer(timeout_s, tail.kill)
        timer.start()
        try:
            for line in tail.stdout:
                lines.append(line.rstrip())
                if "BlockStored" in line:
                    break
        finally:
            timer.cancel()
            tail.kill()
    return lines


def test_kv_events_are_read_from_the_host(stack: Stack, model: str) -> None:
    _complete(stack, model)
    printed = {replica: _tail_events(stack, replica) for replica in ("r0", "r1")}
    stored = [
        re.search(r"BlockStored\s+(\d+) block\(s\) of (\d+)", line)
        for lines in printed.values()
        for line in lines
    ]
    found = [(int(m.group(1)), int(m.group(2))) for m in stored if m]
    assert found, printed
    assert all(size == BLOCK_SIZE and count >= 1 for count, size in found), printed


def test_the_indexer_scores_the_prompt_where_it_sits(stack: Stack, model: str) -> None:
    _complete(stack, model)
    scores = _post(f"http://127.0.0.1:{stack.ports.indexer}/score", {"prompt": PROMPT})
    assert set(scores["replicas"]) == {"r0", "r1"}
    best = scores["best"]
    assert best in ("r0", "r1")
    assert scores["replicas"][best]["cached_tokens"] >= 4 * BLOCK_SIZE


def test_spans_of_every_service_reach_the_host_receiver(
    stack: Stack, model: str, receiver: OtlpReceiver
) -> None:
    _complete(stack, model)
    for service in ("kvledger-gateway", "kvledger-ledger", "kvledger-worker"):

        def of_service(span: dict[str, Any], name: str = service) -> bool:
            return span["service_name"] == name

        assert receiver.wait_for_spans(1, timeout=60, where=of_service), service


def test_prometheus_scrapes_the_gateways_and_ledgers(stack: Stack) -> None:
    deadline = time.monotonic() + 60
    while True:
        targets = json.loads(_get(f"http://127.0.0.1:{stack.ports.prometheus}/api/v1/targets"))[
            "data"
        ]["activeTargets"]
        health = {t["labels"]["instance"]: t["health"] for t in targets}
        if len(health) == 4 and set(health.values()) == {"up"}:
            break
        assert time.monotonic() < deadline, health
        time.sleep(2)


def test_a_killed_worker_container_is_replaced_and_the_stack_serves_again(
    stack: Stack, model: str
) -> None:
    routed_before = _routed(stack)
    before = stack.inspect("worker-r0")
    # The container's init (catatonit, `init: true`) killed from the host: the container dies
    # as in a crash, and podman's restart policy (unless-stopped) starts it again. (`podman
    # kill` counts as a stop by the user in podman 4.3: no policy restarts it.)
    os.kill(before["State"]["Pid"], signal.SIGKILL)
    killed = time.monotonic()
    deadline = killed + 120
    while True:
        after = stack.inspect("worker-r0")
        if after["RestartCount"] > before["RestartCount"] and after["State"]["Running"]:
            break
        assert time.monotonic() < deadline, after["State"]
        time.sleep(1)
    assert after["State"]["Pid"] != before["State"]["Pid"]
    restarted = time.monotonic() - killed
    # Served again: both replicas through the gateway (the prompts differ, so the router
    # sends them by load), within the restarted worker's time to come back.
    # Served again, by the restarted replica too: distinct prompts until r0 has taken some
    # (the router spreads them by load), within the restarted worker's time to come back.
    replies: list[dict[str, Any]] = []
    deadline = time.monotonic() + 180
    index = 0
    while len(replies) < 6 or _routed(stack).get("r0", 0) <= routed_before.get("r0", 0):
        body = {
            "model": model,
            "prompt": f"after the kill {index}: " + "x" * 40,
            "max_tokens": 4,
            "temperature": 0,
        }
        index += 1
        try:
            replies.append(_post(f"http://127.0.0.1:{stack.ports.gateway}/v1/completions", body))
        except (urllib.error.HTTPError, urllib.error.URLError, TimeoutError):
            time.sleep(2)
        assert time.monotonic() < deadline, (len(replies), _routed(stack), stack.logs())
    served = time.monotonic() - killed
    print(
        f"\n[compose] worker-r0 restarted {restarted:.1f} s after the kill; "
        f"{len(replies)} completions served {served:.1f} s after it "
        f"(routed before/after: {routed_before} / {_routed(stack)})"
    )
    assert all(r["usage"]["completion_tokens"] == 4 for r in replies)


def _routed(stack: Stack) -> dict[str, float]:
    """{replica: requests the gateway sent there} from its /metrics."""
    metrics = _get(f"http://127.0.0.1:{stack.ports.gateway}/metrics")
    found = re.findall(
        r'^kvledger:routed_requests_total\{[^}]*replica="(\w+)"\} (\S+)$', metrics, re.M
    )
    return {replica: float(value) for replica, value in found}
