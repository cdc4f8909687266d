"""Requests that cannot progress fail within --stall-timeout instead of hanging for the whole
request timeout: the ledger is gone (its status key expired or was removed) or has no worker.
Readiness (/health) says so too."""

from __future__ import annotations

import asyncio
import time

from gateway.state import PROBE_MAX_AGE_S
from tests.gateway.fake_ledger import Script
from tests.gateway.helpers import assert_error, read_sse

STALL_S = 1.0
TIMEOUT_S = 60.0  # the request timeout: far beyond what any of these may take


async def test_a_request_fails_within_the_bound_when_the_ledger_dies(start_gateway, start_ledger):
    ledger = await start_ledger(Script(silent=True))
    client = await start_gateway(stall_timeout_s=STALL_S, request_timeout_s=TIMEOUT_S)
    pending = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "x"}))
    await ledger.wait_for_requests(1)
    await ledger.__aexit__(None, None, None)  # gone: its status key goes with it
    killed = time.monotonic()
    resp = await pending
    waited = time.monotonic() - killed
    assert resp.status == 503
    body = await resp.json()
    assert_error(body, None, "no ledger has been running for")
    assert "--stall-timeout 1s" in body["error"]["message"]
    assert body["error"]["type"] == "ServiceUnavailableError"
    assert STALL_S <= waited < TIMEOUT_S / 2


async def test_a_streamed_request_fails_when_the_ledger_loses_every_worker(
    start_gateway, start_ledger
):
    ledger = await start_ledger(Script(delay_s=0.3))
    client = await start_gateway(stall_timeout_s=STALL_S, request_timeout_s=TIMEOUT_S)
    resp = await client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 60, "stream": True}
    )
    await ledger.wait_for_requests(1)
    ledger.num_workers = 0  # its next status says so ...
    ledger.script.silent = True
    for task in ledger._answers.values():  # ... and nothing computes any more
        task.cancel()
    started = time.monotonic()
    *_, error, done = await read_sse(resp)
    assert time.monotonic() - started < TIMEOUT_S / 2
    assert "the ledger has had no worker for" in error["error"]["message"]
    assert done == "[DONE]"
    await ledger.wait_for_abort(ledger.requests[0].req_id)


async def test_a_slow_ledger_that_keeps_its_status_is_not_a_stall(start_gateway, start_ledger):
    """Output slower than the stall bound is fine while the ledger is alive with workers."""
    await start_ledger(Script(delay_s=1.5))
    client = await start_gateway(stall_timeout_s=STALL_S, request_timeout_s=TIMEOUT_S)
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["text"] == "He"


async def test_health_is_not_ready_without_workers(start_gateway, start_ledger):
    ledger = await start_ledger()
    client = await start_gateway()
    assert (await client.get("/health")).status == 200
    ledger.num_workers = 0
    await ledger._write_status()
    # Probes answer from a status read within PROBE_MAX_AGE_S: the change shows within that.
    deadline = time.monotonic() + PROBE_MAX_AGE_S + 5
    while (resp := await client.get("/health")).status == 200:
        assert time.monotonic() < deadline, "/health never said 503"
        await asyncio.sleep(0.05)
    assert resp.status == 503
    body = await resp.json()
    assert body["status"] == "unavailable"
    assert "has no worker" in body["message"]
    assert body["ledger"]["num_workers"] == 0
