"""The wire codec: typed dataclasses <-> msgpack, with a version field and validation.

Every message that crosses Redis is a dataclass declared in `services.messages`. It goes out as
a msgpack map `{"v": WIRE_VERSION, "kind": <kind>, <fields>...}` and comes back through
`decode`, which checks every field against the dataclass annotations and raises `WireError`
naming the field when something does not fit. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
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


_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


def _to_plain(value: Any) -> Any:
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is list or kind is tuple:
        # Message lists are homogeneous by their annotations: token and block ids go out as they
        # are, without a pass over every element.
        if not value or type(value[0]) in _SCALARS:
            return value
        return [_to_plain(v) for v in value]
    if kind is dict:
        if all(type(v) in _SCALARS for v in value.values()):
            return value
        return {k: _to_plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value):
        return {name: _to_plain(getattr(value, name)) for name in _field_names(kind)}
    return value


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _from_plain(cls: type[T], body: Any, path: str) -> T:
    return _checker(cls)(body, path)


Checker = Callable[[Any, str], Any]


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


@functools.cache
def _checker(tp: Any) -> Checker:
    """A validating converter for one annotation, built once per type: decoding a message then
    costs one call per field instead of re-reading the annotations every time."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _union_checker(
            tuple(a for a in get_args(tp) if a is not type(None)), type(None) in get_args(tp)
        )
    if origin is list:
        return _list_checker(get_args(tp)[0])
    if origin is dict:
        return _dict_checker(*get_args(tp))
    if dataclasses.is_dataclass(tp):
        return _dataclass_checker(tp)
    if tp is Any:
        return lambda value, where: value
    if tp is float:

        def check_float(value: Any, where: str) -> float:
            if type(value) is float:
                return value
            if type(value) is not int:
                raise WireError(f"field '{where}': expected a number, got {type(value).__name__}")
            return float(value)

        return check_float
    if tp in (int, str, bool, bytes):

        def check_exact(value: Any, where: str) -> Any:
            if type(value) is not tp:
                raise WireError(
                    f"field '{where}': expected {tp.__name__}, got {type(value).__name__}"
                )
            return value

        return check_exact
    raise TypeError(f"wire codec cannot check type {tp!r}")


def _union_checker(options: tuple[Any, ...], nullable: bool) -> Checker:
    checkers = [_checker(option) for option in options]

    def check(value: Any, where: str) -> Any:
        if value is None:
            if nullable:
                return None
            raise WireError(f"field '{where}': unexpected None")
        errors = []
        for checker in checkers:
            try:
                return checker(value, where)
            except WireError as exc:
                errors.append(str(exc))
        raise WireError(errors[0])

    return check


def _list_checker(item: Any) -> Checker:
    if item is int:  # the hot case (token and block ids): one pass, no call per element

        def check_ints(value: Any, where: str) -> list[int]:
            if type(value) is not list:
                raise WireError(f"field '{where}': expected a list, got {type(value).__name__}")
            for i, v in enumerate(value):
                if type(v) is not int:
                    raise WireError(f"field '{where}[{i}]': expected int, got {type(v).__name__}")
            return value

        return check_ints
    item_checker = _checker(item)

    def check_list(value: Any, where: str) -> list:
        if type(value) is not list:
            raise WireError(f"field '{where}': expected a list, got {type(value).__name__}")
        return [item_checker(v, f"{where}[{i}]") for i, v in enumerate(value)]

    return check_list


def _dict_checker(key_tp: Any, val_tp: Any) -> Checker:
    key_checker, val_checker = _checker(key_tp), _checker(val_tp)

    def check_dict(value: Any, where: str) -> dict:
        if type(value) is not dict:
            raise WireError(f"field '{where}': expected a map, got {type(value).__name__}")
        return {
            key_checker(k, f"{where} key"): val_checker(v, f"{where}[{k!r}]")
            for k, v in value.items()
        }

    if key_tp is str and val_tp is int:  # the hot case (tokens per request): one pass

        def check_counts(value: Any, where: str) -> dict:
            if type(value) is not dict:
                raise WireError(f"field '{where}': expected a map, got {type(value).__name__}")
            for k, v in value.items():
                if type(k) is not str or type(v) is not int:
                    raise WireError(f"field '{where}[{k!r}]': expected str -> int")
            return value

        return check_counts
    return check_dict


def _dataclass_checker(cls: type) -> Checker:
    hints = get_type_hints(cls)
    fields = [
        (
            f.name,
            _checker(hints[f.name]),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
    ]

    def check_message(body: Any, path: str) -> Any:
        if type(body) is not dict:
            raise WireError(
                f"field '{path or cls.__name__}': expected a map, got {type(body).__name__}"
            )
        kwargs = {}
        for name, checker, required in fields:
            if name in body:
                kwargs[name] = checker(body[name], _join(path, name))
            elif required:
                raise WireError(f"field '{_join(path, name)}': missing")
        return cls(**kwargs)

    return check_message
