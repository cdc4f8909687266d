"""External replicas in seconds (the processes, ZMQ and the bridge are in
tests/e2e/test_external_replicas.py): the gateway proxies to an OpenAI server standing in for
vLLM (a small aiohttp app) and passes its answers through as sent; a stream that breaks ends in
an error event and the server goes out; settings that cannot match the server are refused; the
bridge's check of the hash settings against a BlockStored event."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.router import routing_for
from kvledger.bridge import hash_settings_problem
from ledger.events import BlockStored
from ledger.hashing import BlockHasher, to_event_hash
from observability import get_tracer, new_registry
from services.config import GatewayConfig, parse_external_replicas
from services.environment import ConfigError
from services.tokenization.load import load_tokenizer

CHUNKS = [b'data: {"id":"cmpl-up","choices":[{"text":"a"}]}\n\n', b'data: {"x":1}\n\n']


def upstream_app(tokenizer) -> web.Application:
    """What the gateway needs of a vLLM server: /health, /tokenize and /v1/completions."""

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"tokens": tokenizer.encode(body["prompt"])})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("user") == "refuse":
            return web.json_response(
                {"error": {"message": "no", "type": "Teapot", "param": None, "code": 418}},
                status=418, headers={"X-Upstream": "refused"},
            )  # fmt: skip
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Upstream": "1"})
        await reply.prepare(request)
        for chunk in CHUNKS:
            await reply.write(chunk)
            await asyncio.sleep(0.01)
        if body.get("user") == "die":
            assert request.transport is not None
            request.transport.abort()  # gone mid-stream
            return reply
        await reply.write(b"data: [DONE]\n\n")
        return reply

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/completions", completions)
    return app


async def _wait_live(client, name: str) -> dict:
    for _ in range(100):
        replicas = (await (await client.get("/health")).json()).get("replicas", {})
        if replicas.get(name, {}).get("health") == "live":
            return replicas
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} never live: {replicas}")


async def test_the_gateway_proxies_to_an_external_server_and_passes_its_answers_through(
    start_gateway, start_ledger
):
    upstream = TestServer(upstream_app(load_tokenizer("tiny", None)))
    await upstream.start_server()
    try:
        # The bridge's status for replica ext (block size 16, sha256, a worker), as it writes it.
        await start_ledger(replica="ext", model_name="kvledger-tiny-llama", max_model_len=512)
        url = str(upstream.make_url("")).rstrip("/")
        client = await start_gateway(external_replicas=(("ext", url),), ledger_wait_s=2.0)
        await _wait_live(client, "ext")
        body = {"model": "kvledger-tiny-llama", "prompt": "hello there " * 8, "stream": True}

        reply = await client.post("/v1/completions", json=body, headers={"X-Client": "c"})
        assert reply.status == 200 and reply.headers["X-Upstream"] == "1"
        assert reply.headers["Content-Type"] == "text/event-stream"
        assert await reply.read() == b"".join(CHUNKS) + b"data: [DONE]\n\n"  # byte for byte

        reply = await client.post("/v1/completions", json=body | {"user": "refuse"})
        assert (reply.status, reply.headers["X-Upstream"]) == (418, "refused")
        assert (await reply.json())["error"]["type"] == "Teapot"

        reply = await client.post("/v1/completions", json=body | {"user": "die"})
        text = (await reply.read()).decode()
        assert text.startswith(b"".join(CHUNKS).decode()) and text.endswith("data: [DONE]\n\n")
        error = json.loads(text.split("data: ")[-2])["error"]
        assert error["code"] == 502 and "replica ext" in error["message"]
        replicas = (await (await client.get("/health")).json())["replicas"]
        assert replicas["ext"]["health"] == "out" and "broke off" in replicas["ext"]["out_reason"]
        # Its /health answers: it is back within a probe or two.
        await _wait_live(client, "ext")
    finally:
        await upstream.close()


def _config(**fields) -> GatewayConfig:
    return GatewayConfig(redis_url="redis://127.0.0.1:1/0", model="tiny", **fields)


def test_external_replicas_are_read_and_refused_when_they_cannot_be_hashed(monkeypatch):
    assert parse_external_replicas("a=http://h:1/v1, b=https://h:2/") == (
        ("a", "http://h:1"),
        ("b", "https://h:2"),
    )
    for bad, named in (("a", "NAME=URL"), ("a=ftp://x", "NAME=URL"), ("a=http://x a=http://y", "twice")):  # fmt: skip
        with pytest.raises(ValueError, match=named):
            parse_external_replicas(bad)

    def routing(**fields):
        return routing_for(
            _config(**fields), None, "gw", new_registry(), get_tracer("t"), lambda _: None,  # type: ignore[arg-type]
            tokenizer=load_tokenizer("tiny", None),
        )  # fmt: skip

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ConfigError, match="needs PYTHONHASHSEED"):
        routing(external_replicas=(("v", "http://h:1"),), hash_algo="xxhash")
    with pytest.raises(ConfigError, match="both a kvledger replica and an external one"):
        routing(external_replicas=(("r0", "http://h:1"),), replicas="r0,r1")
    ext = routing(external_replicas=(("v", "http://h:1"),))
    assert ext.names == ["v"] and ext.upstreams is not None  # no kvledger replica unless named


def test_the_bridge_finds_hash_settings_that_are_not_the_servers():
    tokens = list(range(100, 148))  # three blocks of 16
    sha = BlockHasher("sha256", seed="vllm-none-hash")
    stored = BlockStored(
        [to_event_hash(h) for h in sha.hash_blocks(tokens, 16)], None, tokens, 16, None, "GPU", None
    )
    assert hash_settings_problem(stored, sha, 16) is None
    assert "gives" in (hash_settings_problem(stored, BlockHasher("sha256_cbor"), 16) or "")
    assert "not 32" in (hash_settings_problem(stored, sha, 32) or "")
    other_seed = BlockHasher("sha256", seed="42")
    assert "block 0" in (hash_settings_problem(stored, other_seed, 16) or "")
