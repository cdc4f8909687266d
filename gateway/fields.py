"""Typed readers for the fields of an OpenAI request body, pure: each returns the value or
raises an `ApiError` whose message and `param` name the field, and refuses fields kvledger
cannot honour instead of ignoring them.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any, cast

from ledger.hashing import cache_salt_problem

MAX_STOP_STRINGS = 4
INT64_MIN, INT64_MAX, UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1  # what msgpack carries


# vLLM 0.33's `error.type` by status: the names its create_error_response gives, and for the
# other statuses the HTTP phrase, as its HTTPException handler writes it.
ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def error_type(status: int) -> str:
    """What vLLM 0.33 puts in `error.type` for an error of this HTTP status."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    try:
        return HTTPStatus(status).phrase
    except ValueError:  # a status the standard does not name (nginx's 499)
        return "BadRequestError" if status < 500 else "InternalServerError"


class ApiError(Exception):
    """An error the client gets as an OpenAI-style JSON body with this HTTP status; its type is
    vLLM's for the status unless given."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or error_type(status)
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


def read_bool(
    body: dict[str, Any], name: str, default: bool = False, param: str | None = None
) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        param = param or name
        raise bad_request(f"'{param}' must be a boolean, got {type_name(value)}", param)
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


def read_stream_options(options: Any, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous usage) of `stream_options` (its fields checked first by
    `support.check_fields`): as vLLM 0.33, continuous_usage_stats counts only with
    include_usage."""
    if options is None:
        return False, False
    if not stream:
        raise bad_request(
            "'stream_options' is only allowed when 'stream' is true", "stream_options"
        )
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    include_usage = read_bool(options, "include_usage", param="stream_options.include_usage")
    continuous = read_bool(
        options, "continuous_usage_stats", param="stream_options.continuous_usage_stats"
    )
    return include_usage, include_usage and continuous


def read_cache_salt(value: Any) -> str | None:
    problem = cache_salt_problem(value)
    if problem is not None:
        raise bad_request(problem, "cache_salt")
    return cast("str | None", value)


def read_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string, got {type_name(value)}", name)
    return value


def unknown_model(model: str, served: str) -> ApiError:
    """vLLM 0.33's answer to a model it does not serve, the same on every route."""
    return ApiError(404, f"The model `{model}` does not exist. Valid aliases: {served}.", "model")


def read_model(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'model' must be a string, got {type_name(value)}", "model")
    return value


def type_name(value: Any) -> str:
    return {
        dict: "an object", list: "a list", str: "a string", bool: "a boolean", float: "a number",
        int: "an integer",
    }.get(type(value), type(value).__name__)  # fmt: skip


def short(value: Any) -> str:
    # Never echo a whole prompt back into an error body or a log line.
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
