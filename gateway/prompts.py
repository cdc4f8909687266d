"""How many sequences one request asks for: its prompts (completions take a batch: strings or
token-id lists), `n` choices per prompt and OpenAI's `best_of`, within vLLM 0.33's limits; and
`count_sequences`, the same count read cheaply before any tokenizing, for admission.
"""

from __future__ import annotations

from typing import Any

from gateway.fields import bad_request, read_bool, read_int, read_token_ids, type_name
from services.tokenization.tokenizer import Tokenizer

MAX_N_SEQUENCES = 16384  # vLLM's VLLM_MAX_N_SEQUENCES: n per prompt, and here sequences in all
MAX_COMPLETION_PROMPTS = 1024  # vLLM's VLLM_MAX_COMPLETION_PROMPTS


def read_prompts(
    prompt: Any, tokenizer: Tokenizer, add_special: bool
) -> list[tuple[list[int], str]]:
    """Each prompt's token ids and its text (what `echo` shows)."""
    if count_prompts(prompt) and _is_batch(prompt):  # count_prompts: 400 past the batch limit
        return [_one(p, tokenizer, add_special, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_one(prompt, tokenizer, add_special, "prompt")]


def _is_batch(prompt: Any) -> bool:
    return (
        isinstance(prompt, list) and bool(prompt) and all(isinstance(p, str | list) for p in prompt)
    )


def count_prompts(prompt: Any) -> int:
    """How many prompts `prompt` holds (a batch: a list of strings or of token-id lists)."""
    if not _is_batch(prompt):
        return 1
    if len(prompt) > MAX_COMPLETION_PROMPTS:
        raise bad_request(
            f"'prompt' holds {len(prompt)} prompts; at most {MAX_COMPLETION_PROMPTS} are "
            "allowed in one request",
            "prompt",
        )
    return len(prompt)


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


def count_sequences(kind: str, body: dict[str, Any], max_queue: int) -> int:
    """The sequences a request asks for (prompts x (best_of or n)), each a place in the
    gateway's queue, read from the body before it is tokenized. A 400 naming the field when they
    could never fit: more than vLLM's limit, or than `max_queue` (the gateway's places)."""
    n = read_n(body)
    best_of = None
    num_prompts = 1
    if kind == "completion":
        num_prompts = count_prompts(body.get("prompt"))
        best_of = read_best_of(body, n, read_bool(body, "stream"))
    check_num_sequences(num_prompts, n, best_of)
    per_prompt = best_of or n
    total = num_prompts * per_prompt
    if total > max_queue:
        param = "best_of" if best_of else ("n" if n > 1 else "prompt")
        what = f"{num_prompts} prompt(s) x {per_prompt} samples ({param})"
        raise bad_request(
            f"the request asks for {total} sequences ({what}); this gateway holds at most "
            f"{max_queue} sequences in flight (max_queue, KVLEDGER_MAX_QUEUE), so it could never "
            "be admitted: send fewer",
            param,
        )
    return total
