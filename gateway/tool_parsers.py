"""Tool calls in a model's output, pure: the `--tool-call-parser` formats (hermes, llama3_json,
mistral) and the JSON that `tool_choice` "required" and a named function constrain the output
to, read as vLLM 0.33 reads them.

Every parser offers two views of a text. `parse` reads a whole output as vLLM's non-streaming
path does (arguments re-serialised as JSON, a malformed call leaves the output as content).
`scan` reads any prefix of an output for streaming: the content so far and each call's name
(once complete) and argument text so far, both only ever growing as the text grows, so
`ToolStream` sends what a longer prefix adds. Streamed arguments are the model's own text (as
vLLM's hermes parser sends them); joined they are the same JSON as `parse`'s.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

# --- what a parser finds -------------------------------------------------------------------------


@dataclass(slots=True)
class ParsedCall:
    name: str | None  # None until the name is complete
    arguments: str  # JSON text of the arguments (so far, in a scan)


@dataclass(slots=True)
class Parsed:
    content: str | None  # text shown as content (a scan: what is safe to send so far)
    calls: list[ParsedCall] = field(default_factory=list)


def tool_call_id() -> str:
    """vLLM's tool call id: chatcmpl-tool- and 16 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"


_ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Mistral's templates take 9 alphanumeric characters, as vLLM's MistralToolCall."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


class ToolParser:
    """One output format. `required_tokens` must be in the tokenizer's vocabulary."""

    name: ClassVar[str]
    required_tokens: ClassVar[tuple[str, ...]] = ()
    # "required" and named choices: the key of a call's arguments in the constrained JSON.
    arguments_key: ClassVar[str] = "parameters"

    def __init__(self, has_token: Callable[[str], bool]) -> None:
        self.has_token = has_token

    def call_id(self) -> str:
        """A new tool call's id."""
        return tool_call_id()

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def scan(self, text: str) -> Parsed:
        raise NotImplementedError


# --- JSON read from any prefix -------------------------------------------------------------------

_WHITESPACE = " \t\r\n"


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _string_end(text: str, pos: int) -> int | None:
    """Past the closing quote of the string opening at text[pos], or None while it is open."""
    escaped = False
    for j in range(pos + 1, len(text)):
        ch = text[j]
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            return j + 1
    return None


def value_end(text: str, pos: int) -> int | None:
    """Past the end of the JSON value starting at text[pos], or None while it is open (a
    number or literal is open until a delimiter follows it)."""
    ch = text[pos]
    if ch == '"':
        return _string_end(text, pos)
    if ch in "{[":
        depth, in_string, escaped = 0, False, False
        for j in range(pos, len(text)):
            c = text[j]
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
        return None
    j = pos
    while j < len(text) and text[j] not in ",}]" + _WHITESPACE:
        j += 1
    return j if j < len(text) else None


@dataclass(slots=True)
class _Object:
    members: dict[str, tuple[int, int | None]]  # key -> value span (end None while open)
    end: int | None  # past the closing brace, None while open


def scan_object(text: str, pos: int) -> _Object:
    """The members of the JSON object opening at text[pos] ('{'), read as far as the text
    goes. Malformed text leaves the object open for good."""
    members: dict[str, tuple[int, int | None]] = {}
    pos += 1
    while True:
        pos = _skip_ws(text, pos)
        if pos >= len(text):
            return _Object(members, None)
        ch = text[pos]
        if ch == "}":
            return _Object(members, pos + 1)
        if ch == ",":
            pos += 1
            continue
        key_end = _string_end(text, pos) if ch == '"' else None
        if key_end is None:
            return _Object(members, None)
        try:
            key = json.loads(text[pos:key_end])
        except ValueError:
            return _Object(members, None)
        pos = _skip_ws(text, key_end)
        if pos >= len(text) or text[pos] != ":":
            return _Object(members, None)
        pos = _skip_ws(text, pos + 1)
        if pos >= len(text):
            return _Object(members, None)
        end = value_end(text, pos)
        members[key] = (pos, end)
        if end is None:
            return _Object(members, None)
        pos = end


def scanned_call(text: str, obj: _Object, arguments_keys: tuple[str, ...]) -> ParsedCall:
    """A call object's name (once its string is complete) and its argument text so far."""
    name = None
    if "name" in obj.members:
        start, end = obj.members["name"]
        if end is not None and text[start] == '"':
            name = json.loads(text[start:end])
    arguments = ""
    for key in arguments_keys:
        if key in obj.members:
            start, end = obj.members[key]
            arguments = text[start : len(text) if end is None else end]
            break
    return ParsedCall(name if isinstance(name, str) else None, arguments)


def partial_overlap(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (held back from content)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _content_before(text: str, tag: str) -> str:
    """The content a scan may send: the text before `tag`, or all but a partial tag."""
    at = text.find(tag)
    return text[:at] if at >= 0 else text[: len(text) - partial_overlap(text, tag)]


# --- hermes --------------------------------------------------------------------------------------


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more (parallel); the
    content is the text before the first."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> Parsed:
        if self.START not in text:
            return Parsed(text)
        calls = []
        try:
            for body, _ in self._bodies(text):
                call = json.loads(body)
                calls.append(ParsedCall(call["name"], _dumps(call["arguments"])))
        except (ValueError, KeyError, TypeError):
            return Parsed(text)  # vLLM: a call that does not parse leaves it all as content
        return Parsed(text[: text.index(self.START)] or None, calls)

    def _bodies(self, text: str) -> list[tuple[str, bool]]:
        """What each <tool_call> holds, and whether its </tool_call> came."""
        bodies, pos = [], 0
        while (start := text.find(self.START, pos)) >= 0:
            start += len(self.START)
            end = text.find(self.END, start)
            if end < 0:
                bodies.append((text[start:], False))
                break
            bodies.append((text[start:end], True))
            pos = end + len(self.END)
        return bodies

    def scan(self, text: str) -> Parsed:
        content = _content_before(text, self.START)
        calls = []
        for body, closed in self._bodies(text):
            if not closed:
                # Trailing whitespace waits for what follows it (vLLM strips the open body),
                # so a space and the quote after it stream as one delta.
                body = body[: len(body) - partial_overlap(body, self.END)].rstrip()
            pos = _skip_ws(body, 0)
            if pos >= len(body) or body[pos] != "{":
                break
            calls.append(scanned_call(body, scan_object(body, pos), ("arguments",)))
        return Parsed(content, calls)


# --- llama3_json ---------------------------------------------------------------------------------


class Llama3JsonParser(ToolParser):
    """Llama 3's JSON calls: `{"name": ..., "parameters": {...}}` (or "arguments"), after an
    optional `<|python_tag|>`, several separated by `; `."""

    name = "llama3_json"
    BOT = "<|python_tag|>"
    required_tokens = (BOT,)

    def parse(self, text: str) -> Parsed:
        if self.BOT not in text and "{" not in text:
            return Parsed(text)
        decoder, calls, end = json.JSONDecoder(), [], -1
        for start in (i for i, ch in enumerate(text) if ch == "{"):
            if start <= end:
                continue  # inside an object already read
            try:
                obj, length = decoder.raw_decode(text[start:])
                end = start + length
                arguments = obj["arguments"] if "arguments" in obj else obj["parameters"]
                calls.append(ParsedCall(obj["name"], _dumps(arguments)))
            except (ValueError, KeyError, TypeError):
                return Parsed(text)  # vLLM: any malformed object leaves it all as content
        return Parsed(None, calls) if calls else Parsed(text)

    def scan(self, text: str) -> Parsed:
        if self.BOT.startswith(text):
            return Parsed("")  # nothing yet, or what may be the marker's start
        if not (text.startswith(self.BOT) or text.startswith("{")):
            return Parsed(text)  # vLLM streams anything else as content
        pos = len(self.BOT) if text.startswith(self.BOT) else 0
        calls = []
        while True:
            pos = _skip_ws(text, pos)
            if pos >= len(text) or text[pos] != "{":
                break
            obj = scan_object(text, pos)
            calls.append(scanned_call(text, obj, ("arguments", "parameters")))
            if obj.end is None:
                break
            pos = _skip_ws(text, obj.end)
            if pos >= len(text) or text[pos] != ";":
                break
            pos += 1
        return Parsed("", calls)


# --- mistral -------------------------------------------------------------------------------------


class MistralParser(ToolParser):
    """Mistral's `[TOOL_CALLS]`: with `[ARGS]` in the vocabulary (tokenizer v11+) each call is
    `[TOOL_CALLS]name[ARGS]{...}` (or `name{...}`); before that, `[TOOL_CALLS]` is followed by
    a JSON list (or object) of `{"name": ..., "arguments": {...}}`. Ids are Mistral's: nine
    letters and digits."""

    name = "mistral"
    BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
    required_tokens = (BOT,)
    arguments_key = "arguments"

    def call_id(self) -> str:
        return mistral_call_id()

    @property
    def v11(self) -> bool:
        return self.has_token(self.ARGS)

    def parse(self, text: str) -> Parsed:
        if self.BOT not in text:
            return Parsed(text)
        before, *segments = text.split(self.BOT)
        content = before if before.strip() else None
        calls: list[ParsedCall] = []
        if self.v11:
            for segment in segments:
                name, arguments = self._name_and_arguments(segment, final=True)
                if name is not None:
                    calls.append(ParsedCall(name, arguments))
            # vLLM's engine strips the content beside calls (whole answers only).
            return Parsed(before.strip() or None, calls) if calls else Parsed(text)
        listed = next((s.strip() for s in segments if s.strip()), "")
        try:
            value, _ = json.JSONDecoder().raw_decode(listed)
        except ValueError:
            return Parsed(listed)
        for call in (
            [value] if isinstance(value, dict) else value if isinstance(value, list) else []
        ):
            if not isinstance(call, dict) or not ("name" in call or "arguments" in call):
                continue
            given = call.get("arguments")
            arguments = (
                given if isinstance(given, str) else "{}" if given is None else _dumps(given)
            )
            name = call.get("name")
            calls.append(ParsedCall(name if isinstance(name, str) else "", arguments))
        return Parsed(content, calls) if calls else Parsed(listed)

    def _name_and_arguments(self, segment: str, final: bool) -> tuple[str | None, str]:
        """A v11 call: its name once [ARGS] or the opening brace ends it, and its arguments
        (the first JSON value; all of it while open)."""
        if self.ARGS in segment:
            name, raw = segment.split(self.ARGS, 1)
        elif "{" in segment:
            cut = segment.index("{")
            name, raw = segment[:cut], segment[cut:]
        else:
            return None, ""
        raw = raw.lstrip()
        end = value_end(raw, 0) if raw else None
        if end is not None:
            raw = raw[:end]
        elif final:
            raw = raw.rstrip() or "{}"
        return name.strip(), raw

    def scan(self, text: str) -> Parsed:
        content = _content_before(text, self.BOT)
        if self.BOT not in text:
            return Parsed(content)
        segments = text.split(self.BOT)[1:]
        calls = []
        if self.v11:
            for i, segment in enumerate(segments):
                if i == len(segments) - 1:
                    segment = segment[: len(segment) - partial_overlap(segment, self.BOT)]
                    segment = segment[: len(segment) - partial_overlap(segment, self.ARGS)]
                name, arguments = self._name_and_arguments(segment, final=False)
                if name is None:
                    break
                calls.append(ParsedCall(name, arguments))
            return Parsed(content if content.strip() else "", calls)
        listed = segments[0]
        pos = _skip_ws(listed, 0)
        if pos < len(listed) and listed[pos] == "{":
            calls.append(scanned_call(listed, scan_object(listed, pos), ("arguments",)))
        elif pos < len(listed) and listed[pos] == "[":
            calls = _scan_array(listed, pos, ("arguments",))
        return Parsed(content if content.strip() else "", calls)


def _scan_array(text: str, pos: int, arguments_keys: tuple[str, ...]) -> list[ParsedCall]:
    """The call objects of the JSON list opening at text[pos], as far as the text goes."""
    calls: list[ParsedCall] = []
    pos += 1
    while True:
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos += 1
            continue
        if pos >= len(text) or text[pos] != "{":
            return calls
        obj = scan_object(text, pos)
        calls.append(scanned_call(text, obj, arguments_keys))
        if obj.end is None:
            return calls
        pos = obj.end


# --- tool_choice "required" and a named function -------------------------------------------------


class RequiredChoice(ToolParser):
    """`tool_choice: "required"`: the output is constrained to a JSON list of
    `{"name": ..., "parameters": {...}}` ("arguments" for Mistral) objects."""

    name = "required"

    def __init__(self, arguments_key: str, call_id: Callable[[], str]) -> None:
        super().__init__(lambda _: False)
        self.key = arguments_key
        self._call_id = call_id

    def call_id(self) -> str:
        return self._call_id()

    def parse(self, text: str) -> Parsed:
        try:
            listed = json.loads(text)
        except ValueError:
            return Parsed("")  # vLLM: an array that does not parse (cut short) gives no call
        if not isinstance(listed, list):
            return Parsed("")
        calls = []
        for call in listed:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return Parsed("")
            calls.append(ParsedCall(call["name"], _dumps(call.get(self.key))))
        return Parsed("", calls)

    def scan(self, text: str) -> Parsed:
        pos = _skip_ws(text, 0)
        if pos >= len(text) or text[pos] != "[":
            return Parsed("")
        return Parsed("", _scan_array(text, pos, (self.key,)))


class NamedChoice(ToolParser):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: the output is that
    function's arguments, constrained to its parameters' schema."""

    name = "named"

    def __init__(self, function: str) -> None:
        super().__init__(lambda _: False)
        self.function = function

    def parse(self, text: str) -> Parsed:
        return Parsed("", [ParsedCall(self.function, text)] if text.strip() else [])

    def scan(self, text: str) -> Parsed:
        return Parsed("", [ParsedCall(self.function, text)])


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}


# --- streaming -----------------------------------------------------------------------------------


class ToolStream:
    """One choice's streamed output turned into content and tool-call deltas: each push scans
    the whole text so far and sends what it adds (a call's id, type and name with its first
    arguments, then argument text)."""

    def __init__(self, parser: ToolParser, first_only: bool) -> None:
        self.parser = parser
        self.first_only = first_only  # parallel_tool_calls: false
        self.text = ""
        self.sent_content = 0
        self.sent_arguments: list[str] = []

    @property
    def called(self) -> bool:
        return bool(self.sent_arguments)

    def push(self, delta: str) -> tuple[str | None, list[dict[str, Any]]]:
        self.text += delta
        view = self.parser.scan(self.text)
        content = None
        if view.content and len(view.content) > self.sent_content:
            content = view.content[self.sent_content :]
            self.sent_content = len(view.content)
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(view.calls[:1] if self.first_only else view.calls):
            if index == len(self.sent_arguments):
                if call.name is None:
                    break  # calls come in order: a later one cannot be ready
                self.sent_arguments.append(call.arguments)
                deltas.append({
                    "index": index, "id": self.parser.call_id(), "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                })  # fmt: skip
                continue
            sent = self.sent_arguments[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                deltas.append(
                    {"index": index, "function": {"arguments": call.arguments[len(sent) :]}}
                )
                self.sent_arguments[index] = call.arguments
        return content, deltas
