"""Hypothesis strategies from the gateway's own /openapi.json request schemas (the subset of JSON
Schema that gateway/openapi.py writes), plus mutations that break them: wrong types, huge and
tiny numbers, nested junk, unknown and missing fields, bodies that are not JSON objects at all.

Strings include lone surrogates ("\\ud800" in JSON): the gateway must answer them with a 400
naming the field, like any other bad value.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

# Hypothesis' text() leaves surrogates out: some strings get a lone one on purpose.
TEXT = st.one_of(
    st.text(max_size=40),
    st.text(max_size=40),
    st.text(max_size=40),
    st.tuples(st.text(max_size=20), st.integers(0xD800, 0xDFFF)).map(lambda t: t[0] + chr(t[1])),
)
HUGE_INTS = st.sampled_from([2**31, 2**53 + 1, 2**63, 2**64, 10**30, -(2**63) - 1, -(10**30)])
EDGE_FLOATS = st.sampled_from([1e-300, -1e-300, 1e308, -1e308, 5e-324, 0.0, -0.0, 1e-45])
MAX_OPTIONAL_FIELDS = 6  # a body with every optional field would only ever hit the first 400


def junk(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Any JSON value, nested, with extreme numbers."""
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(), HUGE_INTS, EDGE_FLOATS,
        st.floats(allow_nan=False, allow_infinity=False), TEXT,
    )  # fmt: skip
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)
        ),
        max_leaves=max_leaves,
    )


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid for `schema` (type, anyOf, enum, const, bounds, items, properties)."""
    if "anyOf" in schema:
        return st.one_of(*(from_schema(option) for option in schema["anyOf"]))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of(*(from_schema({**schema, "type": one}) for one in kind))
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        low = schema.get("minimum")
        if "exclusiveMinimum" in schema:
            low = schema["exclusiveMinimum"] + 1
        ints = st.integers(low, schema.get("maximum"))
        # Small values reach the engine; large ones probe the limits.
        small = st.integers(
            max(low if low is not None else -3, -3), min(schema.get("maximum", 40), 40)
        )
        return st.one_of(small, ints)
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(
            low, schema.get("maximum"), allow_nan=False, allow_infinity=False,
            exclude_min="exclusiveMinimum" in schema,
        )  # fmt: skip
    if kind == "string":
        return st.text(
            alphabet=st.characters(exclude_categories=("Cs",)),
            min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 40), 40),
        )  # fmt: skip
    if kind == "array":
        items = from_schema(schema.get("items", {}))
        return st.lists(
            items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 4), 4)
        )
    if kind == "object":
        return object_strategy(schema)
    return junk()


def object_strategy(schema: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    properties: dict[str, Any] = schema.get("properties", {})
    required = schema.get("required", [])
    extra = schema.get("additionalProperties")
    optional = sorted(set(properties) - set(required))

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        value = {name: draw(from_schema(properties[name])) for name in required}
        if optional:
            names = draw(
                st.lists(st.sampled_from(optional), max_size=MAX_OPTIONAL_FIELDS, unique=True)
            )
            value |= {name: draw(from_schema(properties[name])) for name in names}
        if isinstance(extra, dict):
            value |= draw(st.dictionaries(TEXT, from_schema(extra), max_size=3))
        elif extra is None and not properties:
            value |= draw(st.dictionaries(TEXT, junk(4), max_size=3))
        return value

    return build()


def valid_body(schema: dict[str, Any]) -> st.SearchStrategy[bytes]:
    return from_schema(schema).map(lambda body: json.dumps(body).encode())


@st.composite
def invalid_body(draw: st.DrawFn, schema: dict[str, Any]) -> bytes:
    """A valid body with one thing broken, or something that is not a body at all."""
    body = draw(from_schema(schema))
    names = sorted(schema["properties"])
    how = draw(
        st.sampled_from(
            ["wrong_type", "huge", "unknown_field", "drop_required", "not_object", "bytes",
             "truncated", "constant", "deep"]
        )
    )  # fmt: skip
    if how == "wrong_type":
        body[draw(st.sampled_from(names))] = draw(junk())
    elif how == "huge":
        body[draw(st.sampled_from(names))] = draw(st.one_of(HUGE_INTS, EDGE_FLOATS))
    elif how == "unknown_field":
        body[draw(TEXT.filter(lambda key: key not in schema["properties"]))] = draw(junk(4))
    elif how == "drop_required":
        for name in schema["required"]:
            body.pop(name, None)
    elif how == "not_object":
        return json.dumps(draw(junk().filter(lambda value: not isinstance(value, dict)))).encode()
    elif how == "bytes":
        return draw(st.binary(max_size=64))
    elif how == "truncated":
        raw = json.dumps(body).encode()
        return raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif how == "constant":  # Python's json writes these; JSON has no such values
        body[draw(st.sampled_from(names))] = draw(
            st.sampled_from([float("nan"), float("inf"), float("-inf")])
        )
    elif how == "deep":
        depth = draw(st.sampled_from([50, 500, 5000]))
        return b'{"prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"
    return json.dumps(body).encode()
