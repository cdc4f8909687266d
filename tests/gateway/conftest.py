"""Fixtures of the gateway tests: one real redis-server per session (a fresh key prefix per
test keeps them apart), the gateway behind aiohttp's test server, and the fake ledger."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway import create_app
from services.config import GatewayConfig
from services.transport import redis_streams
from services.transport.redis_server import RedisServer
from tests.gateway.fake_ledger import FakeLedger, Script
from tests.gateway.helpers import GATEWAY_ID


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with RedisServer() as server:
        yield server.url


@pytest.fixture(autouse=True)
def no_api_key(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("KVLEDGER_API_KEY", raising=False)
    return monkeypatch


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def make_config(redis_url: str, prefix: str):
    def make(**overrides: Any) -> GatewayConfig:
        settings: dict[str, Any] = {
            "redis_url": redis_url,
            "model": "tiny",
            "stream_prefix": prefix,
            "gateway_id": GATEWAY_ID,
            "ledger_wait_s": 0.3,
            "request_timeout_s": 5.0,
        }
        return GatewayConfig(**(settings | overrides))

    return make


@pytest.fixture
async def redis(redis_url: str):
    client = redis_streams.connect(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def start_gateway(make_config) -> AsyncIterator:
    """`client = await start_gateway(max_queue=1)`: a gateway on a real loopback port."""
    clients: list[TestClient] = []

    async def start(config: GatewayConfig | None = None, **overrides: Any) -> TestClient:
        app = create_app(config or make_config(**overrides))
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


@pytest.fixture
async def start_ledger(redis_url: str, prefix: str) -> AsyncIterator:
    """`ledger = await start_ledger(Script(...), max_model_len=...)`: the fake ledger, running."""
    ledgers: list[FakeLedger] = []

    async def start(script: Script | None = None, **fields: Any) -> FakeLedger:
        ledger = FakeLedger(redis_url, prefix, script or Script(), **fields)
        await ledger.__aenter__()
        ledgers.append(ledger)
        return ledger

    yield start
    for ledger in ledgers:
        await ledger.__aexit__(None, None, None)
