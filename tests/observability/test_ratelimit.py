"""Rate-limited logging: the first of a storm is logged, the rest counted and reported once."""

from __future__ import annotations

import asyncio
import io
import json

from observability.logging import configure_logging, get_logger
from observability.ratelimit import RateLimitedLog, install_loop_exception_handler


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _records(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line]


def test_a_storm_logs_its_first_occurrence_then_one_line_per_interval_with_the_count():
    stream = io.StringIO()
    configure_logging("kvledger-gateway", fmt="json", stream=stream)
    clock = Clock()
    limited = RateLimitedLog(get_logger("gateway"), interval_s=10.0, clock=clock)
    written = [limited.log("warning", "connection_refused", open_connections=64)]
    for _ in range(999):
        clock.now += 0.005
        written.append(limited.log("warning", "connection_refused", open_connections=64))
    assert written.count(True) == 1 and limited.held_back("connection_refused") == 999
    clock.now += 10.0
    assert limited.log("warning", "connection_refused", open_connections=64)
    # Another key is limited on its own.
    assert limited.log("info", "request_body_timeout")
    records = _records(stream)
    assert [r["event"] for r in records] == [
        "connection_refused",
        "connection_refused",
        "request_body_timeout",
    ]
    assert "repeated" not in records[0]
    assert records[1]["repeated"] == 999 and records[1]["interval_s"] == 10.0
    assert limited.held_back("connection_refused") == 0


async def test_event_loop_errors_are_rate_limited_by_message():
    stream = io.StringIO()
    configure_logging("kvledger-gateway", fmt="json", stream=stream)
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    limited = install_loop_exception_handler(loop, interval_s=60.0)
    try:
        for _ in range(5000):
            loop.call_exception_handler(
                {
                    "message": "socket.accept() out of system resource",
                    "exception": OSError(24, "Too many open files"),
                }
            )
        loop.call_exception_handler({"message": "Fatal read error on socket transport"})
    finally:
        loop.set_exception_handler(previous)
    records = _records(stream)
    assert [r["message"] for r in records] == [
        "socket.accept() out of system resource",
        "Fatal read error on socket transport",
    ]
    assert records[0]["error"] == "OSError: [Errno 24] Too many open files"
    assert limited.held_back("socket.accept() out of system resource|OSError") == 4999
