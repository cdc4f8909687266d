"""The clients kvledger builds (services/transport/redis_client.py) against a Redis that is
killed (kill -9) and restarted empty on the same port: once it answers, no command fails for a
pooled connection that died with the old server; each is found dead and replaced before a
command is sent on it.

redis-py 8 skips that check while its maintenance notifications are on, and they are on by
default ("auto"); a pool of connections that died with the old Redis then handed them out one
by one, each failing its command with "Connection closed by server" (48, 24, 12 of three bursts
of 96 on the gateway's pool).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.transport import redis_client, redis_streams
from services.transport.redis_server import RedisServer

BURST = 96


@pytest.fixture
def server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


def _kill9_and_restart_empty(server: RedisServer) -> None:
    assert server.process is not None
    server.process.kill()  # SIGKILL: every connection dies with it
    server.process.wait()
    port = server.port
    server.stop()  # its temporary directory: the new one starts empty
    server.port = port
    server.start()


@pytest.mark.parametrize("kind", ["pooled", "plain"])
async def test_async_clients_serve_every_command_once_a_restarted_redis_answers(server, kind):
    client = (
        redis_streams.connect_pooled(server.url, BURST * 2, 30.0)
        if kind == "pooled"
        else redis_client.connect(server.url)
    )
    try:
        # A burst opens about one connection per concurrent command.
        await asyncio.gather(*(client.xadd("s", {b"m": b"x"}) for _ in range(BURST)))
        _kill9_and_restart_empty(server)
        # "Once it answers": a service sees that through its event loop, which has by then
        # read the old connections' end (their EOF came before the new server started).
        await asyncio.sleep(0.1)
        failures = []
        for _ in range(3):
            results = await asyncio.gather(
                *(client.xadd("s", {b"m": b"x"}) for _ in range(BURST)), return_exceptions=True
            )
            failures.append([repr(r) for r in results if isinstance(r, BaseException)])
        assert [len(f) for f in failures] == [0, 0, 0], failures[0][:3]
        assert await client.xlen("s") == 3 * BURST  # each command ran once: none retried twice
    finally:
        await client.aclose()


def test_the_blocking_client_serves_every_command_once_a_restarted_redis_answers(server):
    client = redis_client.connect_sync(server.url)
    try:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda _: client.xadd("s", {b"m": b"x"}), range(64)))
            _kill9_and_restart_empty(server)
            failures = []
            for _ in range(3):
                jobs = [pool.submit(client.xadd, "s", {b"m": b"x"}) for _ in range(64)]
                failures.append([repr(j.exception()) for j in jobs if j.exception()])
        assert [len(f) for f in failures] == [0, 0, 0], failures[0][:3]
        assert client.xlen("s") == 3 * 64
    finally:
        client.close()
