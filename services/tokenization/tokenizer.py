"""Tokenizers: raw bytes for the tiny model, Hugging Face `tokenizer.json` for checkpoints (a
GGUF file's: services/tokenization/gguf_tokenizer.py).

Both offer encode/decode, a Jinja chat template and their EOS ids; `IncrementalDetokenizer`
streams text for either without splitting a multi-byte character.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_MODEL_NAME = "kvledger-tiny-llama"

# Role-tagged turns; the byte tokenizer's encode() adds BOS, so the template does not.
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its raise_exception) or failed to render."""


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How a conversation becomes a prompt (vLLM's chat request fields of the same names)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message stays open for the model to continue
    add_special_tokens: bool = False  # on top of what the template writes itself
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # documents, user kwargs, ...
    tools: list[dict[str, Any]] | None = None  # the request's tools, as the template's `tools`


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_pieces(self, ids: Sequence[int]) -> list[str]: ...

    def token_id(self, text: str) -> int | None:
        """The id of the vocabulary entry `text` (a special token's), or None."""
        ...

    def render_chat(
        self, messages: list[dict[str, Any]], options: ChatOptions | None = None
    ) -> str: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], options: ChatOptions | None = None
    ) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; BOS is 256 and EOS 257."""

    BOS_ID = 256
    EOS_ID = 257

    def __init__(self, name: str = DEFAULT_MODEL_NAME) -> None:
        self.name = name
        self.vocab_size = 258
        self.bos_token_id: int | None = self.BOS_ID
        self.eos_token_ids = [self.EOS_ID]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.BOS_ID, *text.encode("utf-8")] if add_special_tokens else [*text.encode()]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if i < 256:
                out.append(i)
            elif not skip_special_tokens:
                out += b"<s>" if i == self.BOS_ID else b"</s>"
        return out.decode("utf-8", errors="replace")

    def token_pieces(self, ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry (a byte shown as its Latin-1 character)."""
        return [chr(i) if i < 256 else "<s>" if i == self.BOS_ID else "</s>" for i in ids]

    def token_id(self, text: str) -> int | None:
        return {"<s>": self.BOS_ID, "</s>": self.EOS_ID}.get(text)

    def render_chat(
        self, messages: list[dict[str, Any]], options: ChatOptions | None = None
    ) -> str:
        return render_chat_template(BYTE_CHAT_TEMPLATE, messages, {}, options)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], options: ChatOptions | None = None
    ) -> list[int]:
        # The template writes no BOS: it is always added here (the model was made that way).
        return self.encode(self.render_chat(messages, options))


class HFTokenizer:
    """A checkpoint's `tokenizer.json`, with specials and EOS from its config files."""

    def __init__(self, folder: str | Path, name: str | None = None) -> None:
        from tokenizers import Tokenizer as _Tokenizer  # only checkpoints need the package

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: kvledger reads a checkpoint's fast tokenizer "
                "(tokenizer.json) only"
            )
        self.name = name or folder.resolve().name
        self._tok = _Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        tok_cfg = _read_json(folder / "tokenizer_config.json")
        gen_cfg = _read_json(folder / "generation_config.json")
        model_cfg = _read_json(folder / "config.json")
        self.special_tokens = {
            key: text
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(tok_cfg.get(key))) is not None
        }
        self.bos_token_id = self._token_id(self.special_tokens.get("bos_token"))
        if self.bos_token_id is None:
            bos = gen_cfg.get("bos_token_id", model_cfg.get("bos_token_id"))
            self.bos_token_id = _first_id(bos)
        # The tokenizer's EOS first (it ends chat turns), then generation_config's, config's.
        self.eos_token_ids = _unique(
            [
                self._token_id(self.special_tokens.get("eos_token")),
                *_ids(gen_cfg.get("eos_token_id")),
                *_ids(model_cfg.get("eos_token_id")),
            ]
        )
        self.add_bos_token = tok_cfg.get("add_bos_token")  # None: tokenizer.json decides
        self.chat_template = _chat_template(folder, tok_cfg)

    def _token_id(self, text: str | None) -> int | None:
        return None if text is None else self._tok.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if not add_special_tokens:
            return ids
        if self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]  # the config asks for BOS and the post-processor did not add it
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_pieces(self, ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry, as transformers' convert_ids_to_tokens."""
        return [self._tok.id_to_token(i) or "" for i in ids]

    def token_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def render_chat(
        self, messages: list[dict[str, Any]], options: ChatOptions | None = None
    ) -> str:
        if self.chat_template is None:
            raise ChatTemplateError(
                f"model {self.name!r} has no chat template (tokenizer_config.json "
                "'chat_template' or chat_template.jinja); use /v1/completions"
            )
        return render_chat_template(self.chat_template, messages, self.special_tokens, options)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], options: ChatOptions | None = None
    ) -> list[int]:
        text = self.render_chat(messages, options)
        # The template writes its own special tokens (BOS included), as transformers assumes.
        add_special = options is not None and options.add_special_tokens
        return self._tok.encode(text, add_special_tokens=add_special).ids


class IncrementalDetokenizer:
    """Text for ids as they arrive, holding back bytes of a character that is not complete.

    It decodes a short window of ids before the new ones and emits what the new ids add, so
    tokenizers that drop or add a leading space depending on context stream correctly.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids)
        self._prefix = max(len(self._ids) - 6, 0)  # window start: context for the first piece
        self._read = len(self._ids)  # ids before this have been emitted

    def push(self, new_ids: Sequence[int]) -> str:
        self._ids.extend(new_ids)
        before = self._tokenizer.decode(self._ids[self._prefix : self._read], self._skip)
        after = self._tokenizer.decode(self._ids[self._prefix :], self._skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing new yet, or the last character is still incomplete
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever is held back, replacement characters included (call at the end)."""
        before = self._tokenizer.decode(self._ids[self._prefix : self._read], self._skip)
        after = self._tokenizer.decode(self._ids[self._prefix :], self._skip)
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    special_tokens: dict[str, str],
    options: ChatOptions | None = None,
) -> str:
    options = options or ChatOptions()
    variables = {**special_tokens, **options.template_kwargs}
    variables["add_generation_prompt"] = options.add_generation_prompt
    # The request's tools (None without, as transformers and vLLM pass it).
    if options.tools is not None or "tools" not in variables:
        variables["tools"] = options.tools
    try:
        text = _compile(template).render(messages=messages, **variables)
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
    return _open_final_message(text, messages) if options.continue_final_message else text


def _open_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """Cut the rendered chat right after the last message's content (transformers' rule), so
    the model continues that message instead of starting a new one."""
    final = messages[-1].get("content") or ""
    if not isinstance(final, str) or final.strip() not in text:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template; the template deletes part of it"
        )
    at = text.rindex(final.strip())
    if text[at : at + len(final.lstrip())] == final:
        return text[: at + len(final.lstrip())]
    return text[: at + len(final.strip())]  # trailing spaces the template trimmed


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # Sandboxed: a checkpoint's template is untrusted code. trim/lstrip as transformers renders.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<' and '>'; chat templates expect plain JSON.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _chat_template(folder: Path, tok_cfg: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"  # where transformers >= 4.43 saves it
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # serialised AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _first_id(value: Any) -> int | None:
    ids = _ids(value)
    return ids[0] if ids else None


def _unique(ids: list[int | None]) -> list[int]:
    return list(dict.fromkeys(i for i in ids if i is not None))
