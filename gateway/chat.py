"""Chat requests, pure: the messages (text, and the tool calls and results of a conversation
with tools) and how they become a prompt (vLLM's chat template fields, the request's tools),
the role of the answer, and what `echo` prepends to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.fields import bad_request, read_bool, short, type_name
from services.tokenization.tokenizer import ChatOptions

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
RESPONSE_ROLE = "assistant"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    messages: list[dict[str, Any]]
    options: ChatOptions
    role: str  # the answer's role: the assistant, or the last message's when it is continued
    echo_text: str  # prepended to the answer when `echo` is set


def read_chat_prompt(body: dict[str, Any], tools: list[dict[str, Any]] | None = None) -> ChatPrompt:
    messages = _messages(body.get("messages"))
    add_generation_prompt = read_bool(body, "add_generation_prompt", default=True)
    continue_final = read_bool(body, "continue_final_message")
    if add_generation_prompt and continue_final:
        raise bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    kwargs = _template_kwargs(body)
    options = ChatOptions(
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
        add_special_tokens=read_bool(body, "add_special_tokens"),
        template_kwargs=kwargs,
        tools=tools,
    )
    # vLLM's get_chat_request_role: without a generation prompt the answer continues the last
    # message, in that message's role.
    role = RESPONSE_ROLE if add_generation_prompt else messages[-1]["role"]
    echo_text = ""
    if read_bool(body, "echo") and messages[-1]["role"] == role:
        echo_text = messages[-1]["content"]
    return ChatPrompt(messages, options, role, echo_text)


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise bad_request(
            "'chat_template_kwargs' must be an object of template variables",
            "chat_template_kwargs",
        )
    if kwargs.get("chat_template") is not None:
        raise bad_request(
            "Chat template is passed with request, but --trust-request-chat-template is not "
            "set. Refused request with untrusted chat template.",
            "chat_template_kwargs",
        )
    merged: dict[str, Any] = {}
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(_is_document(d) for d in documents):
            raise bad_request(
                "'documents' must be a list of objects with string values", "documents"
            )
        merged["documents"] = documents
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(
                f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got "
                f"{short(effort)}",
                "reasoning_effort",
            )
        merged["reasoning_effort"] = effort
        # vLLM switches thinking on for templates that need an explicit opt-in.
        merged["enable_thinking"] = effort != "none"
    # The request's own kwargs win over what vLLM derives from the other fields.
    return merged | kwargs


def _is_document(document: Any) -> bool:
    return isinstance(document, dict) and all(isinstance(v, str) for v in document.values())


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", "messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise bad_request(f"'{where}' must be an object with 'role' and 'content'", where)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(
            f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {short(role)}",
            f"{where}.role",
        )
    out: dict[str, Any] = {
        "role": role, "content": _content(message.get("content"), f"{where}.content")
    }  # fmt: skip
    if role == "assistant" and message.get("tool_calls") is not None:
        calls = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
        if calls:  # vLLM drops an empty list: the template takes the plain assistant path
            out["tool_calls"] = calls
    if role == "tool" and message.get("tool_call_id") is not None:
        if not isinstance(message["tool_call_id"], str):
            raise bad_request(f"'{where}.tool_call_id' must be a string", f"{where}.tool_call_id")
        out["tool_call_id"] = message["tool_call_id"]
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise bad_request(
                f"'{where}.name' must be a string, got {type_name(name)}", f"{where}.name"
            )
        out["name"] = name
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls, as templates take them: arguments as an object (a
    string that is not a JSON object becomes {}, as vLLM does, so the conversation goes on)."""
    if not isinstance(calls, list):
        raise bad_request(f"'{where}' must be a list of tool calls", where)
    out = []
    for i, call in enumerate(calls):
        at = f"{where}[{i}]"
        if not isinstance(call, dict):
            raise bad_request("assistant tool_calls entries must be objects.", at)
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise bad_request(
                "chat completions only support assistant tool_calls of type 'function'.", at
            )
        name = function.get("name")
        if not isinstance(name, str):
            raise bad_request(f"'{at}.function.name' must be a string", f"{at}.function.name")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments else {}
            except ValueError:
                arguments = {}
        shown: dict[str, Any] = {
            "type": "function",
            "function": {
                "name": name,
                "arguments": arguments if isinstance(arguments, dict) else {},
            },
        }
        if call.get("id") is not None:
            if not isinstance(call["id"], str):
                raise bad_request(f"'{at}.id' must be a string", f"{at}.id")
            shown["id"] = call["id"]
        out.append(shown)
    return out


def _content(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or a list of text parts", where)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise bad_request(
                f"'{where}[{i}]': only text content parts are supported", f"{where}[{i}]"
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(f"'{where}[{i}].text' must be a string", f"{where}[{i}].text")
        texts.append(part["text"])
    return "\n".join(texts)
