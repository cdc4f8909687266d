"""Every field vLLM 0.33's OpenAI request models accept, and what kvledger does with it: each one
either works as in vLLM or is refused with a 400 naming it. A field vLLM does not know is refused
too (vLLM would ignore it; a client that sent it expects something).

The tables are the single source for the checks, the field list of docs/api.md and /openapi.json.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.fields import bad_request, short


@dataclass(frozen=True, slots=True)
class FieldSupport:
    note: str  # one line: what it does here, or why it is refused
    refused: bool = False
    # For a refused field: the values that ask for nothing, accepted so that clients which
    # send defaults explicitly keep working.
    harmless: Callable[[Any], bool] = lambda value: False


def works(note: str) -> FieldSupport:
    return FieldSupport(note)


def refused(note: str, *harmless: Any) -> FieldSupport:
    def is_harmless(value: Any) -> bool:
        return any(type(value) is type(h) and value == h for h in harmless)

    return FieldSupport(note, refused=True, harmless=is_harmless)


# vLLM removed these; it ignores them with a warning, so output silently stops being constrained.
REMOVED_GUIDED_FIELDS = (
    "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern",
)  # fmt: skip

_SAMPLING: dict[str, FieldSupport] = {
    "model": works("must name the served model (404 otherwise); may be omitted"),
    "max_tokens": works(
        "output token limit; the context must hold prompt plus max_tokens (completions: 0 with "
        "echo scores the prompt)"
    ),
    "temperature": works(
        "0 is greedy (below 1e-5 on the worker); 0 < t < 0.01 becomes 0.01, as vLLM"
    ),
    "top_p": works("nucleus sampling, in (0, 1]"),
    "top_k": works("keep the k most likely tokens; 0 or -1 is off"),
    "seed": works("per-request generator: the same tokens whatever the batch or preemptions"),
    "stop": works("up to 4 stop strings; the output is cut before the first (see next)"),
    "stop_token_ids": works("token ids that end the request like EOS"),
    "include_stop_str_in_output": works(
        "keep the stop string (or stop token's text) in the output"
    ),
    "ignore_eos": works("do not stop at EOS"),
    "min_tokens": works("EOS and stop tokens are masked, stop strings unchecked, until reached"),
    "skip_special_tokens": works("drop special tokens from the text (default true)"),
    "spaces_between_special_tokens": refused("only the default (true) is served", True),
    "stream": works("server-sent events, one chunk per token (or per stream_interval tokens)"),
    "stream_options": works(
        "include_usage (a last usage chunk), continuous_usage_stats (usage in every chunk)"
    ),
    "stream_interval": works("tokens per streamed chunk (first and last chunk go at once)"),
    "truncate_prompt_tokens": works("keep only the last N prompt tokens (-1: max_model_len)"),
    "truncation_side": works("'left' (default) keeps the last tokens, 'right' the first"),
    "priority": works("lower runs first; only under --scheduling-policy priority (400 under fcfs)"),
    "request_id": works("the response id becomes cmpl-/chatcmpl-<request_id>"),
    "session_id": works("recorded in the request's log line; no effect on output, as in vLLM"),
    "user": works("recorded in the request's log line; no effect on output, as in vLLM"),
    "cache_salt": works("salts block 0's hash: the prefix cache is shared only within a salt"),
    "return_token_ids": works("prompt_token_ids and token_ids in every choice (or chunk)"),
    "use_beam_search": refused("beam search is not served", False),
    "length_penalty": refused("only used by beam search, which is not served", 1.0, 1),
    "watermarking": refused("no watermarking model is served", False),
    "n": works(
        "n choices per prompt: child requests with seeds seed+i share the prompt's cached blocks"
    ),
    "presence_penalty": works("in [-2, 2]: subtracted once from each token the output holds"),
    "frequency_penalty": works("in [-2, 2]: subtracted per occurrence in the output"),
    "repetition_penalty": works("> 0: divides positive logits of prompt and output tokens"),
    "logit_bias": works("token id -> bias added to its logit, clamped to [-100, 100]"),
    "min_p": works("drop tokens below min_p times the top token's probability"),
    "bad_words": works("words whose last token is banned once the rest was generated"),
    "allowed_token_ids": works("only these token ids can be sampled"),
    "prompt_logprobs": works(
        "logprobs of each prompt token and its top k (at most 20; no stream when k > 0); "
        "such a request reads nothing from the prefix cache"
    ),
    "logprob_token_ids": refused("logprobs of chosen token ids are not served", []),
    "return_tokens_as_token_ids": works("logprobs name tokens 'token_id:<id>'"),
    "response_format": works(
        "json_object or json_schema: the output is masked token by token to match (llguidance)"
    ),
    "structured_outputs": works(
        "json, json_object, regex, choice or grammar (Lark or GBNF), as vLLM's llguidance backend"
    ),
    "repetition_detection": refused("n-gram repetition detection is not served"),
    "thinking_token_budget": refused("no reasoning model is served", -1),
    "vllm_xargs": refused("no custom extension reads them", {}),
    "kv_transfer_params": refused("disaggregated prefill is not served", {}),
    "ec_transfer_params": refused("encoder-cache transfer is not served", {}),
    "return_weight_versions": refused("weights carry no version labels here", False),
    "routed_experts_prompt_start": refused("no mixture-of-experts model is served", 0),
    "return_token_offsets": refused("only vLLM's render endpoints return offsets", False),
    "mm_payload": refused("only vLLM's render endpoints use it", "tensors"),
    "return_mm_kwargs": refused("only vLLM's render endpoints use it"),
}

COMPLETION_FIELDS: dict[str, FieldSupport] = {
    **_SAMPLING,
    "prompt": works("text or token ids, or a batch (list) of either: choices prompt by prompt"),
    "echo": works(
        "the prompt's text before the completion (none with return_token_ids, as vLLM); with "
        "max_tokens 0 the prompt alone and its logprobs (prompt scoring, as lm-eval uses)"
    ),
    "add_special_tokens": works(
        "add BOS (the tokenizer's special tokens) to a text prompt; default true"
    ),
    "suffix": refused("fill-in-the-middle is not served (vLLM: FIM models only)"),
    "prompt_embeds": refused("prompt embeddings are not served"),
    # OpenAI's field (vLLM 0.33 dropped it): the best `n` of `best_of` samples.
    "best_of": works(
        "OpenAI's: best_of samples per prompt, the n with the highest mean logprob per token "
        "returned (vLLM 0.33 has no such field); not with stream"
    ),
    "logprobs": works(
        "raw logprobs of each token and its top k (k <= 20), in OpenAI's completions shape"
    ),
}

CHAT_FIELDS: dict[str, FieldSupport] = {
    **_SAMPLING,
    "messages": works("text content (strings or text parts); other content parts get a 400"),
    "max_completion_tokens": works("the newer name of max_tokens; wins over it"),
    "echo": works("prepend the last message's content when it is the assistant's"),
    "add_generation_prompt": works("passed to the chat template (default true)"),
    "continue_final_message": works("the last message stays open and the model continues it"),
    "add_special_tokens": works("add the tokenizer's special tokens on top of the template's"),
    "documents": works("passed to the chat template as `documents`"),
    "chat_template_kwargs": works("extra variables for the chat template"),
    "reasoning_effort": works("passed to the chat template (with enable_thinking), as vLLM"),
    "return_prompt_text": works("the rendered prompt in `prompt_text`"),
    "chat_template": refused(
        "Chat template is passed with request, but --trust-request-chat-template is not set. "
        "Refused request with untrusted chat template."
    ),
    "tools": works(
        "function tools, given to the chat template as `tools`; calls are read back by "
        "--tool-call-parser (hermes, llama3_json or mistral)"
    ),
    "tool_choice": works(
        "none (tools reach the template, the answer is content), auto (the default with tools; "
        "needs --enable-auto-tool-choice), required or a named function (the output is "
        "constrained to the tools' JSON schema); all but none need --tool-call-parser"
    ),
    "parallel_tool_calls": works("false keeps the first tool call only"),
    "include_reasoning": refused("no reasoning parser is served", True),
    "top_logprobs": works("k <= 20 most likely tokens per position (with logprobs: true)"),
    "media_io_kwargs": refused("multimodal input is not served", {}),
    "mm_processor_kwargs": refused("multimodal input is not served", {}),
    "logprobs": works("raw logprobs of each output token, in OpenAI's chat shape"),
}

# vLLM 0.33's ResponsesRequest, for a generate model (no built-in tools, no reasoning parser).
RESPONSES_FIELDS: dict[str, FieldSupport] = {
    "input": works(
        "text, or items: messages (input_text parts), function_call and function_call_output"
    ),
    "instructions": works("a system message before the input (not carried to later turns)"),
    "model": _SAMPLING["model"],
    "max_output_tokens": works("output token limit, capped at what the context leaves (as vLLM)"),
    "temperature": _SAMPLING["temperature"],
    "top_p": _SAMPLING["top_p"],
    "top_k": _SAMPLING["top_k"],
    "min_p": _SAMPLING["min_p"],
    "seed": _SAMPLING["seed"],
    "stop": _SAMPLING["stop"],
    "stop_token_ids": _SAMPLING["stop_token_ids"],
    "ignore_eos": _SAMPLING["ignore_eos"],
    "presence_penalty": _SAMPLING["presence_penalty"],
    "frequency_penalty": _SAMPLING["frequency_penalty"],
    "repetition_penalty": _SAMPLING["repetition_penalty"],
    "logit_bias": _SAMPLING["logit_bias"],
    "stream": works("server-sent events: response.created ... response.completed, as vLLM"),
    "text": works(
        "format: text, json_object or json_schema (the output is constrained, llguidance)"
    ),
    "structured_outputs": works("as in the chat endpoint; not with text.format"),
    "tools": works("function tools, as in chat (--tool-call-parser reads the calls back)"),
    "tool_choice": works("none, auto, required or a named function, as in chat"),
    "parallel_tool_calls": works("false keeps the first tool call only"),
    "include": works(
        "message.output_text.logprobs alone: each output token's logprob and top_logprobs"
    ),
    "top_logprobs": works("0..20 most likely tokens per position (with include's logprobs)"),
    "truncation": works("auto keeps the last tokens of a prompt too long; disabled refuses it"),
    "store": refused(
        "responses are stored only with --enable-responses-store (KVLEDGER_ENABLE_RESPONSES_STORE)",
        False,
    ),
    "previous_response_id": refused(
        "responses are stored only with --enable-responses-store (KVLEDGER_ENABLE_RESPONSES_STORE)"
    ),
    "metadata": works("up to 16 string pairs, echoed in the response"),
    "user": _SAMPLING["user"],
    "session_id": _SAMPLING["session_id"],
    "request_id": works("the response's id"),
    "priority": _SAMPLING["priority"],
    "cache_salt": _SAMPLING["cache_salt"],
    "skip_special_tokens": _SAMPLING["skip_special_tokens"],
    "include_stop_str_in_output": _SAMPLING["include_stop_str_in_output"],
    "chat_template_kwargs": works("extra variables for the chat template"),
    "service_tier": works("echoed in the response; no effect, as vLLM"),
    "prompt_cache_key": works("echoed in the response; no effect, as vLLM"),
    "prompt_cache_retention": works("echoed in the response; no effect, as vLLM"),
    "prompt_cache_options": works("echoed in the response; no effect, as vLLM"),
    "safety_identifier": works("echoed in the response; no effect, as vLLM"),
    "background": refused("background responses are not served", False),
    "max_tool_calls": refused("only built-in tools (not served) loop on calls"),
    "prompt": refused("prompt template is not supported"),
    "reasoning": refused("no reasoning model is served"),
    "include_reasoning": refused("no reasoning model is served", True),
    "watermarking": _SAMPLING["watermarking"],
    "spaces_between_special_tokens": _SAMPLING["spaces_between_special_tokens"],
    "enable_response_messages": refused("raw prompt and output messages are not returned", False),
    "previous_input_messages": refused("only gpt-oss (Harmony) messages go there"),
    "media_io_kwargs": refused("multimodal input is not served", {}),
    "mm_processor_kwargs": refused("multimodal input is not served", {}),
    "mm_payload": _SAMPLING["mm_payload"],
    "return_mm_kwargs": _SAMPLING["return_mm_kwargs"],
    "vllm_xargs": _SAMPLING["vllm_xargs"],
    "kv_transfer_params": _SAMPLING["kv_transfer_params"],
    "ec_transfer_params": _SAMPLING["ec_transfer_params"],
}

TOKENIZE_FIELDS: dict[str, FieldSupport] = {
    "model": works("must name the served model"),
    "prompt": works("text to tokenize (completion form)"),
    "messages": works("messages to render and tokenize (chat form)"),
    "add_special_tokens": works("as in the generation endpoints"),
    "add_generation_prompt": works("chat form: passed to the template"),
    "continue_final_message": works("chat form: the last message stays open"),
    "chat_template_kwargs": works("chat form: extra template variables"),
    "return_token_strs": works("also return each token's string"),
    "chat_template": CHAT_FIELDS["chat_template"],
    "tools": works("chat form: given to the chat template as `tools`"),
    "media_io_kwargs": CHAT_FIELDS["media_io_kwargs"],
    "mm_processor_kwargs": CHAT_FIELDS["mm_processor_kwargs"],
}

DETOKENIZE_FIELDS: dict[str, FieldSupport] = {
    "model": works("must name the served model"),
    "tokens": works("token ids to turn into text"),
}

STREAM_OPTIONS_FIELDS: dict[str, FieldSupport] = {
    "include_usage": works("a last chunk with the usage of the whole request"),
    "continuous_usage_stats": works("usage in every chunk"),
}


STRUCTURED_OUTPUTS_FIELDS: dict[str, FieldSupport] = {
    "json": works("a JSON schema (object or its JSON text) the output must match"),
    "json_object": works("true: the output is one JSON object"),
    "regex": works("the output matches this regular expression (Rust regex syntax)"),
    "choice": works("the output is exactly one of these strings"),
    "grammar": works("a Lark or GBNF grammar the output must match"),
    "disable_any_whitespace": works("JSON without free whitespace between tokens"),
    "disable_additional_properties": works("objects with properties get no others"),
    "whitespace_pattern": refused(
        "only vLLM's xgrammar and outlines backends read it; kvledger runs llguidance"
    ),
    "structural_tag": refused("structural tags are not served"),
}


def check_fields(body: dict[str, Any], table: dict[str, FieldSupport], where: str = "") -> None:
    """400 for the first field that is unknown or refused with a value that asks for something."""
    for name, value in body.items():
        param = f"{where}{name}"
        support = table.get(name)
        if support is None:
            raise bad_request(_unknown(name, param), param)
        if support.refused and value is not None and not support.harmless(value):
            raise bad_request(
                f"'{param}' is not supported by kvledger: {support.note} (got {short(value)})",
                param,
            )


def _unknown(name: str, param: str) -> str:
    if name in REMOVED_GUIDED_FIELDS:
        return (
            f"'{param}' was removed in vLLM 0.33 (vLLM ignores it and does not constrain the "
            "output); use 'structured_outputs' or 'response_format'"
        )
    return (
        f"unknown field '{param}': vLLM 0.33's request has no such field, and kvledger refuses "
        "fields it would ignore"
    )


def markdown_field_list() -> str:
    """docs/api.md's list of fields, one line each (a test keeps docs/api.md equal to it)."""
    shared = [n for n, s in COMPLETION_FIELDS.items() if CHAT_FIELDS.get(n) == s]
    lines = ["Both endpoints:", ""]
    lines += [_line(n, COMPLETION_FIELDS[n]) for n in shared]
    for title, table in (
        ("`/v1/completions` only:", COMPLETION_FIELDS),
        ("`/v1/chat/completions` only:", CHAT_FIELDS),
    ):
        lines += ["", title, ""]
        lines += [_line(n, s) for n, s in table.items() if n not in shared]
    lines += ["", "`/v1/responses`:", ""]
    lines += [_line(n, s) for n, s in RESPONSES_FIELDS.items()]
    lines += ["", "Inside `structured_outputs` (one constraint of the first five):", ""]
    lines += [_line(n, s) for n, s in STRUCTURED_OUTPUTS_FIELDS.items()]
    return "\n".join(lines) + "\n"


def _line(name: str, support: FieldSupport) -> str:
    return f"- `{name}` ({'refused' if support.refused else 'works'}): {support.note}"
