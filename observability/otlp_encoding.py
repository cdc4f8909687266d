"""Finished spans as an OTLP `ExportTraceServiceRequest` in protobuf bytes, written straight
from opentelemetry-proto's trace.proto and common.proto.

Why: the SDK's encoder (opentelemetry-exporter-otlp-proto-common) builds a protobuf object per
span, attribute and value, and hashes each span's Resource through JSON to group them, which
made exporting cost ~150 µs of CPU a span, more than making the span: the largest part of what
tracing cost kvledger. Writing the wire format directly costs a fraction of it, in the export
thread the batch processor runs (the services' own threads never encode). The output parses to
the same message the SDK's encoder builds (tests/observability/test_otlp_encoding.py).

Imported only when tracing is on (it needs the SDK's span types).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext

_pack_double = struct.Struct("<d").pack
_pack_fixed64 = struct.Struct("<Q").pack
_pack_fixed32 = struct.Struct("<I").pack

# SpanFlags: the span's parent (or a link's span) says whether it is remote.
_FLAGS_HAS_IS_REMOTE = 0x100
_FLAGS_IS_REMOTE = 0x200
_KINDS = {0: 1, 1: 2, 2: 3, 3: 4, 4: 5}  # SDK SpanKind value -> proto SpanKind (INTERNAL = 1)

_key_cache: dict[str, bytes] = {}  # an attribute key -> its KeyValue.key field, encoded
# (field tag, key, is bool, value) -> the whole KeyValue field, for the values that repeat:
# booleans and small integers (bounded: tags x keys x 1,026 values). True == 1 in a dict key,
# hence the bool flag.
_pair_cache: dict[tuple[bytes, str, bool, int], bytes] = {}
_SMALL = 1024
_VARINTS = [bytes((n,)) if n < 0x80 else bytes(((n & 0x7F) | 0x80, n >> 7)) for n in range(1 << 14)]


def _varint(value: int) -> bytes:
    if 0 <= value < 0x4000:
        return _VARINTS[value]
    if value < 0:
        value &= 0xFFFF_FFFF_FFFF_FFFF
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _length_delimited(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


def _string(tag: bytes, text: str) -> bytes:
    data = text.encode("utf-8")
    return tag + _varint(len(data)) + data


def _any_value(value: Any) -> bytes:
    """An AnyValue's fields (string 1, bool 2, int 3, double 4, array 5, kvlist 6, bytes 7)."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _string(b"\x0a", value)
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFF_FFFF_FFFF_FFFF if value < 0 else value)
    if isinstance(value, float):
        return b"\x21" + _pack_double(value)
    if isinstance(value, bytes):
        return _length_delimited(b"\x3a", value)
    if isinstance(value, Sequence):
        items = b"".join(_length_delimited(b"\x0a", _any_value(v)) for v in value)
        return _length_delimited(b"\x2a", items)
    if isinstance(value, Mapping):
        pairs = b"".join(
            _length_delimited(b"\x0a", _key_value(str(k), v)) for k, v in value.items()
        )
        return _length_delimited(b"\x32", pairs)
    raise TypeError(f"an attribute value of type {type(value).__name__}: {value!r}")


def _key_value(key: str, value: Any) -> bytes:
    encoded_key = _key_cache.get(key)
    if encoded_key is None:
        encoded_key = _key_cache[key] = _string(b"\x0a", key)
    if type(value) is str:  # the common case, written out
        data = value.encode("utf-8")
        size = len(data)
        if size < 0x7E:  # the AnyValue and its field fit one-byte lengths
            return encoded_key + b"\x12" + _VARINTS[size + 2] + b"\x0a" + _VARINTS[size] + data
    return encoded_key + _length_delimited(b"\x12", _any_value(value))


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> bytes:
    """The repeated KeyValue field `tag` of a message."""
    if not attributes:
        return b""
    parts: list[bytes] = []
    append = parts.append
    pair_cache, key_cache, varints = _pair_cache, _key_cache, _VARINTS
    for key, value in attributes.items():
        kind = type(value)
        if kind is str:  # the common case, written out
            encoded_key = key_cache.get(key)
            if encoded_key is None:
                encoded_key = key_cache[key] = _string(b"\x0a", key)
            data = value.encode("utf-8")
            size = len(data)
            if size < 0x7E:  # the AnyValue and its field fit one-byte lengths
                pair = encoded_key + b"\x12" + varints[size + 2] + b"\x0a" + varints[size] + data
                append(tag + _varint(len(pair)) + pair)
                continue
        elif kind is bool or (kind is int and 0 <= value < _SMALL):
            cache_key = (tag, key, kind is bool, value)
            cached = pair_cache.get(cache_key)
            if cached is None:
                cached = pair_cache[cache_key] = _length_delimited(tag, _key_value(key, value))
            append(cached)
            continue
        elif kind is float or kind is int:  # written out too: counts, times, latencies
            encoded_key = key_cache.get(key)
            if encoded_key is None:
                encoded_key = key_cache[key] = _string(b"\x0a", key)
            if kind is float:
                pair = encoded_key + b"\x12\x09\x21" + _pack_double(value)
            else:
                number = _varint(value)  # negatives: two's complement, as int64
                pair = encoded_key + b"\x12" + varints[len(number) + 1] + b"\x18" + number
            append(tag + _varint(len(pair)) + pair)
            continue
        append(_length_delimited(tag, _key_value(key, value)))
    return b"".join(parts)


def _counted_attributes(tag: bytes, dropped_tag: bytes, attributes: Any) -> bytes:
    """A span's, event's or link's attributes (field `tag`) and, when the SDK's limits dropped
    some, their count (field `dropped_tag`)."""
    encoded = _attributes(tag, attributes)
    dropped = _dropped(attributes)
    return encoded + dropped_tag + _varint(dropped) if dropped else encoded


def _dropped(container: Any) -> int:
    """What the SDK's bounded containers counted as dropped (plain ones drop nothing)."""
    kind = type(container)
    if kind is dict or kind is list or kind is tuple or container is None:
        return 0
    return getattr(container, "dropped", 0)


def _flags(parent: SpanContext | None) -> bytes:
    flags = _FLAGS_HAS_IS_REMOTE
    if parent is not None and parent.is_remote:
        flags |= _FLAGS_IS_REMOTE
    return _pack_fixed32(flags)


_SPAN_FLAGS_LOCAL = b"\x85\x01" + _flags(None)  # Span.flags of a root or a local parent
_SPAN_FLAGS_REMOTE = b"\x85\x01" + _pack_fixed32(_FLAGS_HAS_IS_REMOTE | _FLAGS_IS_REMOTE)
_LINK_FLAGS_LOCAL = b"\x35" + _flags(None)
_LINK_FLAGS_REMOTE = b"\x35" + _pack_fixed32(_FLAGS_HAS_IS_REMOTE | _FLAGS_IS_REMOTE)
_UNSET_STATUS = b"\x7a\x00"  # an empty Status message
_name_cache: dict[str, bytes] = {}  # span name -> its Span.name field (names repeat; bounded)
_kind_cache: dict[Any, bytes] = {}  # SDK SpanKind -> the Span.kind field


def _trace_state(context: SpanContext) -> str:
    state = context.trace_state
    return ",".join(f"{k}={v}" for k, v in state.items()) if state else ""


def encode_span(span: ReadableSpan) -> bytes:
    """One Span message (trace.proto's field numbers, in order).

    Reads a ReadableSpan's fields directly (its properties copy the events and links into
    tuples and wrap the attributes on every read); anything else through its properties."""
    if type(span) is ReadableSpan:
        context, parent, name, kind = span._context, span._parent, span._name, span._kind
        attributes, events, links = span._attributes, span._events, span._links
        start, end, status = span._start_time, span._end_time, span._status
    else:
        context, parent, name, kind = span.get_span_context(), span.parent, span.name, span.kind
        attributes, events, links = span.attributes, span.events, span.links
        start, end, status = span.start_time, span.end_time, span.status
    assert context is not None
    parts = [
        b"\x0a\x10" + context.trace_id.to_bytes(16, "big"),
        b"\x12\x08" + context.span_id.to_bytes(8, "big"),
    ]
    if context.trace_state:
        parts.append(_string(b"\x1a", _trace_state(context)))
    if parent is not None:
        parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
    name_field = _name_cache.get(name)
    if name_field is None:
        name_field = _string(b"\x2a", name)
        if len(_name_cache) < 4096:
            _name_cache[name] = name_field
    parts.append(name_field)
    kind_field = _kind_cache.get(kind)
    if kind_field is None:
        kind_field = _kind_cache[kind] = b"\x30" + _varint(_KINDS[kind.value])
    parts.append(kind_field)
    parts.append(b"\x39" + _pack_fixed64(start or 0))
    parts.append(b"\x41" + _pack_fixed64(end or 0))
    if attributes:
        parts.append(_counted_attributes(b"\x4a", b"\x50", attributes))
    if events:
        for event in events:
            body = b"\x09" + _pack_fixed64(event.timestamp) + _string(b"\x12", event.name)
            body += _counted_attributes(b"\x1a", b"\x20", event.attributes)
            parts.append(_length_delimited(b"\x5a", body))
        dropped = _dropped(events)
        if dropped:
            parts.append(b"\x60" + _varint(dropped))
    if links:
        for link in links:
            link_context = link.context
            body = b"\x0a\x10" + link_context.trace_id.to_bytes(16, "big")
            body += b"\x12\x08" + link_context.span_id.to_bytes(8, "big")
            body += _counted_attributes(b"\x22", b"\x28", link.attributes)
            body += _LINK_FLAGS_REMOTE if link_context.is_remote else _LINK_FLAGS_LOCAL
            parts.append(_length_delimited(b"\x6a", body))
        dropped = _dropped(links)
        if dropped:
            parts.append(b"\x70" + _varint(dropped))
    code = status.status_code.value
    if code == 0 and not status.description:
        parts.append(_UNSET_STATUS)
    else:
        status_body = b""
        if status.description:
            status_body += _string(b"\x12", status.description)
        if code:
            status_body += b"\x18" + _varint(code)
        parts.append(_length_delimited(b"\x7a", status_body))
    parts.append(
        _SPAN_FLAGS_REMOTE if parent is not None and parent.is_remote else _SPAN_FLAGS_LOCAL
    )
    return b"".join(parts)


def encode_spans(spans: Sequence[ReadableSpan]) -> bytes:
    """An ExportTraceServiceRequest: spans grouped by resource, then by instrumentation scope
    (by identity: a provider's spans share one Resource object)."""
    groups: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
    for span in spans:
        if type(span) is ReadableSpan:
            resource, scope = span._resource, span._instrumentation_scope
        else:
            resource, scope = span.resource, span.instrumentation_scope
        scopes = groups.setdefault(id(resource), (resource, {}))[1]
        scopes.setdefault(id(scope), (scope, []))[1].append(encode_span(span))
    request = []
    for resource, scopes in groups.values():
        body = _resource_field(resource)
        for scope, encoded in scopes.values():
            scope_spans = _scope_field(scope)
            scope_spans += b"".join(_length_delimited(b"\x12", s) for s in encoded)
            if scope is not None and scope.schema_url:
                scope_spans += _string(b"\x1a", scope.schema_url)
            body += _length_delimited(b"\x12", scope_spans)
        if resource.schema_url:
            body += _string(b"\x1a", resource.schema_url)
        request.append(_length_delimited(b"\x0a", body))
    return b"".join(request)


# Resources and scopes are immutable and few (one a provider, one a tracer): each is encoded
# once. Keyed by identity, the object kept beside its bytes so that its id is never reused.
_resource_fields: dict[int, tuple[Any, bytes]] = {}
_scope_fields: dict[int, tuple[Any, bytes]] = {}
_MAX_CACHED = 256


def _resource_field(resource: Any) -> bytes:
    cached = _resource_fields.get(id(resource))
    if cached is not None and cached[0] is resource:
        return cached[1]
    field = _length_delimited(b"\x0a", _attributes(b"\x0a", resource.attributes))
    if len(_resource_fields) < _MAX_CACHED:
        _resource_fields[id(resource)] = (resource, field)
    return field


def _scope_field(scope: Any) -> bytes:
    """ScopeSpans.scope (an InstrumentationScope message, empty for None)."""
    cached = _scope_fields.get(id(scope))
    if cached is not None and cached[0] is scope:
        return cached[1]
    body = b""
    if scope is not None:
        body = _string(b"\x0a", scope.name) if scope.name else b""
        if scope.version:
            body += _string(b"\x12", scope.version)
        body += _attributes(b"\x1a", scope.attributes)
    field = _length_delimited(b"\x0a", body)
    if len(_scope_fields) < _MAX_CACHED:
        _scope_fields[id(scope)] = (scope, field)
    return field


def fast_otlp_http_exporter(endpoint: str) -> Any:
    """The SDK's OTLP/HTTP span exporter (its retries, timeouts, headers and compression from
    the OTEL_EXPORTER_OTLP_* variables) with this encoder in place of the SDK's."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    class FastOTLPSpanExporter(OTLPSpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            client = getattr(self, "_client", None)
            if getattr(self, "_shutdown", False) or client is None:
                return super().export(spans)  # an SDK whose internals moved: its own encoder
            try:
                data = encode_spans(spans)
            except Exception:  # a value no encoder takes: let the SDK's say why
                return super().export(spans)
            result = client.export(data)
            return SpanExportResult.SUCCESS if result.success else SpanExportResult.FAILURE

    from observability.otlp_http import exporter_kwargs

    kwargs = exporter_kwargs(endpoint)
    if kwargs:
        try:
            return FastOTLPSpanExporter(endpoint=endpoint, **kwargs)
        except TypeError:  # an SDK without the transport parameter
            pass
    return FastOTLPSpanExporter(endpoint=endpoint)
