"""The /score request: a prompt (text or token ids) and its cache salt, read field by field so
that every refusal names the field, as the gateway's are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ledger.hashing import cache_salt_problem
from services.tokenization.tokenizer import Tokenizer

FIELDS = ("prompt", "prompt_token_ids", "cache_salt")


class ScoreRequestError(ValueError):
    """A /score body that cannot be scored; the message and `param` name the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    token_ids: list[int]
    cache_salt: str | None


def read_score_request(body: Any, tokenizer: Tokenizer) -> ScoreRequest:
    if not isinstance(body, dict):
        raise ScoreRequestError(
            "body: must be a JSON object with 'prompt' or 'prompt_token_ids'", None
        )
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise ScoreRequestError(
            f"{unknown[0]}: unknown field (/score takes {', '.join(FIELDS)})", unknown[0]
        )
    if ("prompt" in body) == ("prompt_token_ids" in body):
        raise ScoreRequestError(
            "prompt: give exactly one of 'prompt' (text) and 'prompt_token_ids' (token ids)",
            "prompt",
        )
    if "prompt" in body:
        text = body["prompt"]
        if not isinstance(text, str) or not text:
            raise ScoreRequestError("prompt: must be a non-empty string", "prompt")
        # As the gateway's completions encode a text prompt: with the tokenizer's BOS.
        token_ids = tokenizer.encode(text, add_special_tokens=True)
    else:
        token_ids = body["prompt_token_ids"]
        if not isinstance(token_ids, list) or not token_ids:
            raise ScoreRequestError(
                "prompt_token_ids: must be a non-empty list of token ids", "prompt_token_ids"
            )
        for index, token in enumerate(token_ids):
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ScoreRequestError(
                    f"prompt_token_ids[{index}]: must be a non-negative integer, got {token!r}",
                    f"prompt_token_ids[{index}]",
                )
    salt = body.get("cache_salt")
    problem = cache_salt_problem(salt)  # the gateway's rule: a salt it refuses scores nothing
    if problem is not None:
        raise ScoreRequestError(f"cache_salt: {problem}", "cache_salt")
    return ScoreRequest(token_ids, salt)
