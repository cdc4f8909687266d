"""Helpers of the gateway tests: reading server-sent events and checking error bodies."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import ClientResponse

GATEWAY_ID = "gw-test"


async def read_sse(response: ClientResponse) -> list[Any]:
    """The events of a server-sent-event body, one by one: parsed JSON, or "[DONE]"."""
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = []
    while line := await response.content.readline():
        if line == b"\n":
            continue
        assert line.startswith(b"data: ") and line.endswith(b"\n"), line
        assert await response.content.readline() == b"\n", "each event ends with a blank line"
        payload = line[len(b"data: ") : -1].decode()
        events.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
    return events


def assert_error(body: dict[str, Any], param: str | None, fragment: str = "") -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert type(error["code"]) is int and 400 <= error["code"] < 600  # the status, as vLLM
    assert error["param"] == param
    assert fragment in error["message"], error["message"]
