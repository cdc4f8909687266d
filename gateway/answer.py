"""Answering one accepted request, whose choices are one generation each (n samples of every
prompt, or best_of's candidates): a whole JSON body once all have finished, or server-sent
events as each choice's tokens come (`stream_interval` tokens per chunk, usage in every chunk or
at the end, `echo` first), choices interleaved and told apart by their index.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from gateway import tools
from gateway.bodies import (
    SSE_DONE,
    Meta,
    Usage,
    chunk_body,
    combined_body,
    error_body,
    final_body,
    sse,
    usage_chunk,
)
from gateway.inflight import Delta, Generation, GenerationError
from gateway.logprobs import LogprobsFormatter
from services.wire.messages import TokenLogprobs

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def total_usage(gens: list[Generation]) -> Usage:
    """Every choice's output tokens; each prompt's tokens (and cache hit) once, as vLLM."""
    usage = Usage(0, 0, 0)
    counted: set[int] = set()
    for gen in gens:
        own = gen.usage()
        if gen.job.prompt_index in counted:
            own = Usage(0, own.completion_tokens, 0)
        counted.add(gen.job.prompt_index)
        usage += own
    return usage


async def respond(gens: list[Generation], meta: Meta) -> web.Response:
    texts: dict[int, str] = {}

    async def collect(i: int, gen: Generation) -> None:
        texts[i] = "".join([delta.text async for delta in gen.deltas()])

    await run_all(gens, [collect(i, g) for i, g in enumerate(gens)])
    chosen = best_of(gens) if gens[0].job.best_of is not None else list(enumerate(gens))
    bodies = [_final(gen, meta, texts[i]) for i, gen in chosen]
    return web.json_response(combined_body(bodies, total_usage(gens)))


def best_of(gens: list[Generation]) -> list[tuple[int, Generation]]:
    """OpenAI's best_of: per prompt, the n samples with the highest mean logprob per token."""
    chosen = []
    for prompt_index in sorted({g.job.prompt_index for g in gens}):
        candidates = [(i, g) for i, g in enumerate(gens) if g.job.prompt_index == prompt_index]
        candidates.sort(key=lambda c: -_mean_logprob(c[1]))
        chosen += sorted(candidates[: candidates[0][1].job.n], key=lambda c: c[0])
    return chosen


def _mean_logprob(gen: Generation) -> float:
    entries = gen.tracker.logprobs
    return sum(e.logprobs[0] for e in entries) / len(entries) if entries else float("-inf")


def _final(gen: Generation, meta: Meta, text: str) -> dict[str, Any]:
    job, tracker = gen.job, gen.tracker
    content: str | None = "" if job.echo_only else text
    finish, tool_calls = gen.finish_reason, []
    if job.tools is not None and finish is not None:
        read = tools.answer(job.tools, gen.gw.tool_settings, text, finish)
        content, tool_calls, finish = read.content, read.tool_calls, read.finish_reason
    if job.echo_text:
        content = job.echo_text + (content or "")
    token_ids = (job.prompt_token_ids, tracker.token_ids) if job.return_token_ids else None
    shown = LogprobsFormatter(gen.gw.tokenizer, job.logprobs)
    prompt_logprobs = None
    if gen.sampling.prompt_logprobs is not None and tracker.prompt_logprobs is not None:
        prompt_logprobs = shown.prompt_logprobs(tracker.prompt_logprobs)
    return final_body(
        meta,
        content,
        finish,
        gen.stop_reason,
        gen.usage(),
        token_ids,
        role=job.role,
        prompt_text=job.prompt_text,
        logprobs=_logprobs(gen, shown, tracker.token_ids, tracker.logprobs, echo=True),
        prompt_logprobs=prompt_logprobs,
        tool_calls=tool_calls,
    )


def _logprobs(
    gen: Generation,
    shown: LogprobsFormatter,
    token_ids: list[int],
    entries: list[TokenLogprobs],
    echo: bool,
    text_offset: int = 0,
) -> dict[str, Any] | None:
    """A choice's (or chunk's) logprobs; completions' echo shows the prompt's first, as vLLM."""
    if gen.sampling.logprobs is None or gen.job.logprobs.hidden:
        return None
    if gen.job.kind == "chat":
        return shown.chat(token_ids, entries)
    if echo and gen.job.echo_text is not None:
        prompt: list[TokenLogprobs | None] = [None, *(gen.tracker.prompt_logprobs or [])]
        if gen.job.echo_only:  # scoring: the prompt's logprobs, not the sampled token's
            return shown.completion(gen.job.prompt_token_ids, prompt, text_offset)
        return shown.completion(
            [*gen.job.prompt_token_ids, *token_ids], [*prompt, *entries], text_offset
        )
    return shown.completion(token_ids, entries, text_offset)


async def run_all(gens: list[Generation], work: list[Coroutine[Any, Any, None]]) -> None:
    """Run every choice's work at once; the first failure cancels the others and is raised
    (every generation is told, so that each aborts its ledger request with that reason)."""
    try:
        async with asyncio.TaskGroup() as group:
            for coroutine in work:
                group.create_task(coroutine)
    except BaseExceptionGroup as group_error:
        first = _first_leaf(group_error)
        for gen in gens:
            gen.ended_by = gen.ended_by or first
        raise first from None


def _first_leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):
        # Prefer what the client should hear (an API error) over a sibling's cancellation.
        leaves = list(error.exceptions)
        error = next((e for e in leaves if isinstance(e, GenerationError)), leaves[0])
    return error


async def stream(request: web.Request, gens: list[Generation], meta: Meta) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        await _write_chunks(response, gens, meta)
    except GenerationError as exc:  # headers are gone: the error travels as an event
        with contextlib.suppress(ConnectionError):
            await response.write(sse(error_body(exc.message, exc.err_type, exc.status)))
            await response.write(SSE_DONE)
    except ConnectionError:  # the client hung up mid-stream (run_all told every generation)
        pass
    return response


async def _write_chunks(response: web.StreamResponse, gens: list[Generation], meta: Meta) -> None:
    choices = [_ChoiceStream(gen, meta, index) for index, gen in enumerate(gens)]
    for choice in choices:  # vLLM sends every choice's opening chunks first
        for body in choice.opening():
            await response.write(sse(body))
    lock = asyncio.Lock()  # one event at a time on the wire

    async def pump(choice: _ChoiceStream) -> None:
        async for delta in choice.gen.deltas():
            body = choice.push(delta)
            if body is not None:
                async with lock:
                    await response.write(sse(body))

    await run_all(gens, [pump(c) for c in choices])
    if gens[0].job.include_usage:
        await response.write(sse(usage_chunk(meta, total_usage(gens))))
    await response.write(SSE_DONE)


class _ChoiceStream:
    """One choice's chunks: held back until `stream_interval` tokens are ready, the prompt (and
    its token ids) with the first, completions' logprobs offsets running on across chunks."""

    def __init__(self, gen: Generation, meta: Meta, index: int) -> None:
        self.gen, self.meta, self.index = gen, meta, index
        job = gen.job
        # vLLM's completions stream the prompt's ids with its echo too, asked for or not.
        echoed = job.kind == "completion" and job.echo_text is not None
        self.prompt_ids = job.prompt_token_ids if job.return_token_ids or echoed else None
        self.echo = job.echo_text or ""
        self.echoing = job.echo_text is not None  # until the first chunk has gone
        self.pending = Delta("")
        self.sent_any = False
        self.shown = LogprobsFormatter(gen.gw.tokenizer, job.logprobs)
        self.text_offset = 0
        self.tools = None  # chat with tool calls read from the output
        if job.kind == "chat" and job.tools is not None:
            self.tools = tools.tool_stream(job.tools, gen.gw.tool_settings)

    def opening(self) -> list[dict[str, Any]]:
        """Chat's role chunk (and vLLM's separate echo chunk) before any token; under
        continuous usage both carry the prompt's usage with 0 completion tokens, as vLLM's."""
        job = self.gen.job
        if self.meta.kind != "chat":
            return []
        first = chunk_body(
            self.meta, "", role=job.role, prompt_token_ids=self.prompt_ids, index=self.index
        )
        if job.prompt_text is not None:
            first["prompt_text"] = job.prompt_text
        bodies = [first]
        if self.echo:
            bodies.append(chunk_body(self.meta, self.echo, index=self.index))
        if job.continuous_usage:
            for body in bodies:
                body["usage"] = Usage(len(job.prompt_token_ids), 0, 0).counts()
        self.prompt_ids, self.echo, self.echoing = None, "", False
        return bodies

    def push(self, delta: Delta) -> dict[str, Any] | None:
        gen, job, pending = self.gen, self.gen.job, self.pending
        pending = self.pending = Delta(
            pending.text + delta.text,
            pending.token_ids + delta.token_ids,
            delta.finish_reason,
            pending.logprobs + delta.logprobs,
        )
        # The first and the last chunk go at once; the others wait for stream_interval tokens.
        ready = not self.sent_any or len(pending.token_ids) >= job.stream_interval
        if not ready and delta.finish_reason is None:
            return None
        if not (pending.text or pending.finish_reason or job.return_token_ids or self.echoing):
            return None  # a token whose character is not complete yet
        logprobs = _logprobs(
            gen, self.shown, pending.token_ids, pending.logprobs, self.echoing, self.text_offset
        )
        if logprobs is not None and logprobs.get("tokens"):
            self.text_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        text: str | None = self.echo + ("" if job.echo_only else pending.text)
        finish, calls = pending.finish_reason, None
        if self.tools is not None:
            text, calls = self.tools.push(pending.text)
            if finish is not None:
                finish = tools.finish_reason(job.tools, finish, self.tools.called)
            if not (text or calls or finish or job.return_token_ids or logprobs):
                self.pending = Delta("")  # the parser holds it back (a tag, a name not done)
                return None
        body = chunk_body(
            self.meta,
            text,
            finish,
            gen.stop_reason if finish else None,
            pending.token_ids if job.return_token_ids else None,
            self.prompt_ids,
            logprobs=logprobs,
            index=self.index,
            tool_calls=calls,
        )
        if job.continuous_usage:
            body["usage"] = gen.usage().counts()
        self.prompt_ids, self.echo, self.echoing, self.sent_any = None, "", False, True
        self.pending = Delta("")
        return body
