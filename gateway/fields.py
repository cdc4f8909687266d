"""Typed readers for the fields of an OpenAI request body, pure: each returns the value or
raises an `ApiError` whose message and `param` name the field, and refuses fields kvledger
cannot honour instead of ignoring them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

MAX_STOP_STRINGS = 4
INT64_MIN, INT64_MAX, UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1  # what msgpack carries


class ApiError(Exception):
    """An error the client gets as an OpenAI-style JSON body with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        err_type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type
        self.headers = headers or {}


def bad_request(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param)


def read_token_ids(value: Any, name: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request(f"'{name}' must be a list of token ids, got {type_name(value)}", name)
    for i, token in enumerate(value):
        if type(token) is not int or token < 0:
            raise bad_request(
                f"'{name}[{i}]' must be a non-negative integer token id, got {short(token)}", name
            )
    return value


def read_int(
    body: dict[str, Any], name: str, lo: int | None = None, hi: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int:
        raise bad_request(f"'{name}' must be an integer, got {type_name(value)}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad_request(f"'{name}' must be {bounds}, got {value}", name)
    return value


def read_number(
    body: dict[str, Any], name: str, lo: float, hi: float, default: float, lo_open: bool = False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"'{name}' must be a number, got {type_name(value)}", name)
    if value > hi or value < lo or (lo_open and value == lo):
        low = f"greater than {lo}" if lo_open else f"at least {lo}"
        raise bad_request(f"'{name}' must be {low} and at most {hi}, got {value}", name)
    return float(value)


def read_bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean, got {type_name(value)}", name)
    return value


def read_stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(
            f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop"
        )
    if any(s == "" for s in stops):
        raise bad_request("'stop' strings must not be empty", "stop")
    return stops


def read_include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise bad_request(
            "'stream_options' is only allowed when 'stream' is true", "stream_options"
        )
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise bad_request(
            "'stream_options.include_usage' must be a boolean", "stream_options.include_usage"
        )
    return bool(include)


def read_cache_salt(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad_request("'cache_salt' must be a non-empty string", "cache_salt")
    return value


def read_model(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'model' must be a string, got {type_name(value)}", "model")
    return value


# Fields kvledger cannot honour: refused unless absent or set to their do-nothing value, so a
# client never gets output that silently ignored what it asked for.
def _is(*allowed: Any) -> Callable[[Any], bool]:
    return lambda v: any(type(v) is type(a) and v == a for a in allowed)


def _number_is(target: float) -> Callable[[Any], bool]:
    return lambda v: not isinstance(v, bool) and isinstance(v, int | float) and v == target


_COMMON_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "n": _is(1),
    "best_of": _is(1),
    "presence_penalty": _number_is(0),
    "frequency_penalty": _number_is(0),
    "repetition_penalty": _number_is(1),
    "logit_bias": _is({}),
    "use_beam_search": _is(False),
    "prompt_logprobs": lambda v: False,
}
COMPLETION_UNSUPPORTED = {
    **_COMMON_UNSUPPORTED,
    "echo": _is(False),
    "logprobs": lambda v: False,
    "suffix": _is(""),
}
CHAT_UNSUPPORTED = {
    **_COMMON_UNSUPPORTED,
    "logprobs": _is(False),
    "top_logprobs": lambda v: False,
    "tools": _is([]),
    "response_format": _is({"type": "text"}),
}


def refuse_unsupported(body: dict[str, Any], table: dict[str, Callable[[Any], bool]]) -> None:
    for name, harmless in table.items():
        value = body.get(name)
        if value is None or harmless(value):
            continue
        if name in ("n", "best_of"):
            raise bad_request(f"'{name}' must be 1: one choice per request is supported", name)
        raise bad_request(f"'{name}' is not supported by kvledger (got {short(value)})", name)


def type_name(value: Any) -> str:
    return {
        dict: "an object", list: "a list", str: "a string", bool: "a boolean", float: "a number",
        int: "an integer",
    }.get(type(value), type(value).__name__)  # fmt: skip


def short(value: Any) -> str:
    # Never echo a whole prompt back into an error body or a log line.
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
