"""HTTP fuzz of /v1/completions and /v1/chat/completions: bodies drawn from the live gateway's
/openapi.json (valid ones, and ones broken on purpose) sent to a real gateway in front of a real
ledger and worker (tiny model) on a real redis-server. No answer may be a 5xx; every 4xx is a
JSON error naming what was wrong; every 200 is a complete answer (a stream ends in [DONE]).

The default run draws 200 bodies per endpoint; `-m fuzz` draws 3,000.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway.app import listen, make_runner
from services.config import GatewayConfig
from tests.gateway.schema_strategies import invalid_body, valid_body
from tests.harness.stack import Stack

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
SHORT = settings(
    max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None
)
LONG = settings(SHORT, max_examples=3000)
ANSWER_TIMEOUT_S = 60.0  # a hang is a failure too


class LiveGateway:
    """The stack and the gateway on their own event loop in a thread, so hypothesis' synchronous
    test body can call them over a real socket."""

    def __init__(self, redis_url: str, model: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._redis_url, self._model = redis_url, model
        self.port = self._call(self._start())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(120)

    async def _start(self) -> int:
        # max_model_len small: a drawn max_tokens runs at most 64 steps of the tiny model.
        self.stack = await Stack(
            self._redis_url, self._model, num_blocks=512, max_model_len=64
        ).start()
        config = GatewayConfig(
            redis_url=self._redis_url, stream_prefix=self.stack.prefix, gateway_id="gw-fuzz", model="tiny",
            max_model_len=64, request_timeout_s=15.0, port=0,
        )  # fmt: skip
        self.runner = make_runner(config)
        await self.runner.setup()
        return (await listen(self.runner, config)).port

    async def _stop(self) -> None:
        await self.runner.cleanup()
        await self.stack.stop()

    def close(self) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def post(self, path: str, body: bytes) -> tuple[int, str, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=ANSWER_TIMEOUT_S)
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.getheader("Content-Type", ""), resp.read()
        finally:
            conn.close()

    def get_json(self, path: str) -> Any:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=ANSWER_TIMEOUT_S)
        try:
            conn.request("GET", path)
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()


@pytest.fixture(scope="module")
def live_gateway(redis_url: str, tiny_model: Any) -> Iterator[LiveGateway]:
    gateway = LiveGateway(redis_url, tiny_model)
    yield gateway
    gateway.close()


@pytest.fixture(scope="module")
def schemas(live_gateway: LiveGateway) -> dict[str, dict[str, Any]]:
    document = live_gateway.get_json("/openapi.json")
    return {
        path: document["paths"][path]["post"]["requestBody"]["content"]["application/json"][
            "schema"
        ]
        for path in ENDPOINTS
    }


def check_answer(path: str, body: bytes, status: int, content_type: str, raw: bytes) -> None:
    sent = body[:300]
    assert status < 500, (path, sent, status, raw[:500])
    if status >= 400:
        assert content_type.startswith("application/json"), (path, sent, status, content_type)
        error = json.loads(raw)["error"]
        assert isinstance(error["message"], str) and error["message"], (path, sent, raw)
        return
    assert status == 200, (path, sent, status)
    if content_type.startswith("text/event-stream"):
        events = [line for line in raw.decode().split("\n\n") if line]
        assert events[-1] == "data: [DONE]", (path, sent, raw[-300:])
        for event in events[:-1]:
            json.loads(event.removeprefix("data: "))
    else:
        answer = json.loads(raw)
        assert answer["choices"], (path, sent, answer)
        assert all(c["finish_reason"] is not None for c in answer["choices"]), answer


def _fuzz(live_gateway: LiveGateway, schemas: dict, path: str, data: st.DataObject) -> None:
    schema = schemas[path]
    body = data.draw(st.one_of(valid_body(schema), invalid_body(schema)), label="body")
    status, content_type, raw = live_gateway.post(path, body)
    event(f"status {status}")  # --hypothesis-show-statistics shows how deep the bodies reach
    check_answer(path, body, status, content_type, raw)


@pytest.mark.parametrize("path", ENDPOINTS)
@SHORT
@given(data=st.data())
def test_fuzzed_bodies_never_get_a_5xx(live_gateway, schemas, path, data):
    _fuzz(live_gateway, schemas, path, data)


@pytest.mark.fuzz
@pytest.mark.timeout(3600)  # 3,000 bodies take 5-10 minutes per endpoint on two cores
@pytest.mark.parametrize("path", ENDPOINTS)
@LONG
@given(data=st.data())
def test_fuzzed_bodies_never_get_a_5xx_long(live_gateway, schemas, path, data):
    _fuzz(live_gateway, schemas, path, data)
