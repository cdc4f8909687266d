"""Structured logging: JSON lines with trace ids inside spans, the console renderer on a
terminal, stdlib loggers through the same renderer, and secrets that never reach the output."""

from __future__ import annotations

import io
import json
import logging
import os
from datetime import datetime

import pytest
from opentelemetry import context, trace
from opentelemetry.sdk.trace import TracerProvider

from observability.logging import REDACTED, configure_logging, get_logger
from observability.tracing import extract_context
from services.config import LedgerConfig, from_arguments
from services.environment import ConfigError


def _lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_records_inside_a_span_carry_its_trace_and_span_ids(
    restore_logging: pytest.MonkeyPatch,
) -> None:
    stream = io.StringIO()
    configure_logging("kvledger-ledger", stream=stream)
    tracer = TracerProvider().get_tracer("test")  # a recording span, no global provider needed
    with tracer.start_as_current_span("kvledger.admit") as span:
        get_logger("ledger.scheduler").info("request_admitted", request_id="r1", blocks=3)
        logging.getLogger("aiohttp.server").warning("client %s went away", "10.0.0.7")
    get_logger("ledger.scheduler").info("step_done")

    inside_structlog, inside_stdlib, outside = _lines(stream)
    ids = {
        "trace_id": trace.format_trace_id(span.get_span_context().trace_id),
        "span_id": trace.format_span_id(span.get_span_context().span_id),
    }
    assert {k: inside_structlog[k] for k in ids} == ids
    assert {k: inside_stdlib[k] for k in ids} == ids
    assert inside_stdlib["event"] == "client 10.0.0.7 went away"
    assert (inside_stdlib["logger"], inside_stdlib["level"]) == ("aiohttp.server", "warning")
    assert "trace_id" not in outside and "span_id" not in outside


def test_records_under_a_context_from_a_message_carry_the_requests_trace(
    restore_logging: pytest.MonkeyPatch,
) -> None:
    stream = io.StringIO()
    configure_logging("kvledger-ledger", stream=stream)
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    token = context.attach(extract_context(traceparent))  # no span of our own: tracing is off
    try:
        get_logger("ledger.streams").info("request_received", request_id="r1")
    finally:
        context.detach(token)

    (line,) = _lines(stream)
    assert line["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert line["span_id"] == "b7ad6b7169203331"


def test_json_lines_by_default_when_stdout_is_not_a_terminal(
    restore_logging: pytest.MonkeyPatch,
) -> None:
    stream = io.StringIO()
    configure_logging("kvledger-gateway", stream=stream)
    get_logger("gateway.http").info("request_accepted", request_id="r9", prompt_tokens=12)
    get_logger("gateway.http").debug("below_the_level")

    (line,) = _lines(stream)
    assert list(line)[:5] == ["timestamp", "level", "service", "logger", "event"]
    assert line == {
        "timestamp": line["timestamp"],
        "level": "info",
        "service": "kvledger-gateway",
        "logger": "gateway.http",
        "event": "request_accepted",
        "request_id": "r9",
        "prompt_tokens": 12,
    }
    stamp = datetime.fromisoformat(str(line["timestamp"]))
    assert stamp.utcoffset() is not None and stamp.utcoffset().total_seconds() == 0


def test_console_renderer_on_a_terminal_unless_json_is_asked_for(
    restore_logging: pytest.MonkeyPatch,
) -> None:
    main_fd, terminal_fd = os.openpty()
    terminal = os.fdopen(terminal_fd, "w", buffering=1)
    try:
        configure_logging("kvledger-worker", stream=terminal)
        get_logger("worker").info("kv_cache_allocated", num_blocks=512)
        console = os.read(main_fd, 4096).decode()
        configure_logging("kvledger-worker", fmt="json", stream=terminal)
        get_logger("worker").info("kv_cache_allocated", num_blocks=512)
        as_json = os.read(main_fd, 4096).decode()
    finally:
        terminal.close()
        os.close(main_fd)

    assert "kv_cache_allocated" in console and "num_blocks" in console and "512" in console
    with pytest.raises(json.JSONDecodeError):
        json.loads(console)
    assert json.loads(as_json)["num_blocks"] == 512


def test_console_format_can_be_forced_without_a_terminal(
    restore_logging: pytest.MonkeyPatch,
) -> None:
    stream = io.StringIO()
    configure_logging("kvledger-ledger", fmt="console", stream=stream)
    get_logger("ledger").warning("pool_exhausted", free_blocks=0)
    assert "pool_exhausted" in stream.getvalue()
    assert not stream.getvalue().lstrip().startswith("{")


def test_secrets_are_redacted_wherever_they_appear(restore_logging: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    configure_logging("kvledger-gateway", secrets=["sk-kvl-0123456789"], stream=stream)
    log = get_logger("gateway.auth")
    log.warning(
        "auth_rejected",
        authorization="Bearer sk-kvl-0123456789",
        headers={"Authorization": "Bearer abc.def", "X-API-Key": "k-1", "Accept": "*/*"},
        password="hunter2",
        db_password="pw",
        client_secret="s3",
        token="t0k3n",
        num_tokens=17,
        first_token="Hello",
        input_tokens=[1, 2],
    )
    log.info("config_loaded", argv=["--api-key", "sk-kvl-0123456789"])
    logging.getLogger("aiohttp.access").info('"GET /v1/models" Authorization: Bearer zzz.yyy')

    rejected, config, access = _lines(stream)
    for key in ("authorization", "password", "db_password", "client_secret", "token"):
        assert rejected[key] == REDACTED, key
    assert rejected["headers"] == {
        "Authorization": REDACTED,
        "X-API-Key": REDACTED,
        "Accept": "*/*",
    }
    assert (rejected["num_tokens"], rejected["first_token"], rejected["input_tokens"]) == (
        17,
        "Hello",
        [1, 2],
    )
    assert config["argv"] == ["--api-key", REDACTED]
    assert access["event"] == f'"GET /v1/models" Authorization: Bearer {REDACTED}'
    output = stream.getvalue()
    for secret in ("sk-kvl-0123456789", "abc.def", "hunter2", "t0k3n", "zzz.yyy", "k-1"):
        assert secret not in output


def test_unknown_format_or_level_is_rejected_with_the_choices(
    restore_logging: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match="log format 'xml': use one of json, console"):
        configure_logging("kvledger-ledger", fmt="xml", stream=io.StringIO())
    with pytest.raises(ValueError, match="log level 'loud'"):
        configure_logging("kvledger-ledger", level="loud", fmt="json", stream=io.StringIO())
    # The services read both from the environment; a bad value names the variable.
    restore_logging.setenv("KVLEDGER_LOG_LEVEL", "loud")
    with pytest.raises(ConfigError, match="KVLEDGER_LOG_LEVEL: 'loud': use one of debug, info"):
        from_arguments(LedgerConfig)
