"""Logprobs in and out: the request fields (completions' `logprobs`, chat's `logprobs` and
`top_logprobs`, `prompt_logprobs`, `return_tokens_as_token_ids`) validated as vLLM 0.33 does,
and the worker's entries turned into OpenAI's shapes (and vLLM's for `prompt_logprobs`).

An entry is vLLM's per-position dict: the chosen token first, then the top-k. Completions show
the first `logprobs + 1` of them, chat the first `top_logprobs`, as vLLM does; -inf shows as
-9999.0 (JSON has no infinity).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.fields import bad_request, read_bool, type_name
from services.tokenization.tokenizer import Tokenizer
from services.wire.messages import TokenLogprobs

MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
FLOOR = -9999.0  # what OpenAI (and vLLM) show for -inf


@dataclass(frozen=True, slots=True)
class LogprobFields:
    """What the worker computes (`logprobs`, `prompt_logprobs`: None or a top-k count, -1 for
    the vocabulary) and how the answer shows it."""

    logprobs: int | None = None
    prompt_logprobs: int | None = None
    num_shown: int | None = None  # entries shown per position; None: all
    as_token_ids: bool = False  # return_tokens_as_token_ids: "token_id:<id>" strings
    hidden: bool = False  # computed only to rank best_of's samples

    def resolved(self, vocab_size: int) -> LogprobFields:
        """-1 becomes the vocabulary; more than MAX_LOGPROBS is refused, as vLLM."""
        counts = []
        for name, what, value in (
            ("logprobs", "sample", self.logprobs),
            ("prompt_logprobs", "prompt", self.prompt_logprobs),
        ):
            count = vocab_size if value == -1 else value
            if count is not None and count > MAX_LOGPROBS:
                raise bad_request(
                    f"Requested {what} logprobs of {count}, which is greater than max allowed: "
                    f"{MAX_LOGPROBS}",
                    name,
                )
            counts.append(count)
        return dataclasses.replace(self, logprobs=counts[0], prompt_logprobs=counts[1])


def read_completion_logprobs(body: dict[str, Any], echo: bool, stream: bool) -> LogprobFields:
    logprobs = _count(body, "logprobs")
    prompt = _prompt_logprobs(body, stream)
    if prompt is None and echo:
        prompt = logprobs  # vLLM: echo shows the prompt's logprobs too
    shown = None if logprobs in (None, -1) else logprobs + 1
    return LogprobFields(logprobs, prompt, shown, _as_token_ids(body))


def read_chat_logprobs(body: dict[str, Any], echo: bool, stream: bool) -> LogprobFields:
    wanted = read_bool(body, "logprobs")
    top = _count(body, "top_logprobs") or 0
    if top != 0 and not wanted:
        raise bad_request(
            "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
        )
    prompt = _prompt_logprobs(body, stream)
    if prompt is None and echo:
        prompt = top  # vLLM's rule, even when logprobs is off
    shown = None if top == -1 else top
    return LogprobFields(top if wanted else None, prompt, shown, _as_token_ids(body))


def _count(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad_request(f"`{name}` must be an integer, got {type_name(value)}.", name)
    if value is not None and value < -1:
        raise bad_request(f"`{name}` must be a positive value or -1.", name)
    return value


def _prompt_logprobs(body: dict[str, Any], stream: bool) -> int | None:
    value = _count(body, "prompt_logprobs")
    if value is not None and value != 0 and stream:
        raise bad_request(
            "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
        )
    return value


def _as_token_ids(body: dict[str, Any]) -> bool:
    return read_bool(body, "return_tokens_as_token_ids")


class LogprobsFormatter:
    """Turns entries into response bodies; token strings as vLLM decodes them one by one."""

    def __init__(self, tokenizer: Tokenizer, fields: LogprobFields) -> None:
        self.tokenizer = tokenizer
        self.fields = fields
        self._strings: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        if self.fields.as_token_ids:
            return f"token_id:{token_id}"
        text = self._strings.get(token_id)
        if text is None:
            text = self._strings[token_id] = decoded_token(self.tokenizer, token_id)
        return text

    def _shown(self, entry: TokenLogprobs) -> list[tuple[int, float]]:
        """The entry as vLLM's dict: a repeated id keeps its first place and the last value."""
        merged: dict[int, float] = {}
        for token_id, logprob in zip(entry.token_ids, entry.logprobs, strict=True):
            merged[token_id] = logprob
        items = list(merged.items())
        return items if self.fields.num_shown is None else items[: self.fields.num_shown]

    def completion(
        self,
        token_ids: Sequence[int],
        entries: Sequence[TokenLogprobs | None],
        text_offset: int = 0,
    ) -> dict[str, Any]:
        """OpenAI's completions logprobs; `text_offset` continues a stream's offsets."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, entry in zip(token_ids, entries, strict=True):
            token = self.token(token_id)
            tokens.append(token)
            offsets.append(text_offset)
            text_offset += len(token)
            if entry is None:  # the prompt's first token
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(max(entry.logprobs[0], FLOOR))
            tops.append({self.token(t): max(lp, FLOOR) for t, lp in self._shown(entry)})
        return {
            "text_offset": offsets,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": tops,
        }

    def chat(self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        content = []
        for token_id, entry in zip(token_ids, entries, strict=True):
            token = self.token(token_id)
            content.append(
                {
                    "token": token,
                    "logprob": max(entry.logprobs[0], FLOOR),
                    "bytes": list(token.encode("utf-8", errors="replace")),
                    "top_logprobs": [
                        {
                            "token": (top := self.token(t)),
                            "logprob": max(lp, FLOOR),
                            "bytes": list(top.encode("utf-8", errors="replace")),
                        }
                        for t, lp in self._shown(entry)
                    ],
                }
            )
        return {"content": content}

    def prompt_logprobs(self, entries: Sequence[TokenLogprobs]) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then per position
        {token id: {logprob, rank, decoded_token}} (the prompt token first, all top-k)."""
        out: list[dict[str, Any] | None] = [None]
        for entry in entries:
            ranks = [entry.rank, *range(1, len(entry.token_ids))]
            position: dict[str, Any] = {}
            for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, ranks, strict=True):
                position[str(token_id)] = {
                    "logprob": max(logprob, FLOOR),
                    "rank": rank,
                    "decoded_token": decoded_token(self.tokenizer, token_id),
                }
            out.append(position)
        return out


def decoded_token(tokenizer: Tokenizer, token_id: int) -> str:
    """One token's text as vLLM's convert_ids_list_to_tokens: its decode, with the leading
    spaces a SentencePiece piece ("▁word") stands for and decode strips."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    piece = tokenizer.token_pieces([token_id])[0]
    markers = len(piece) - len(piece.lstrip("▁"))
    missing = markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text
