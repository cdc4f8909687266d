"""/openapi.json: every route and every request body, built from the field tables of
`gateway.support`, so the document cannot drift from what the gateway accepts (a test checks
that every table field has a schema here).
"""

from __future__ import annotations

from typing import Any

from gateway.support import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DETOKENIZE_FIELDS,
    RESPONSES_FIELDS,
    STREAM_OPTIONS_FIELDS,
    STRUCTURED_OUTPUTS_FIELDS,
    TOKENIZE_FIELDS,
    FieldSupport,
)

_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
_OBJ = {"type": "object"}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_STRS = {"type": "array", "items": _STR}
_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": _STR},
    "required": ["type", "text"],
}
_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [_STR, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]},
        "name": _STR,
    },
    "required": ["role"],
}

# The keys gateway.structured reads; exactly one constraint (json .. grammar) per request.
STRUCTURED_SCHEMAS: dict[str, dict[str, Any]] = {
    "json": {"anyOf": [_OBJ, _STR]}, "json_object": {"const": True}, "regex": _STR,
    "choice": {"type": "array", "items": _STR, "minItems": 1}, "grammar": _STR,
    "disable_any_whitespace": _BOOL, "disable_additional_properties": _BOOL,
    "whitespace_pattern": _STR, "structural_tag": {"anyOf": [_STR, _OBJ]},
}  # fmt: skip
_RESPONSE_FORMAT = {
    "description": "OpenAI's response_format; other than text it overrides structured_outputs "
    "(asking for another constraint there as well is a 400)",
    "oneOf": [
        {
            "type": "object",
            "properties": {"type": {"enum": ["text", "json_object"]}},
            "required": ["type"],
        },
        {
            "type": "object",
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "properties": {
                        "name": _STR,
                        "description": _STR,
                        "strict": _BOOL,
                        "schema": {**_OBJ, "description": "the JSON schema the output matches"},
                    },
                },
            },
            "required": ["type", "json_schema"],
        },
    ],
}

FIELD_SCHEMAS: dict[str, dict[str, Any]] = {
    "model": _STR, "prompt": {"anyOf": [_STR, _IDS, _STRS, {"type": "array", "items": _IDS}]},
    "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
    "max_tokens": {"type": "integer", "minimum": 1},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1}, "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": _INT, "stop": {"anyOf": [_STR, {"type": "array", "items": _STR, "maxItems": 4}]},
    "stop_token_ids": _IDS, "include_stop_str_in_output": _BOOL, "ignore_eos": _BOOL,
    "min_tokens": {"type": "integer", "minimum": 0}, "skip_special_tokens": _BOOL,
    "spaces_between_special_tokens": _BOOL, "stream": _BOOL,
    "stream_options": {"type": "object", "properties": {k: _BOOL for k in STREAM_OPTIONS_FIELDS}},
    "stream_interval": {"type": "integer", "minimum": 1},
    "truncate_prompt_tokens": {"type": "integer", "minimum": -1},
    "truncation_side": {"enum": ["left", "right"]}, "priority": _INT, "request_id": _STR,
    "session_id": _STR, "user": _STR, "cache_salt": {"type": "string", "minLength": 1, "maxLength": 128},
    "return_token_ids": _BOOL, "use_beam_search": _BOOL, "length_penalty": _NUM,
    "watermarking": _BOOL, "n": {"type": "integer", "minimum": 1},
    "best_of": {"type": "integer", "minimum": 1},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
    "logit_bias": {"type": "object", "additionalProperties": _NUM},
    "bad_words": _STRS, "allowed_token_ids": _IDS,
    "logprobs": {"anyOf": [_INT, _BOOL]}, "top_logprobs": {"type": "integer", "minimum": -1},
    "prompt_logprobs": {"type": "integer", "minimum": -1}, "logprob_token_ids": _IDS,
    "return_tokens_as_token_ids": _BOOL, "response_format": _RESPONSE_FORMAT,
    "repetition_detection": _OBJ, "thinking_token_budget": _INT, "vllm_xargs": _OBJ,
    "kv_transfer_params": _OBJ, "ec_transfer_params": _OBJ, "return_weight_versions": _BOOL,
    "routed_experts_prompt_start": {"type": "integer", "minimum": 0},
    "return_token_offsets": _BOOL, "mm_payload": {"enum": ["tensors", "none"]},
    "return_mm_kwargs": _BOOL, "echo": _BOOL, "add_special_tokens": _BOOL, "suffix": _STR,
    "prompt_embeds": {"anyOf": [_STR, _STRS]}, "add_generation_prompt": _BOOL,
    "continue_final_message": _BOOL,
    "documents": {"type": "array", "items": {"type": "object", "additionalProperties": _STR}},
    "chat_template_kwargs": _OBJ,
    "reasoning_effort": {"enum": ["none", "minimal", "low", "medium", "high", "xhigh", "max"]},
    "return_prompt_text": _BOOL, "chat_template": _STR, "tools": {"type": "array", "items": _OBJ},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, _OBJ]},
    "parallel_tool_calls": _BOOL, "include_reasoning": _BOOL, "media_io_kwargs": _OBJ,
    "mm_processor_kwargs": _OBJ, "return_token_strs": _BOOL, "tokens": _IDS,
}  # fmt: skip

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": _STR,
                "type": _STR,
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},  # the HTTP status, as vLLM
            },
        }
    },
}


def body_schema(table: dict[str, FieldSupport], required: list[str]) -> dict[str, Any]:
    return {**_object(table, FIELD_SCHEMAS), "required": required}


def _object(table: dict[str, FieldSupport], schemas: dict[str, dict[str, Any]]) -> dict[str, Any]:
    properties = {}
    for name, support in table.items():
        schema = dict(schemas[name])
        prefix = "Refused unless it asks for nothing: " if support.refused else ""
        described = schema.get("description")
        schema["description"] = prefix + support.note + (f" ({described})" if described else "")
        properties[name] = schema
    return {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,  # unknown fields get a 400
    }


# After FIELD_SCHEMAS and _object, which it is built from.
FIELD_SCHEMAS["structured_outputs"] = _object(STRUCTURED_OUTPUTS_FIELDS, STRUCTURED_SCHEMAS)


def _described(table: dict[str, FieldSupport]) -> dict[str, Any]:
    """A body whose fields are described by their support notes alone (no value schemas)."""
    properties = {
        name: {
            "description": ("Refused unless it asks for nothing: " if s.refused else "") + s.note
        }
        for name, s in table.items()
    }
    return {"type": "object", "properties": properties, "additionalProperties": False}


def _post(summary: str, schema: dict[str, Any], answer: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": _responses(answer),
        }
    }


def _get(summary: str, answer: str = "application/json") -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": _responses(answer)}}


def _responses(answer: str) -> dict[str, Any]:
    content = {answer: {"schema": _OBJ if answer == "application/json" else _STR}}
    error = {
        "description": "an OpenAI-style error",
        "content": {"application/json": {"schema": _ERROR}},
    }
    return {"200": {"description": "OK", "content": content}, "4XX": error, "5XX": error}


def openapi_document(version: str) -> dict[str, Any]:
    tokenize_schema = {
        "anyOf": [
            body_schema({k: v for k, v in TOKENIZE_FIELDS.items() if k != "messages"}, ["prompt"]),
            body_schema({k: v for k, v in TOKENIZE_FIELDS.items() if k != "prompt"}, ["messages"]),
        ]
    }
    ping = _get("200 while a ledger with workers serves, 503 otherwise", "text/plain")
    ping["post"] = ping["get"]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kvledger gateway (OpenAI-compatible, vLLM 0.33 fields)",
            "version": version,
        },
        "paths": {
            "/v1/responses": _post(
                "the Responses API (stream: server-sent events)",
                _described(RESPONSES_FIELDS),
                "application/json",
            ),
            "/v1/responses/{response_id}": _get("a stored response (--enable-responses-store)"),
            "/v1/completions": _post(
                "text completion (stream: server-sent events)",
                body_schema(COMPLETION_FIELDS, ["prompt"]),
                "application/json",
            ),
            "/v1/chat/completions": _post(
                "chat completion (stream: server-sent events)",
                body_schema(CHAT_FIELDS, ["messages"]),
                "application/json",
            ),
            "/v1/models": _get("the served model"),
            "/v1/models/{model_id}": {
                "get": {
                    **_get("one model card, 404 for another name")["get"],
                    "parameters": [
                        {"name": "model_id", "in": "path", "required": True, "schema": _STR}
                    ],
                }
            },
            "/tokenize": _post(
                "token ids of a prompt or a chat", tokenize_schema, "application/json"
            ),
            "/detokenize": _post(
                "text of token ids", body_schema(DETOKENIZE_FIELDS, ["tokens"]), "application/json"
            ),
            "/version": _get("the kvledger version"),
            "/ping": ping,
            "/health": _get("liveness, the ledger's status and the active settings"),
            "/metrics": _get("Prometheus metrics", "text/plain"),
            "/openapi.json": _get("this document"),
        },
    }
