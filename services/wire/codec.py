"""The wire codec: typed messages <-> msgpack, versioned and validated.

Every message that crosses Redis is a `Message` declared in `services.wire.messages`: a msgspec
Struct, so type checkers see every field and the codec runs in C. A message goes out as a
msgpack map `{"kind": <kind>, <fields>..., "v": WIRE_VERSION}`; `decode` checks every field
against its declaration and raises `WireError` naming the field when something does not fit.
Parts nested inside messages (sampling parameters, per-request data) are `Record`s. No pickle.
"""

from __future__ import annotations

import functools
import re
from typing import Any, TypeVar, Union, overload

import msgpack
import msgspec

WIRE_VERSION = 1


class Message(msgspec.Struct, tag_field="kind", kw_only=True, gc=False):
    """A top-level wire message; a subclass names its kind with `tag=`.

    `gc=False`: messages hold no reference cycles, so the garbage collector need not track them.
    """

    v: int = WIRE_VERSION


class Record(msgspec.Struct, gc=False):
    """A plain part of a message (no kind, no version of its own)."""


M = TypeVar("M", bound=Message)


class WireError(ValueError):
    """A stream entry that is not a valid message; the text names the offending field."""


def kind_of(msg: Message | type[Message]) -> str:
    cls = msg if isinstance(msg, type) else type(msg)
    return str(cls.__struct_config__.tag)


_encoder = msgspec.msgpack.Encoder()


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


@overload
def decode(data: bytes) -> Message: ...
@overload
def decode(data: bytes, expect: type[M]) -> M: ...
def decode(data: bytes, expect: type[M] | None = None) -> Message:
    """Parse one message. `expect` restricts it to one kind (raises WireError otherwise)."""
    try:
        msg = _decoder(expect).decode(data)
    except msgspec.ValidationError as exc:
        raise _explain(data, expect, exc) from None
    except msgspec.DecodeError as exc:
        raise WireError(f"not msgpack ({exc})") from None
    if msg.v != WIRE_VERSION:
        raise _version_error(msg.v)
    return msg


def message_kinds() -> dict[str, type[Message]]:
    """Every declared message by kind (the `services.wire` package imports `messages`, which
    declares them all, before this module is used)."""
    return {kind_of(cls): cls for cls in Message.__subclasses__()}


@functools.cache
def _decoder(expect: type[Message] | None) -> msgspec.msgpack.Decoder[Any]:
    if expect is not None:
        return msgspec.msgpack.Decoder(expect)
    kinds = tuple(message_kinds().values())
    return msgspec.msgpack.Decoder(Union[kinds])  # noqa: UP007


_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]+)`$")
_EXPECTED = re.compile(r"^Expected `(?P<want>[^`]+)`, got `(?P<got>[^`]+)`$")


def _explain(data: bytes, expect: type[Message] | None, exc: msgspec.ValidationError) -> WireError:
    """msgspec's "Expected `int`, got `str` - at `$.a[0].b`" as "field 'a[0].b': expected int,
    got str"; a body from another wire version or of another kind says so instead."""
    body = _peek(data)
    if body is None:
        return WireError(f"expected a msgpack map, got {_msgpack_type(data)}")
    if body.get("v", WIRE_VERSION) != WIRE_VERSION:
        return _version_error(body.get("v"))
    kind = body.get("kind")
    if expect is not None and kind != kind_of(expect):
        return WireError(f"field 'kind': expected {kind_of(expect)!r}, got {kind!r}")
    if expect is None and kind not in message_kinds():
        return WireError(f"field 'kind': unknown message kind {kind!r}")
    match = _AT.match(str(exc))
    what, path = (match["what"], (match["path"] or "").lstrip(".")) if match else (str(exc), "")
    if missing := _MISSING.match(what):
        name = missing["name"]
        return WireError(f"field '{f'{path}.{name}' if path else name}': missing")
    if expected := _EXPECTED.match(what):
        what = f"expected {expected['want'].replace(' | null', '')}, got {expected['got']}"
    return WireError(f"field '{path or '?'}': {what[:1].lower()}{what[1:]}")


def _peek(data: bytes) -> dict[Any, Any] | None:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:  # msgspec already said it parses; this is only for the message
        return None
    return body if isinstance(body, dict) else None


def _msgpack_type(data: bytes) -> str:
    try:
        return type(msgpack.unpackb(data, raw=False, strict_map_key=False)).__name__
    except Exception:
        return "something else"


def _version_error(version: object) -> WireError:
    return WireError(
        f"field 'v': unsupported wire version {version!r} (this build speaks {WIRE_VERSION})"
    )
