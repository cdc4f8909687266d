"""Structured outputs: `response_format` (json_object, json_schema) and vLLM's
`structured_outputs` (json, json_object, regex, choice, grammar) compiled into llguidance's
grammar text, pure. The grammar is validated here, so a bad schema, regex or grammar is a 400
naming the field; the worker builds one matcher per request from the compiled text and masks
the logits with it every step (`gpu_worker.structured`).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import llguidance

from gateway.fields import bad_request, read_bool, short, type_name
from gateway.support import STRUCTURED_OUTPUTS_FIELDS, check_fields
from services.wire.messages import StructuredOutput

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def read_structured(body: dict[str, Any]) -> StructuredOutput | None:
    """The request's constraint, compiled; None when it asks for none (vLLM's merge:
    a response_format other than text overrides the constraint of structured_outputs)."""
    options = body.get("structured_outputs")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request(
                f"'structured_outputs' must be an object, got {type_name(options)}",
                "structured_outputs",
            )
        check_fields(options, STRUCTURED_OUTPUTS_FIELDS, "structured_outputs.")
    override = _read_response_format(body.get("response_format"))
    if options is None and override is None:
        return None
    merged = dict(options or {})
    where = "structured_outputs"
    if override is not None:
        key, value = override
        given = [k for k in CONSTRAINTS if merged.get(k) is not None and k != key]
        if given:
            raise bad_request(
                f"'response_format' asks for {key} but 'structured_outputs.{given[0]}' asks for "
                "another constraint: use one kind of structured outputs constraint",
                "response_format",
            )
        merged[key] = value
        where = "response_format"
    kinds = [k for k in CONSTRAINTS if merged.get(k) is not None]
    if len(kinds) != 1:
        raise bad_request(
            "'structured_outputs' must set exactly one constraint of "
            f"{', '.join(CONSTRAINTS[:-1])}; got {', '.join(kinds) or 'none'}",
            "structured_outputs",
        )
    kind = kinds[0]
    param = f"{where}.{kind}" if where == "structured_outputs" else where
    flexible = not read_bool(
        merged, "disable_any_whitespace", param="structured_outputs.disable_any_whitespace"
    )
    closed = read_bool(
        merged,
        "disable_additional_properties",
        param="structured_outputs.disable_additional_properties",
    )
    grammar = _compile(kind, merged[kind], param, flexible, closed)
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    if error:
        raise bad_request(f"'{param}' is not a valid {kind} constraint: {error.strip()}", param)
    return StructuredOutput(kind=kind, grammar=grammar)


def json_schema_output(schema: dict[str, Any], param: str) -> StructuredOutput:
    """A JSON schema the output must match (tool calls, the Responses API's text.format),
    compiled and validated; a bad schema is a 400 naming `param`."""
    grammar = _json_grammar(schema, True, param)
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    if error:
        raise bad_request(f"'{param}' is not a valid json constraint: {error.strip()}", param)
    return StructuredOutput(kind="json", grammar=grammar)


def _read_response_format(value: Any) -> tuple[str, Any] | None:
    """(constraint, value) that response_format asks for, or None for text / absent."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(
            f"'response_format' must be an object, got {type_name(value)}", "response_format"
        )
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", True
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                "When response_format type is 'json_schema', the 'json_schema' field must be "
                "provided.",
                "response_format",
            )
        # OpenAI's field is `schema`; vLLM's model also takes its python name `json_schema`.
        schema = spec.get("schema", spec.get("json_schema"))
        return "json", {} if schema is None else schema
    if kind == "structural_tag":
        raise bad_request(
            "'response_format' of type 'structural_tag' is not supported by kvledger",
            "response_format",
        )
    raise bad_request(
        f"'response_format.type' must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, "
        f"got {short(kind)}",
        "response_format",
    )


def _compile(kind: str, value: Any, param: str, flexible: bool, closed: bool) -> str:
    matcher = llguidance.LLMatcher
    if kind == "json":
        schema = _schema(value, param)
        if closed:
            schema = close_objects(copy.deepcopy(schema))
        return _json_grammar(schema, flexible, param)
    if kind == "json_object":
        if value is not True:
            raise bad_request(f"'{param}' must be true, got {short(value)}", param)
        return _json_grammar({"type": "object"}, flexible, param)
    if kind == "regex":
        return matcher.grammar_from_regex(_text(value, param))
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise bad_request(f"'{param}' must be a non-empty list of strings", param)
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if kind == "grammar":
        try:
            return llguidance.grammar_from("grammar", _text(value, param))  # Lark or GBNF
        except ValueError as exc:
            raise bad_request(f"'{param}' is not a valid grammar: {exc}", param) from None
    raise bad_request(f"'{param}': structural tags are not supported by kvledger", param)


def _schema(value: Any, param: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise bad_request(f"'{param}' is not valid JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must be a JSON schema object, got {type_name(value)}", param)
    return value


def _json_grammar(schema: dict[str, Any], flexible: bool, param: str) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": flexible}
        )
    except (ValueError, TypeError) as exc:
        raise bad_request(f"'{param}' is not a valid JSON schema: {exc}", param) from None


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{param}' must be a non-empty string, got {short(value)}", param)
    return value


_DATA_KEYS = ("enum", "const", "default", "examples")  # JSON values, not schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema that lists its properties and
    says nothing of others gets additionalProperties false, at any depth (in place)."""
    if isinstance(schema, list):
        for item in schema:
            close_objects(item)
    elif isinstance(schema, dict):
        for key, value in schema.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                for sub in value.values():
                    close_objects(sub)
            elif isinstance(value, dict | list) and key not in _DATA_KEYS:
                close_objects(value)
        lists_properties = isinstance(schema.get("properties"), dict) or isinstance(
            schema.get("patternProperties"), dict
        )
        if lists_properties and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    return schema
