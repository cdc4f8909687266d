"""Structured outputs at the gateway: response_format and structured_outputs become one compiled
grammar on the wire (services.wire.messages.StructuredOutput), and a bad schema, regex, grammar or
combination is a 400 naming the field, with nothing enqueued."""

from __future__ import annotations

import json

import llguidance
import pytest

from gateway.structured import close_objects
from gateway.support import STRUCTURED_OUTPUTS_FIELDS
from tests.gateway.helpers import assert_error
from tests.gateway.test_field_walk import MODELS

CHAT = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_every_structured_outputs_field_has_a_decision():
    assert set(MODELS["structured_outputs"]) == set(STRUCTURED_OUTPUTS_FIELDS)


@pytest.mark.parametrize(
    ("route", "extra", "kind"),
    [
        ("/v1/completions", {"response_format": {"type": "json_object"}}, "json_object"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            "json",
        ),
        ("/v1/completions", {"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json"),
        ("/v1/completions", {"structured_outputs": {"regex": "[ab]+"}}, "regex"),
        ("/v1/chat/completions", {"structured_outputs": {"choice": ["yes", "no"]}}, "choice"),
        ("/v1/completions", {"structured_outputs": {"grammar": 'start: "x" | "y"'}}, "grammar"),
        ("/v1/completions", {"structured_outputs": {"grammar": 'root ::= "x" | "y"'}}, "grammar"),
    ],
)  # fmt: skip
async def test_the_constraint_travels_compiled(start_gateway, start_ledger, route, extra, kind):
    ledger = await start_ledger()
    client = await start_gateway()
    base = {"prompt": "Hi"} if route == "/v1/completions" else {"messages": CHAT}
    resp = await client.post(route, json={**base, "max_tokens": 4, **extra})
    assert resp.status == 200, await resp.text()
    (request,) = ledger.requests
    structured = request.sampling.structured
    assert structured is not None and structured.kind == kind
    assert llguidance.LLMatcher.validate_grammar(structured.grammar, None) == ""


async def test_text_format_asks_for_nothing(start_gateway, start_ledger):
    ledger = await start_ledger()
    client = await start_gateway()
    body = {"prompt": "Hi", "max_tokens": 4, "response_format": {"type": "text"}}
    assert (await client.post("/v1/completions", json=body)).status == 200
    assert ledger.requests[0].sampling.structured is None


@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        ({"structured_outputs": {"json": {"type": "foo"}}}, "structured_outputs.json", "foo"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
        ({"structured_outputs": {"json": [1]}}, "structured_outputs.json", "schema object"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "non-empty"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
        ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice", "strings"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar", "undefined_rule"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object", "true"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": "a+"}, "structured_outputs", "object"),
        ({"structured_outputs": {"regex": "a", "frob": 1}}, "structured_outputs.frob", "unknown"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", "not supported"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
        ({"structured_outputs": {"regex": "a", "disable_any_whitespace": 1}}, "structured_outputs.disable_any_whitespace", "boolean"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "'json_schema' field"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}, "response_format", "foo"),
        ({"response_format": {"type": "xml"}}, "response_format", "must be one of"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "not supported"),
        ({"response_format": "json"}, "response_format", "object"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format", "one kind"),
    ],
)  # fmt: skip
async def test_bad_constraints_are_refused_by_name(
    start_gateway, start_ledger, extra, param, fragment
):
    ledger = await start_ledger()
    client = await start_gateway()
    for route, base in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ):
        resp = await client.post(route, json={**base, **extra})
        assert resp.status == 400, await resp.text()
        assert_error(await resp.json(), param, fragment)
    assert ledger.requests == []


async def test_response_format_keeps_structured_outputs_options(start_gateway, start_ledger):
    ledger = await start_ledger()
    client = await start_gateway()
    body = {
        "prompt": "Hi",
        "max_tokens": 4,
        "response_format": {"type": "json_object"},
        "structured_outputs": {"disable_any_whitespace": True},
    }
    assert (await client.post("/v1/completions", json=body)).status == 200
    grammar = json.loads(ledger.requests[0].sampling.structured.grammar)
    (compiled,) = grammar["grammars"]
    assert compiled["json_schema"] == {
        "type": "object",
        "x-guidance": {"whitespace_flexible": False},
    }


def test_disable_additional_properties_closes_every_listed_object():
    schema = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"x": {"type": "string"}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "list": {"type": "array", "items": {"properties": {"y": {}}}},
        },
        "$defs": {"d": {"properties": {"z": {}}}},
        "examples": [{"properties": {}}],
    }
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["properties"]["list"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed["examples"] == [{"properties": {}}]  # data, not a schema
