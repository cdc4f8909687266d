"""Many requests at once: up to max_queue in flight are served (429 only past it), with a
bounded Redis pool whose callers wait for a connection instead of failing, status reads shared
by a burst, and /health answering while the gateway refuses one."""

from __future__ import annotations

import asyncio
import math
import time

import aiohttp

from gateway.app import redis_pool_size
from gateway.state import GATEWAY, PROBE_MAX_AGE_S, SETUP_CONCURRENCY
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


async def test_a_burst_of_admitted_requests_is_set_up_a_few_at_a_time(
    start_gateway, start_ledger, redis_url
):
    """Admitted at once, set up SETUP_CONCURRENCY at a time (tokenized, checked against the
    ledger, enqueued): with Redis writes paused each setup under way waits on its XADD holding
    a pooled connection of its own, so the connections the burst adds count them. Before, all
    160 were under way at once, every step of each in the same loop turns as the others'."""
    await start_ledger(Script(delay_s=0.05))
    client = await start_gateway(max_queue=256, request_timeout_s=60.0)
    gw = client.app[GATEWAY]
    admin = redis_streams.connect(redis_url)
    await client.get("/health")  # the pool's first connections: the status read, the reader
    at_rest = len(await admin.client_list())
    await admin.execute_command("CLIENT", "PAUSE", 2000, "WRITE")
    body = {"prompt": "x", "max_tokens": 4}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> int:
            async with session.post(client.make_url("/v1/completions"), json=body) as resp:
                await resp.read()
                return resp.status

        burst = [asyncio.create_task(one()) for _ in range(CONCURRENT)]
        async with asyncio.timeout(10):
            while gw.in_flight < CONCURRENT:  # every one admitted, holding its place
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # the setups under way reach their XADD
        added = len(await admin.client_list()) - at_rest
        statuses = await asyncio.gather(*burst)
    await admin.aclose()
    assert added <= SETUP_CONCURRENCY + 2, added
    assert statuses == [200] * CONCURRENT


def test_the_pool_is_sized_from_max_queue_and_capped():
    assert redis_pool_size(1) == 33
    assert redis_pool_size(200) == 232
    assert redis_pool_size(100_000) == 256 + 32


async def _gets(client) -> int:
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_get", {}).get("calls", 0))


async def test_concurrent_status_reads_share_one_get(start_gateway, start_ledger, redis_url):
    """A burst that finds the ledger's status stale sends one GET, not one per request (each
    would take a pooled connection that /health and the requests' writes then wait for)."""
    await start_ledger()
    client = await start_gateway()
    gw = client.app[GATEWAY]
    admin = redis_streams.connect(redis_url)
    try:
        await admin.config_resetstat()
        statuses = await asyncio.gather(*(gw.ledger_status(max_age_s=0) for _ in range(200)))
        assert await _gets(admin) == 1
        assert all(status is statuses[0] and status is not None for status in statuses)
        # A caller that leaves does not cancel the read the others wait for.
        first = asyncio.ensure_future(gw.ledger_status(max_age_s=0))
        second = asyncio.ensure_future(gw.ledger_status(max_age_s=0))
        await asyncio.sleep(0)
        first.cancel()
        assert (await second) is not None
        assert first.cancelled()
        # A read after the shared one has finished is a new one.
        await gw.ledger_status(max_age_s=0)
        assert await _gets(admin) == 3
    finally:
        await admin.aclose()


async def test_probes_answer_from_a_recent_status_read(start_gateway, start_ledger, redis_url):
    """/health and /ping answer from a status read within PROBE_MAX_AGE_S, so a probe costs no
    Redis round trip (before, each sent a GET and waited for it: a probe every 50 ms during a
    burst waited for Redis and the loop turns around its reply, each a wait for the CPU)."""
    await start_ledger()
    client = await start_gateway()
    admin = redis_streams.connect(redis_url)
    try:
        await admin.config_resetstat()
        started = time.monotonic()
        for _ in range(20):
            assert (await client.get("/health")).status == 200
            assert (await client.get("/ping")).status == 200
        windows = math.ceil((time.monotonic() - started) / PROBE_MAX_AGE_S)
        assert await _gets(admin) <= windows  # one read a window at most (40 before)
    finally:
        await admin.aclose()


async def test_health_answers_while_a_saturated_gateway_refuses_a_burst(
    start_gateway, start_ledger
):
    """max_queue held by requests the ledger never answers, then a burst of requests past it
    (429s) with /health asked in the middle of it: /health still answers, with the queue full.
    The bound is generous (a loaded CI machine); the timing target is benchmarks/burst.py's.
    The holders' clients then leave, and the gateway lets go of every one of them."""
    await start_ledger(Script(silent=True))
    client = await start_gateway(max_queue=32, request_timeout_s=60.0)
    gw = client.app[GATEWAY]
    body = {"prompt": "x", "max_tokens": 8}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> int:
            async with session.post(client.make_url("/v1/completions"), json=body) as resp:
                await resp.read()
                return resp.status

        holders = [asyncio.create_task(one()) for _ in range(32)]
        while gw.in_flight < 32:
            await asyncio.sleep(0.01)
        burst = [asyncio.create_task(one()) for _ in range(400)]
        await asyncio.sleep(0)  # the burst's connections are on their way
        started = time.monotonic()
        async with asyncio.timeout(5), session.get(client.make_url("/health")) as resp:
            health = await resp.json()
        assert resp.status == 200 and health["in_flight"] == 32, health
        assert time.monotonic() - started < 5
        refused = await asyncio.gather(*burst)
        assert set(refused) == {429}
        assert gw.in_flight == 32 and not any(h.done() for h in holders)
        for holder in holders:
            holder.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
    async with asyncio.timeout(10):
        while gw.in_flight:
            await asyncio.sleep(0.05)
