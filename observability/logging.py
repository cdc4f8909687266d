"""Structured logging: structlog configured once per process, JSON lines in services (a console
renderer on a terminal), the current span's trace_id/span_id on every record, secrets redacted.
Standard-library loggers (aiohttp, redis, OpenTelemetry) go through the same renderer.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import structlog
from opentelemetry import trace
from structlog.typing import EventDict, Processor, WrappedLogger

REDACTED = "[REDACTED]"
FORMATS = ("json", "console")
LEVELS = ("debug", "info", "warning", "error", "critical")

# Exact key names whose values are never printed. "token" alone, not a suffix: num_tokens,
# input_tokens and first_token are counts and names, not credentials.
_SECRET_KEYS = frozenset(
    {
        "authorization",
        "proxy_authorization",
        "cookie",
        "set_cookie",
        "api_key",
        "apikey",
        "x_api_key",
        "password",
        "passwd",
        "secret",
        "client_secret",
        "private_key",
        "token",
        "access_token",
        "refresh_token",
        "id_token",
        "auth_token",
        "bearer",
        "kvledger_api_key",
    }
)
_SECRET_SUFFIXES = ("_password", "_secret", "_api_key", "_apikey", "_private_key")
_CREDENTIAL_IN_TEXT = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]+")
_MIN_SECRET_LEN = 4  # shorter values would blank out ordinary words
_PASS_THROUGH = ("exc_info", "stack_info")  # the console renderer formats these itself
_KEY_ORDER = ("timestamp", "level", "service", "logger", "event", "trace_id", "span_id")

_handler: logging.Handler | None = None


def configure_logging(
    service: str,
    *,
    level: str = "info",
    fmt: str | None = None,
    secrets: Sequence[str | None] = (),
    stream: TextIO | None = None,
) -> None:
    """Route structlog and the standard library through one renderer; call once per process.

    Without a format, a terminal gets the console renderer and anything else JSON. `secrets`
    are values (an API key, a password) blanked out wherever they appear in a record. Calling
    again reconfigures.
    """
    global _handler
    stream = stream or sys.stdout
    level = _choose(level, LEVELS, "log level")
    fmt = _choose(fmt or ("console" if _is_tty(stream) else "json"), FORMATS, "log format")
    secret_values = tuple(value for value in secrets if value)

    shared = _shared_processors(service)
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # configure_logging may run again (tests, `kvledger up`); a cached logger would keep
        # the chain it was first built with.
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.ExtraAdder(), *shared],
            processors=_render_processors(fmt, stream, secret_values),
        )
    )
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # warnings.warn(...) from libraries comes out as records too
    _handler = handler


def get_logger(name: str | None = None, **initial: Any) -> structlog.stdlib.BoundLogger:
    """A logger for `name`; log events as names (`request_admitted`), details as keys."""
    return structlog.get_logger(name, **initial)


def _shared_processors(service: str) -> list[Processor]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.PositionalArgumentsFormatter(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_service(service),
        add_trace_context,
    ]


def _render_processors(fmt: str, stream: TextIO, secret_values: tuple[str, ...]) -> list[Processor]:
    # Redaction runs after exceptions are formatted, so a secret in a traceback is caught too.
    redact = RedactSecrets(secret_values)
    if fmt == "json":
        return [
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            redact,
            _order_keys,
            structlog.processors.JSONRenderer(),
        ]
    return [
        structlog.stdlib.ProcessorFormatter.remove_processors_meta,
        redact,
        structlog.dev.ConsoleRenderer(colors=_is_tty(stream)),
    ]


def _add_service(service: str) -> Processor:
    def add_service(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
        event_dict.setdefault("service", service)  # a bound service (kvledger up) wins
        return event_dict

    return add_service


def add_trace_context(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    """Top-level trace_id and span_id (hex) of the current span, whenever it has valid ids.

    Valid rather than recording: a context attached from a message's traceparent (a remote,
    non-recording span) still names the request's trace, which is what a reader greps for.
    """
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        event_dict["trace_id"] = trace.format_trace_id(span_context.trace_id)
        event_dict["span_id"] = trace.format_span_id(span_context.span_id)
    return event_dict


class RedactSecrets:
    """Replace the values of secret-looking keys (at any depth), credentials after
    `Bearer`/`Basic`, and the configured secret values themselves wherever they appear."""

    def __init__(self, secret_values: tuple[str, ...] = ()) -> None:
        self.secret_values = tuple(v for v in secret_values if len(v) >= _MIN_SECRET_LEN)

    def __call__(self, _: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
        return self._scrub_mapping(event_dict, depth=0)

    def _scrub_mapping(self, mapping: Mapping[Any, Any], depth: int) -> dict[Any, Any]:
        return {key: self._scrub_item(key, value, depth) for key, value in mapping.items()}

    def _scrub_item(self, key: Any, value: Any, depth: int) -> Any:
        if is_secret_key(key):
            return REDACTED
        if depth == 0 and key in _PASS_THROUGH:
            return value
        return self._scrub(value, depth + 1)

    def _scrub(self, value: Any, depth: int) -> Any:
        if depth > 6:  # deep structures are not worth the time; their repr is still scrubbed
            return self._scrub_text(repr(value))
        if isinstance(value, str):
            return self._scrub_text(value)
        if isinstance(value, Mapping):
            return self._scrub_mapping(value, depth)
        if isinstance(value, list | tuple | set | frozenset):
            return [self._scrub(item, depth + 1) for item in value]
        return value

    def _scrub_text(self, text: str) -> str:
        text = _CREDENTIAL_IN_TEXT.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
        for secret in self.secret_values:
            text = text.replace(secret, REDACTED)
        return text


def is_secret_key(key: object) -> bool:
    normalized = str(key).lower().replace("-", "_")
    return normalized in _SECRET_KEYS or normalized.endswith(_SECRET_SUFFIXES)


def _order_keys(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    ordered = {key: event_dict.pop(key) for key in _KEY_ORDER if key in event_dict}
    ordered.update(event_dict)
    return ordered


def _choose(value: str, allowed: tuple[str, ...], what: str) -> str:
    value = value.strip().lower()
    if value not in allowed:
        raise ValueError(f"{what} {value!r}: use one of {', '.join(allowed)}")
    return value


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
