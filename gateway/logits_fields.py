"""The request fields that reshape the logits on the worker (vLLM 0.33's validation and
normalisation): min_p, the three penalties, logit_bias, allowed_token_ids and bad_words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gateway.fields import bad_request, read_number, read_token_ids, short, type_name
from services.tokenization.tokenizer import Tokenizer

LOGIT_BIAS_LIMIT = 100.0  # vLLM clamps every bias into [-100, 100]
MAX_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS default


@dataclass(frozen=True, slots=True)
class LogitsFields:
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    def token_ids_to_check(self) -> list[tuple[str, list[int]]]:
        """(field, ids) pairs that must lie inside the served vocabulary."""
        return [
            ("logit_bias", list(self.logit_bias)),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("bad_words", [t for word in self.bad_words_token_ids for t in word]),
        ]


def read_logits_fields(body: dict[str, Any], tokenizer: Tokenizer) -> LogitsFields:
    return LogitsFields(
        min_p=read_number(body, "min_p", 0.0, 1.0, default=0.0),
        presence_penalty=read_number(body, "presence_penalty", -2.0, 2.0, default=0.0),
        frequency_penalty=read_number(body, "frequency_penalty", -2.0, 2.0, default=0.0),
        repetition_penalty=_repetition_penalty(body),
        logit_bias=_logit_bias(body.get("logit_bias")),
        allowed_token_ids=_allowed(body.get("allowed_token_ids")),
        bad_words_token_ids=_bad_words(body.get("bad_words"), tokenizer),
    )


def _repetition_penalty(body: dict[str, Any]) -> float:
    value = read_number(body, "repetition_penalty", 0.0, math.inf, default=1.0)
    if value <= 0 or not math.isfinite(value):
        raise bad_request(
            f"repetition_penalty must be greater than zero and finite, got {value}.",
            "repetition_penalty",
        )
    return value


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(
            f"'logit_bias' must be an object of token id -> bias, got {type_name(value)}",
            "logit_bias",
        )
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(
                f"logit_bias contains key(s) that cannot be converted to integer token IDs: "
                f"{short(key)}",
                "logit_bias",
            ) from None
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise bad_request(
                f"'logit_bias[{key}]' must be a number, got {type_name(bias)}", "logit_bias"
            )
        out[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(bias)))
    return out


def _allowed(value: Any) -> list[int] | None:
    if value is None:
        return None
    ids = read_token_ids(value, "allowed_token_ids")
    if not ids:
        raise bad_request("allowed_token_ids is not None and empty!", "allowed_token_ids")
    return ids


def _bad_words(value: Any, tokenizer: Tokenizer) -> list[list[int]]:
    """vLLM's update_from_tokenizer: each word as it would start the text and, when it tokenizes
    differently, as it would follow a space."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(w, str) for w in value):
        raise bad_request("'bad_words' must be a list of strings", "bad_words")
    words: list[list[int]] = []
    for word in dict.fromkeys(value):
        if not word:
            raise bad_request("bad_words cannot contain an empty string.", "bad_words")
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise bad_request("bad_words entries must tokenize to at least one token.", "bad_words")
        words.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            words.append(spaced)
        if len(words) > MAX_BAD_WORDS:
            raise bad_request(
                f"Too many bad words after tokenization: {len(words)}. The max number is "
                f"{MAX_BAD_WORDS}.",
                "bad_words",
            )
    return words
