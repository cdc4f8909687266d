"""The ledger's /health is readiness: 503 while it has no worker to compute on."""

from __future__ import annotations

import asyncio
import time

from aiohttp.test_utils import TestClient, TestServer

from engine.http import metrics_app
from tests.harness.stack import Stack


async def test_ledger_health_is_not_ready_once_every_worker_is_lost(redis_url, tiny_model):
    stack = await Stack(redis_url, tiny_model, num_blocks=64).start()
    client = TestClient(TestServer(metrics_app(stack.ledger_process)))
    await client.start_server()
    try:
        resp = await client.get("/health")
        assert resp.status == 200
        assert list((await resp.json())["workers"]) == ["w0"]
        await stack.kill_worker("w0")
        deadline = time.monotonic() + 30
        while (resp := await client.get("/health")).status == 200:
            assert time.monotonic() < deadline, "the ledger never noticed its worker was gone"
            await asyncio.sleep(0.2)
        assert resp.status == 503
        body = await resp.json()
        assert body["status"] == "no_workers" and body["workers"] == {}
    finally:
        await client.close()
        await stack.stop()
