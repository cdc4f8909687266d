"""The real gateway in front of a `Stack` (real ledger and worker services, real redis-server),
on a real loopback port: what an HTTP client (curl, the `openai` package) sees of kvledger."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp.test_utils import TestClient, TestServer

from gateway import create_app
from services.config import GatewayConfig
from tests.harness.stack import Stack


@contextlib.asynccontextmanager
async def gateway_on(stack: Stack, **settings) -> AsyncIterator[TestClient]:
    config = GatewayConfig(
        redis_url=stack.url,
        stream_prefix=stack.prefix,
        gateway_id="gw-stack",
        request_timeout_s=60.0,
        **{"model": "tiny", **settings},
    )
    client = TestClient(TestServer(create_app(config)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()
