"""Slow and numerous clients against the gateway as `kvledger gateway` serves it (its runner and
its capped listening socket): partial headers are cut off after the header timeout, a trickled
body gets a 408, connections past the cap get a clean 503, and a flood costs a few log lines."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from gateway.app import listen, make_runner
from observability.logging import configure_logging
from services.http_server import CappedSite, raise_open_file_limit
from tests.gateway.helpers import assert_error

CAP = 64
SLOW_CLIENTS = 300
HEADER_TIMEOUT_S = 3.0
PARTIAL_HEADERS = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: appl"


@pytest.fixture
def log_stream() -> io.StringIO:
    stream = io.StringIO()
    configure_logging("kvledger-gateway", level="info", fmt="json", stream=stream)
    return stream


@pytest.fixture
async def capped_gateway(make_config, start_ledger) -> AsyncIterator[CappedSite]:
    raise_open_file_limit()  # clients and server share this process: two descriptors each
    await start_ledger()
    config = make_config(
        port=0, max_connections=CAP, header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=1.0
    )
    runner = make_runner(config)
    await runner.setup()
    site = await listen(runner, config)
    yield site
    await runner.cleanup()


async def _slow_client(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(PARTIAL_HEADERS)
    await writer.drain()
    return reader, writer


async def _read_until_closed(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout_s)


async def _complete(port: int) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2}
        ) as resp,
    ):
        return resp.status, await resp.json()


async def _wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_slow_header_flood_is_capped_cut_off_and_logged_briefly(capped_gateway, log_stream):
    site = capped_gateway
    assert site.cap is not None
    # Opening 300 connections in this one process takes about a second on a busy machine:
    # the header timeout is longer, so none of the held ones is cut off before the last arrives.
    clients = await asyncio.gather(*(_slow_client(site.port) for _ in range(SLOW_CLIENTS)))
    await _wait_for(lambda: site.cap.accepted + site.cap.refused == SLOW_CLIENTS, 5.0)
    assert site.cap.open == CAP
    assert site.cap.refused == SLOW_CLIENTS - CAP

    # While the cap is full, a real request is refused cleanly: a JSON 503, not a hang.
    status, body = await _complete(site.port)
    assert status == 503
    assert_error(body, None, "connection cap")

    # Each connection ends: the refused ones with the 503 at once, the held ones at the header
    # timeout with nothing written (no request was ever parsed).
    started = time.monotonic()
    answers = await asyncio.gather(
        *(_read_until_closed(reader, HEADER_TIMEOUT_S + 5.0) for reader, _ in clients)
    )
    elapsed = time.monotonic() - started
    refused = [a for a in answers if a.startswith(b"HTTP/1.1 503 ")]
    cut_off = [a for a in answers if a == b""]
    assert len(refused) == SLOW_CLIENTS - CAP and len(cut_off) == CAP
    assert elapsed < HEADER_TIMEOUT_S + 3.0
    for _, writer in clients:
        writer.close()
    await _wait_for(lambda: site.cap.open == 0, 3.0)

    # With the slow clients gone, requests are served again.
    status, body = await _complete(site.port)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"

    # 237 refusals in a burst: one line, the rest counted (interval 10 s).
    records = [json.loads(line) for line in log_stream.getvalue().splitlines() if line]
    refusals = [r for r in records if r["event"] == "connection_refused"]
    assert len(refusals) == 1
    assert len(records) < 20, [r["event"] for r in records]


async def test_headers_trickled_a_byte_at_a_time_are_cut_off_at_the_deadline(capped_gateway):
    site = capped_gateway
    reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
    started = time.monotonic()
    closed_at: list[float] = []

    async def until_closed() -> bytes:
        data = await reader.read()
        closed_at.append(time.monotonic() - started)
        return data

    closing = asyncio.ensure_future(until_closed())
    # The deadline runs from the connection's start: a byte every 50 ms does not extend it.
    for byte in PARTIAL_HEADERS * 4:
        if closing.done() or time.monotonic() - started > HEADER_TIMEOUT_S + 3.0:
            break
        writer.write(bytes([byte]))
        await asyncio.sleep(0.05)
    assert await asyncio.wait_for(closing, 1.0) == b""
    assert HEADER_TIMEOUT_S - 0.1 < closed_at[0] < HEADER_TIMEOUT_S + 1.5
    writer.close()


async def test_a_trickled_body_gets_408_after_the_body_timeout(capped_gateway):
    site = capped_gateway
    reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
    body = b'{"prompt": "hi", "max_tokens": 2}'
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:5]
    )
    await writer.drain()
    started = time.monotonic()
    answer = await _read_until_closed(reader, 5.0)
    assert 0.9 < time.monotonic() - started < 4.0
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert_error(json.loads(payload), None, "did not arrive within 1s")
    writer.close()


@pytest.mark.parametrize(
    ("path", "body"),
    [("/tokenize", b'{"prompt": "hello there"}'), ("/detokenize", b'{"tokens": [104, 105]}')],
)
async def test_a_trickled_tokenize_body_gets_408_after_the_body_timeout(capped_gateway, path, body):
    # /tokenize and /detokenize read a body like generation does: the same deadline, or a client
    # trickling bytes would hold a connection (and at the cap, every slot) for ever.
    site = capped_gateway
    reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n".encode()
        + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:5]
    )  # fmt: skip
    await writer.drain()
    started = time.monotonic()
    answer = await _read_until_closed(reader, 6.0)
    assert 0.9 < time.monotonic() - started < 4.0
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), head
    assert_error(json.loads(payload), None, "did not arrive within 1s")
    writer.close()

    # The whole body in time: served as before.
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{site.port}{path}", data=body) as resp,
    ):
        assert resp.status == 200, await resp.text()
