"""Tiny checkpoints (or their tokenizers alone) for tool calling, one per `--tool-call-parser`:
the tokenizer carries the parser's special tokens and the chat template, written for these tests
in the parser's format, renders the request's tools, earlier tool calls and tool results.
`call_text` writes tool calls the way such a model would answer them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.gpu_worker.checkpoints import make_tiny_checkpoint, write_tokenizer

_TURNS = (
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}{CALLS}"
    "{% elif message.role == 'tool' %}{RESULT}"
    "{% else %}<|{{ message.role }}|>{{ message.content }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}"
)
HERMES_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>You may call these functions: <tools>"
    "{% for tool in tools %}{{ tool.function | tojson }}{% endfor %}</tools> as "
    '<tool_call>{"name": ..., "arguments": ...}</tool_call>{{ eos_token }}\n{% endif %}'
    + _TURNS.replace(
        "{CALLS}",
        "<|assistant|>{% for call in message.tool_calls %}<tool_call>"
        '{"name": {{ call.function.name | tojson }}, "arguments": '
        "{{ call.function.arguments | tojson }}}</tool_call>{% endfor %}{{ eos_token }}\n",
    ).replace(
        "{RESULT}", "<|tool|><tool_response>{{ message.content }}</tool_response>{{ eos_token }}\n"
    )
    + "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
LLAMA3_JSON_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>Answer a function call as <|python_tag|>"
    '{"name": ..., "parameters": ...}. Functions: '
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}{{ eos_token }}\n{% endif %}"
    + _TURNS.replace(
        "{CALLS}",
        "<|assistant|><|python_tag|>{% for call in message.tool_calls %}"
        "{% if not loop.first %}; {% endif %}"
        '{"name": {{ call.function.name | tojson }}, "parameters": '
        "{{ call.function.arguments | tojson }}}{% endfor %}{{ eos_token }}\n",
    ).replace("{RESULT}", "<|ipython|>{{ message.content }}{{ eos_token }}\n")
    + "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}{% for message in messages %}"
    "{% if message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{% elif message.role == 'assistant' and message.tool_calls %}"
    "{% for call in message.tool_calls %}[TOOL_CALLS]{{ call.function.name }}[ARGS]"
    "{{ call.function.arguments | tojson }}{% endfor %}{{ eos_token }}"
    "{% elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
    "{% elif message.role == 'assistant' %}{{ message.content }}{{ eos_token }}"
    "{% else %}[SYSTEM_PROMPT]{{ message.content }}[/SYSTEM_PROMPT]{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class ToolFormat:
    parser: str
    special_tokens: tuple[str, ...]
    chat_template: str

    def call_text(self, calls: list[tuple[str, dict[str, Any]]], content: str = "") -> str:
        """What a model of this format answers: `content`, then the calls."""
        if self.parser == "hermes":
            return content + "".join(
                f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>"
                for n, a in calls
            )
        if self.parser == "llama3_json":  # no content: the answer is the calls alone
            return "<|python_tag|>" + "; ".join(
                json.dumps({"name": n, "parameters": a}) for n, a in calls
            )
        return content + "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)


FORMATS = {
    "hermes": ToolFormat("hermes", ("<tool_call>", "</tool_call>"), HERMES_TEMPLATE),
    "llama3_json": ToolFormat("llama3_json", ("<|python_tag|>", "<|ipython|>"), LLAMA3_JSON_TEMPLATE),
    "mistral": ToolFormat(
        "mistral",
        ("[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
         "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"),
        MISTRAL_TEMPLATE,
    ),
}  # fmt: skip


def tool_tokenizer(tmp_path: Path, parser: str) -> Path:
    """A folder holding only the tokenizer of `parser`'s format (enough for the gateway)."""
    fmt = FORMATS[parser]
    folder = Path(tmp_path) / f"tools-{parser}"
    write_tokenizer(folder, fmt.special_tokens, fmt.chat_template)
    return folder


def tool_checkpoint(tmp_path: Path, parser: str, arch: str = "LlamaForCausalLM") -> Path:
    """A tiny random model whose tokenizer and chat template are `parser`'s format."""
    fmt = FORMATS[parser]
    return make_tiny_checkpoint(
        tmp_path, arch, special_tokens=fmt.special_tokens, chat_template=fmt.chat_template,
        name=f"tools-{parser}",
    )  # fmt: skip
