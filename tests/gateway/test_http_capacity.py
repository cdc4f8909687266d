"""Many requests at once: up to max_queue in flight are served (429 only past it), with a
bounded Redis pool whose callers wait for a connection instead of failing."""

from __future__ import annotations

import asyncio

import aiohttp

from gateway.app import redis_pool_size
from services.transport import redis_streams
from tests.gateway.fake_ledger import TEXT, Script

CONCURRENT = 160  # above redis-py's default cap of 100 connections


async def test_more_requests_than_redis_pools_default_cap_are_all_served(
    start_gateway, start_ledger, redis_url
):
    await start_ledger(Script(delay_s=0.05))
    client = await start_gateway(max_queue=256, request_timeout_s=60.0)
    admin = redis_streams.connect(redis_url)
    # Writes pause: every request's XADD waits in Redis holding a connection, so all of them
    # need one at the same moment (redis-py's default pool refused the 101st: a 503).
    await admin.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
    body = {"prompt": "x", "max_tokens": 4}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> tuple[int, dict]:
            async with session.post(client.make_url("/v1/completions"), json=body) as resp:
                return resp.status, await resp.json()

        replies = await asyncio.gather(*(one() for _ in range(CONCURRENT)))
    clients = await admin.client_list()
    await admin.aclose()
    statuses = [status for status, _ in replies]
    assert statuses == [200] * CONCURRENT, sorted(set(statuses))
    assert {reply["choices"][0]["text"] for _, reply in replies} == {TEXT[:4]}
    # The gateway's pool stays within its bound (plus the fake ledger's and this test's).
    assert len(clients) <= redis_pool_size(256) + 8


def test_the_pool_is_sized_from_max_queue_and_capped():
    assert redis_pool_size(1) == 33
    assert redis_pool_size(200) == 232
    assert redis_pool_size(100_000) == 256 + 32
