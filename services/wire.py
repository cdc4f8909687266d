"""The wire codec: typed dataclasses <-> msgpack, with a version field and validation.

Every message that crosses Redis is a dataclass declared in `services.messages`. It goes out as
a msgpack map `{"v": WIRE_VERSION, "kind": <kind>, <fields>...}` and comes back through
`decode`, which checks every field against the dataclass annotations and raises `WireError`
naming the field when something does not fit. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

import msgpack

WIRE_VERSION = 1

T = TypeVar("T")

_REGISTRY: dict[str, type] = {}


class WireError(ValueError):
    """A stream entry that is not a valid message; the text names the offending field."""


def message(kind: str):
    """Class decorator: register a dataclass as the wire message `kind`."""

    def register(cls: type[T]) -> type[T]:
        if kind in _REGISTRY:
            raise RuntimeError(f"wire kind {kind!r} declared twice")
        cls = dataclasses.dataclass(slots=True)(cls)
        cls.KIND = kind  # type: ignore[attr-defined]
        _REGISTRY[kind] = cls
        return cls

    return register


def encode(msg: Any) -> bytes:
    body = {"v": WIRE_VERSION, "kind": msg.KIND}
    body.update(_to_plain(msg))
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes, expect: type[T] | None = None) -> T:
    """Parse one message. `expect` restricts it to one class (raises WireError otherwise)."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"not msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(body, dict):
        raise WireError(f"expected a msgpack map, got {type(body).__name__}")
    version = body.pop("v", None)
    if version != WIRE_VERSION:
        raise WireError(
            f"field 'v': unsupported wire version {version!r} (this build speaks {WIRE_VERSION})"
        )
    kind = body.pop("kind", None)
    cls = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WireError(f"field 'kind': unknown message kind {kind!r}")
    if expect is not None and cls is not expect:
        raise WireError(f"field 'kind': expected {expect.KIND!r}, got {kind!r}")  # type: ignore[attr-defined]
    return _from_plain(cls, body, path="")


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = get_type_hints(cls)
    return hints


def _from_plain(cls: type[T], body: Any, path: str) -> T:
    if not isinstance(body, dict):
        raise WireError(
            f"field '{path or cls.__name__}': expected a map, got {type(body).__name__}"
        )
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        where = f"{path}.{f.name}" if path else f.name
        if f.name in body:
            kwargs[f.name] = _check(hints[f.name], body[f.name], where)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise WireError(f"field '{where}': missing")
    return cls(**kwargs)


def _check(tp: Any, value: Any, where: str) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(arg, value, where)
            except WireError as exc:
                errors.append(str(exc))
        raise WireError(errors[0] if errors else f"field '{where}': unexpected None")
    if origin is list:
        (item,) = get_args(tp)
        if not isinstance(value, list):
            raise WireError(f"field '{where}': expected a list, got {type(value).__name__}")
        if item is int:  # the hot case (token and block ids): one pass, no recursion
            for i, v in enumerate(value):
                if type(v) is not int:
                    raise WireError(f"field '{where}[{i}]': expected int, got {type(v).__name__}")
            return value
        return [_check(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_tp, val_tp = get_args(tp)
        if not isinstance(value, dict):
            raise WireError(f"field '{where}': expected a map, got {type(value).__name__}")
        return {
            _check(key_tp, k, f"{where} key"): _check(val_tp, v, f"{where}[{k!r}]")
            for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp):
        return _from_plain(tp, value, where)
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WireError(f"field '{where}': expected a number, got {type(value).__name__}")
        return float(value)
    if tp is int:
        if type(value) is not int:
            raise WireError(f"field '{where}': expected int, got {type(value).__name__}")
        return value
    if tp in (str, bool, bytes):
        if type(value) is not tp:
            raise WireError(f"field '{where}': expected {tp.__name__}, got {type(value).__name__}")
        return value
    raise TypeError(f"wire codec cannot check type {tp!r} at {where}")
