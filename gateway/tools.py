"""Tool calling on /v1/chat/completions, pure: the request's `tools`, `tool_choice` and
`parallel_tool_calls` checked as vLLM 0.33 checks them, what the choice asks of the output
(`required` and a named function: the structured outputs' JSON schema of the tools), and the
answer's tool calls and finish reason.

The gateway's flags are vLLM's: `--tool-call-parser` names the output format (needed by every
choice but `none`), `--enable-auto-tool-choice` lets the model call tools by itself (`auto`,
the default with tools). With `none` the tools still reach the chat template and the answer is
plain content.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from gateway.fields import bad_request, read_bool, short, type_name
from gateway.structured import json_schema_output
from gateway.tool_parsers import (
    PARSERS,
    MistralParser,
    NamedChoice,
    RequiredChoice,
    ToolParser,
    ToolStream,
)
from services.tokenization.tokenizer import Tokenizer
from services.wire.messages import StructuredOutput

TOOL_CHOICES = ("none", "auto", "required")
_TOOL_KEYS = ("type", "function", "defer_loading")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict", "defer_loading")
NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


class ConfigProblem(ValueError):
    """The tool flags cannot serve this tokenizer (raised at start-up)."""


@dataclass(frozen=True, slots=True)
class ToolSettings:
    """The gateway's tool flags, checked against its tokenizer once."""

    parser: type[ToolParser] | None = None
    enable_auto: bool = False
    tokens: frozenset[str] = frozenset()  # the parser's special tokens the vocabulary has

    @classmethod
    def of(cls, parser_name: str | None, enable_auto: bool, tokenizer: Tokenizer) -> ToolSettings:
        if enable_auto and parser_name is None:
            raise ConfigProblem(
                "--enable-auto-tool-choice needs --tool-call-parser (KVLEDGER_TOOL_CALL_PARSER): "
                f"one of {', '.join(PARSERS)}"
            )
        if parser_name is None:
            return cls(enable_auto=enable_auto)
        parser = PARSERS[parser_name]
        known = [MistralParser.ARGS, *parser.required_tokens]
        tokens = frozenset(t for t in known if tokenizer.token_id(t) is not None)
        missing = [t for t in parser.required_tokens if t not in tokens]
        if missing:
            raise ConfigProblem(
                f"--tool-call-parser {parser_name} reads the token {missing[0]!r}, which model "
                f"{tokenizer.name!r}'s tokenizer does not have"
            )
        return cls(parser, enable_auto, tokens)

    def new_parser(self) -> ToolParser:
        assert self.parser is not None
        return self.parser(self.tokens.__contains__)


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A chat request's tools and what its tool_choice asks for."""

    tools: list[dict[str, Any]]  # as the chat template gets them
    choice: str  # "none", "auto", "required" or "named"
    function: str | None = None  # the named function
    parallel: bool | None = None  # parallel_tool_calls; only false changes anything
    reads_calls: bool = False  # calls are read from the output (a parser, and not "none")

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")


def read_tools(
    body: dict[str, Any], settings: ToolSettings, refuse_unread: bool = True
) -> ToolRequest | None:
    """The request's tools (None without any), refused with vLLM's messages. A choice the flags
    cannot read is refused as vLLM's chat endpoint does (`refuse_unread`), or answered as plain
    content as its Responses endpoint does."""
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        parallel = read_bool(body, "parallel_tool_calls")
    tools = body.get("tools")
    choice_value = body.get("tool_choice")
    if tools is None:
        if choice_value not in (None, "none"):
            raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return None
    if tools == []:
        raise bad_request(
            "`tools` must not be an empty array. Either provide at least one tool or omit the "
            "field entirely.",
            "tools",
        )
    if not isinstance(tools, list):
        raise bad_request(f"'tools' must be a list of tools, got {type_name(tools)}", "tools")
    template_tools = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    names = [t["function"]["name"] for t in template_tools]
    choice, function = _choice("auto" if choice_value is None else choice_value, names)
    if choice == "none":
        return ToolRequest(template_tools, choice, parallel=parallel)
    if refuse_unread:
        _check_flags(choice, function, settings)
    if choice == "named" and _has_constraint(body):
        raise bad_request(
            "You can only either use constraints for structured outputs or tools, not both.",
            "tool_choice",
        )
    reads = settings.parser is not None and (choice != "auto" or settings.enable_auto)
    return ToolRequest(template_tools, choice, function, parallel, reads)


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise bad_request(f"'{where}' must be an object with 'type' and 'function'", where)
    for key, value in tool.items():
        if key not in _TOOL_KEYS:
            raise bad_request(f"unknown field '{where}.{key}' in a tool", f"{where}.{key}")
        if key == "defer_loading" and value:
            raise bad_request(f"'{where}.defer_loading' is not supported by kvledger: tool "
                              "search is not served", f"{where}.defer_loading")  # fmt: skip
    if tool.get("type", "function") != "function":
        raise bad_request(
            f"'{where}.type' must be 'function', got {short(tool.get('type'))}", f"{where}.type"
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"'{where}.function' must be an object", f"{where}.function")
    for key, value in function.items():
        param = f"{where}.function.{key}"
        if key not in _FUNCTION_KEYS:
            raise bad_request(f"unknown field '{param}' in a function", param)
        if key == "defer_loading" and value:
            raise bad_request(f"'{param}' is not supported by kvledger: tool search is not "
                              "served", param)  # fmt: skip
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"'{where}.function.name' must be a non-empty string",
                          f"{where}.function.name")  # fmt: skip
    description, parameters = function.get("description"), function.get("parameters")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"'{where}.function.description' must be a string",
                          f"{where}.function.description")  # fmt: skip
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"'{where}.function.parameters' must be a JSON schema object",
                          f"{where}.function.parameters")  # fmt: skip
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"'{where}.function.strict' must be a boolean",
                          f"{where}.function.strict")  # fmt: skip
    # What vLLM hands the template: name, description and parameters (None when absent).
    shown: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if strict is not None:
        shown["strict"] = strict
    return {"type": "function", "function": shown}


def _choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    if isinstance(value, str):
        if value in TOOL_CHOICES:
            return value, None
        raise bad_request(
            f'Invalid value for `tool_choice`: {value}! Only named tools, "none", "auto" or '
            '"required" are supported.',
            "tool_choice",
        )
    if not isinstance(value, dict):
        raise bad_request(
            f'Invalid value for `tool_choice`: {short(value)}! Only named tools, "none", '
            '"auto" or "required" are supported.',
            "tool_choice",
        )
    function = value.get("function")
    if not isinstance(function, dict):
        raise bad_request(
            f"Invalid value for `function`: `{short(function)}` in `tool_choice`! " + NAMED_USAGE,
            "tool_choice.function",
        )
    if "name" not in function:
        raise bad_request(
            "Expected field `name` in `function` in `tool_choice`! " + NAMED_USAGE,
            "tool_choice.function.name",
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise bad_request(
            f"Invalid `name` in `function`: `{short(name)}` in `tool_choice`! " + NAMED_USAGE,
            "tool_choice.function.name",
        )
    if name not in names:
        raise bad_request(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            "tool_choice",
        )
    return "named", name


def _check_flags(choice: str, function: str | None, settings: ToolSettings) -> None:
    """vLLM's refusals when the server's flags cannot read the calls asked for."""
    if settings.parser is not None:
        return
    if choice == "auto":
        if not settings.enable_auto:
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                "tool_choice",
            )
        return
    described = f'function "{function}"' if choice == "named" else f'"{choice}"'
    raise bad_request(
        f"tool_choice={described} requires --tool-call-parser to be set", "tool_choice"
    )


def _has_constraint(body: dict[str, Any]) -> bool:
    options = body.get("structured_outputs")
    return isinstance(options, dict) and any(
        options.get(k) is not None for k in ("json", "regex", "choice")
    )


# --- what the choice asks of the output ----------------------------------------------------------


def tool_constraint(request: ToolRequest, settings: ToolSettings) -> StructuredOutput | None:
    """`required` and a named function: the JSON schema the output is constrained to (vLLM's
    tool schema; for Mistral its list of {"name", "arguments"})."""
    if not request.forced or not request.reads_calls:
        return None
    by_name = {t["function"]["name"]: t["function"] for t in request.tools}
    if settings.parser is MistralParser:
        chosen = list(by_name.values())
        if request.choice == "named":
            chosen = [by_name[request.function or ""]]
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [f["name"]]},
                    "arguments": f["parameters"] or {"type": "object"},
                },
                "required": ["name", "arguments"],
            }
            for f in chosen
        ]
        schema: dict[str, Any] = {
            "type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items},
        }  # fmt: skip
        if request.choice == "named":
            schema["maxItems"] = 1
        return json_schema_output(schema, "tools")
    if request.choice == "named":
        return json_schema_output(_parameters(by_name[request.function or ""]), "tools")
    functions = [copy.deepcopy(f) for f in by_name.values()]
    definitions = _definitions(functions)
    schema = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [f["name"]]},
                        "parameters": _parameters(f),
                    },
                    "required": ["name", "parameters"],
                }
                for f in functions
            ],
        },
    }
    if request.parallel is False:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return json_schema_output(schema, "tools")


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    # Missing parameters still constrain the arguments to a JSON object, as vLLM.
    return function["parameters"] or {"type": "object", "properties": {}}


def _definitions(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """Every tool's `$defs`, moved to the top of the schema (a name defined twice differently
    is refused, as vLLM)."""
    merged: dict[str, Any] = {}
    for function in functions:
        parameters = function["parameters"]
        if not parameters:
            continue
        definitions = parameters.pop("$defs", {})
        if not isinstance(definitions, dict):
            raise bad_request(
                f"`$defs` in the parameters of tool '{function['name']}' must be an object, "
                f"got {type_name(definitions)}.",
                "tools",
            )
        for name, schema in definitions.items():
            if name in merged and merged[name] != schema:
                raise bad_request(
                    f"Tool definition '{name}' has multiple schemas, which is not supported.",
                    "tools",
                )
            merged[name] = schema
    return merged


# --- the answer ----------------------------------------------------------------------------------


def output_parser(request: ToolRequest, settings: ToolSettings) -> ToolParser | None:
    """How this request's output is read: the forced choice's JSON, or the parser's format."""
    if not request.reads_calls:
        return None
    parser = settings.new_parser()
    if request.choice == "required" or (request.choice == "named" and parser.name == "mistral"):
        return RequiredChoice(parser.arguments_key, parser.call_id)
    if request.choice == "named":
        return NamedChoice(request.function or "")
    return parser


def tool_stream(request: ToolRequest, settings: ToolSettings) -> ToolStream | None:
    parser = output_parser(request, settings)
    if parser is None:
        return None
    return ToolStream(parser, first_only=request.parallel is False)


@dataclass(frozen=True, slots=True)
class Answer:
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str


def answer(request: ToolRequest, settings: ToolSettings, text: str, finish: str) -> Answer:
    """A whole output read for tool calls, as vLLM's non-streaming chat answer."""
    parser = output_parser(request, settings)
    if parser is None:
        return Answer(text, [], finish)
    parsed = parser.parse(text)
    calls = parsed.calls[:1] if request.parallel is False else parsed.calls
    tool_calls = [
        {"id": parser.call_id(), "type": "function",
         "function": {"name": call.name or "", "arguments": call.arguments}}
        for call in calls
    ]  # fmt: skip
    content = parsed.content
    if request.forced:
        content = content or ""
    elif tool_calls and content is not None and not content.strip():
        content = None
    return Answer(content, tool_calls, finish_reason(request, finish, bool(tool_calls)))


def finish_reason(request: ToolRequest | None, finish: str, called: bool) -> str:
    """vLLM's: "tool_calls" when the model stopped by itself after calling a tool, unless one
    named function was forced (OpenAI says "stop" then); "length" stays."""
    if request is not None and called and finish == "stop" and request.choice != "named":
        return "tool_calls"
    return finish
