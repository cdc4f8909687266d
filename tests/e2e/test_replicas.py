"""Issue 13 end to end: `kvledger up --replicas 2` starts two ledger+worker replicas, each with
its own KV cache, and one gateway routing across them by their KV events (precise, the default).
A repeated long prefix lands on the replica that holds it, so it hits that replica's cache; the
gateway's metrics count where it sent each request."""

from __future__ import annotations

import json
import re
import urllib.request

from services.tokenization.tokenizer import ByteTokenizer
from services.transport.redis_server import free_port
from tests.e2e.conftest import launch, serving


def _complete(url: str, prompt: str) -> dict:
    body = {"model": "kvledger-tiny-llama", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.status == 200
        return json.loads(reply.read())


def _samples(metrics_text: str, name: str) -> dict[str, float]:
    """{replica: value} of one labelled counter on the gateway's /metrics."""
    pattern = re.compile(rf'^{re.escape(name)}\{{policy="(\w+)",replica="(\w+)"\}} (\S+)$', re.M)
    return {replica: float(value) for policy, replica, value in pattern.findall(metrics_text)}


def test_a_repeated_prefix_lands_on_the_replica_that_holds_it():
    prompts = {
        "a": "Replica routing sends a prompt where its prefix already sits in the KV cache. " * 2,
        "b": "A second tenant has another long system prompt that no replica has seen yet!! " * 2,
    }
    metrics_port = free_port()  # replica i serves its metrics on metrics_port + i
    stack = launch(
        "tiny",
        num_gpu_blocks=40,
        max_model_len=256,
        extra_args=("--replicas", "2", "--metrics-port", str(metrics_port)),
    )
    with serving(stack) as (served,):
        for port in (metrics_port, metrics_port + 1):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
                assert b"kvledger" in reply.read()
        replies = [(name, _complete(served.url, prompts[name])) for name in "aabb"]
        with urllib.request.urlopen(f"{served.url}/metrics", timeout=10) as reply:
            metrics = reply.read().decode()
        records = served.log_records("routing_started")
    tokenizer = ByteTokenizer()
    for index, (name, reply) in enumerate(replies):
        num_prompt = len(tokenizer.encode(prompts[name]))
        assert reply["choices"][0]["finish_reason"] == "length"
        assert reply["usage"]["prompt_tokens"] == num_prompt
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        # First sight: no replica holds it. Again (round robin would send it to the other
        # replica): every full block before the last token.
        expected = 0 if index % 2 == 0 else (num_prompt - 1) // 16 * 16
        assert cached == expected, (index, name, cached)
    assert records and records[0]["replicas"] == ["r0", "r1"]
    assert records[0]["policy"] == "precise"
    routed = _samples(metrics, "kvledger:routed_requests_total")
    assert sum(routed.values()) == 4 and set(routed) <= {"r0", "r1"}
    hits = _samples(metrics, "kvledger:routed_prefix_hit_tokens_total")
    assert sum(hits.values()) >= 2 * 16  # the router expected the repeats' hits
    # Every request ended, so the router holds none as pending on its replica any more.
    assert re.search(r"^kvledger:routing_pending_requests 0\.0$", metrics, re.M)
