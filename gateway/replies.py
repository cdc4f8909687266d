"""Answering one accepted generation: a whole JSON body, or server-sent events as the tokens come
(`stream_interval` tokens per chunk, usage in every chunk or at the end, `echo` first).
"""

from __future__ import annotations

import contextlib
from typing import Any

from aiohttp import web

from gateway.generate import Delta, Generation, GenerationError
from gateway.logprobs import LogprobsFormatter
from gateway.responses import (
    SSE_DONE,
    Meta,
    chunk_body,
    error_body,
    final_body,
    sse,
    usage_chunk,
)
from services.messages import TokenLogprobs

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def respond(gen: Generation, meta: Meta) -> web.Response:
    job = gen.job
    text = "".join([delta.text async for delta in gen.deltas()])
    tracker = gen.tracker
    token_ids = (job.prompt_token_ids, tracker.token_ids) if job.return_token_ids else None
    shown = LogprobsFormatter(gen.gw.tokenizer, job.logprobs)
    prompt_logprobs = None
    if gen.sampling.prompt_logprobs is not None and tracker.prompt_logprobs is not None:
        prompt_logprobs = shown.prompt_logprobs(tracker.prompt_logprobs)
    body = final_body(
        meta,
        (job.echo_text or "") + text,
        gen.finish_reason,
        gen.stop_reason,
        gen.usage(),
        token_ids,
        role=job.role,
        prompt_text=job.prompt_text,
        logprobs=_logprobs(gen, shown, tracker.token_ids, tracker.logprobs, echo=True),
        prompt_logprobs=prompt_logprobs,
    )
    return web.json_response(body)


def _logprobs(
    gen: Generation,
    shown: LogprobsFormatter,
    token_ids: list[int],
    entries: list[TokenLogprobs],
    echo: bool,
    text_offset: int = 0,
) -> dict[str, Any] | None:
    """A choice's (or chunk's) logprobs; completions' echo shows the prompt's first, as vLLM."""
    if gen.sampling.logprobs is None:
        return None
    if gen.job.kind == "chat":
        return shown.chat(token_ids, entries)
    if echo and gen.job.echo_text is not None:
        prompt: list[TokenLogprobs | None] = [None, *(gen.tracker.prompt_logprobs or [])]
        return shown.completion(
            [*gen.job.prompt_token_ids, *token_ids], [*prompt, *entries], text_offset
        )
    return shown.completion(token_ids, entries, text_offset)


async def stream(request: web.Request, gen: Generation, meta: Meta) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        await _write_chunks(response, gen, meta)
    except GenerationError as exc:  # headers are gone: the error travels as an event
        gen.ended_by = exc
        with contextlib.suppress(ConnectionError):
            await response.write(sse(error_body(exc.message, exc.err_type, code=exc.status)))
            await response.write(SSE_DONE)
    except ConnectionError as exc:  # the client hung up mid-stream
        gen.ended_by = exc
    return response


async def _write_chunks(response: web.StreamResponse, gen: Generation, meta: Meta) -> None:
    job = gen.job
    with_ids = job.return_token_ids
    prompt_ids = job.prompt_token_ids if with_ids else None
    echo = job.echo_text or ""
    if meta.kind == "chat":
        first = chunk_body(meta, "", role=job.role, prompt_token_ids=prompt_ids)
        if job.prompt_text is not None:
            first["prompt_text"] = job.prompt_text
        await response.write(sse(first))
        prompt_ids = None
        if echo:  # vLLM sends the echoed content as its own chunk after the role
            await response.write(sse(chunk_body(meta, echo)))
            echo = ""
    pending = Delta("")  # tokens held back until stream_interval of them are ready
    sent_any = False
    shown = LogprobsFormatter(gen.gw.tokenizer, job.logprobs)
    text_offset = 0  # completions' logprobs.text_offset runs on across chunks
    async for delta in gen.deltas():
        pending = Delta(
            pending.text + delta.text,
            pending.token_ids + delta.token_ids,
            delta.finish_reason,
            pending.logprobs + delta.logprobs,
        )
        # The first and the last chunk go at once; the others wait for stream_interval tokens.
        ready = not sent_any or len(pending.token_ids) >= job.stream_interval
        if not ready and delta.finish_reason is None:
            continue
        if not (pending.text or pending.finish_reason or with_ids or echo):
            continue  # a token whose character is not complete yet
        stop_reason = gen.stop_reason if pending.finish_reason else None
        token_ids = pending.token_ids if with_ids else None
        logprobs = _logprobs(
            gen, shown, pending.token_ids, pending.logprobs, bool(echo), text_offset
        )
        if logprobs is not None and logprobs.get("tokens"):
            text_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        body = chunk_body(
            meta,
            echo + pending.text,
            pending.finish_reason,
            stop_reason,
            token_ids,
            prompt_ids,
            logprobs=logprobs,
        )
        if job.continuous_usage:
            body["usage"] = gen.usage().body()
        await response.write(sse(body))
        prompt_ids, echo, sent_any = None, "", True
        pending = Delta("")
    if job.include_usage:
        await response.write(sse(usage_chunk(meta, gen.usage())))
    await response.write(SSE_DONE)
