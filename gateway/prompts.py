"""How many sequences one request asks for: its prompts (completions take a batch: strings or
token-id lists), `n` choices per prompt and OpenAI's `best_of`, within vLLM 0.33's limits.
"""

from __future__ import annotations

from typing import Any

from gateway.fields import bad_request, read_int, read_token_ids, type_name
from services.tokenization.tokenizer import Tokenizer

MAX_N_SEQUENCES = 16384  # vLLM's VLLM_MAX_N_SEQUENCES: n per prompt, and here sequences in all
MAX_COMPLETION_PROMPTS = 1024  # vLLM's VLLM_MAX_COMPLETION_PROMPTS


def read_prompts(
    prompt: Any, tokenizer: Tokenizer, add_special: bool
) -> list[tuple[list[int], str]]:
    """Each prompt's token ids and its text (what `echo` shows)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > MAX_COMPLETION_PROMPTS:
            raise bad_request(
                f"'prompt' holds {len(prompt)} prompts; at most {MAX_COMPLETION_PROMPTS} are "
                "allowed in one request",
                "prompt",
            )
        return [_one(p, tokenizer, add_special, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_one(prompt, tokenizer, add_special, "prompt")]


def _one(prompt: Any, tokenizer: Tokenizer, add_special: bool, name: str) -> tuple[list[int], str]:
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=add_special)
        text = prompt
    elif isinstance(prompt, list):
        ids = read_token_ids(prompt, name)
        text = tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
    else:
        raise bad_request(
            f"'{name}' must be a string or a list of token ids, got {type_name(prompt)}", "prompt"
        )
    if not ids:
        raise bad_request(f"'{name}' must not be empty", "prompt")
    return ids, text


def read_n(body: dict[str, Any]) -> int:
    return read_int(body, "n", lo=1, hi=MAX_N_SEQUENCES) or 1


def read_best_of(body: dict[str, Any], n: int, stream: bool) -> int | None:
    """OpenAI's best_of: draw best_of samples per prompt, return the n with the highest mean
    logprob per token. vLLM 0.33 dropped the field; its meaning here is OpenAI's."""
    best_of = read_int(body, "best_of", lo=1, hi=MAX_N_SEQUENCES)
    if best_of is None or best_of == n:
        return None
    if best_of < n:
        raise bad_request(f"best_of must be greater than or equal to n, got n={n} and "
                          f"best_of={best_of}.", "best_of")  # fmt: skip
    if stream:
        raise bad_request("best_of > n cannot be streamed: the best samples are known only "
                          "when all have finished; send stream: false", "best_of")  # fmt: skip
    return best_of


def check_num_sequences(num_prompts: int, n: int, best_of: int | None) -> None:
    total = num_prompts * (best_of or n)
    if total > MAX_N_SEQUENCES:
        param = "best_of" if best_of else "n"
        raise bad_request(
            f"{num_prompts} prompt(s) x {best_of or n} samples make {total} sequences; at most "
            f"{MAX_N_SEQUENCES} are allowed in one request",
            param,
        )
