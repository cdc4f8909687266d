"""The request path of /v1/completions and /v1/chat/completions, step by step (`_run`):

1. read the body (408 past --body-timeout-s) and parse it into jobs (`gateway.protocol`:
   validation, tokenization; a 400 names the field);
2. admission: a place in --max-queue (429 past it) and a live ledger's limits;
3. one job per sequence (`fan_out`: n samples of every prompt, best_of's candidates);
4. each job routed to a replica and put on its requests stream (`gateway.inflight.Generation`,
   which `gateway.router` routes);
5. the reply: one JSON body or server-sent events (`gateway.answer`, bodies in `gateway.bodies`).

The request's SERVER span is the root of its trace; the ledger and the workers join it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiohttp import web
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from gateway.answer import respond, stream, total_usage
from gateway.bodies import Meta
from gateway.fields import ApiError
from gateway.inflight import Generation
from gateway.protocol import Job, fan_out, parse_chat, parse_completion, parse_json, resolve
from gateway.state import GATEWAY, Gateway
from observability import Attr, get_logger
from observability.ratelimit import RateLimitedLog

log = get_logger("gateway")
_slow_clients = RateLimitedLog(log)  # a flood of slow bodies logs a line per interval


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    """The request's SERVER span is the root of its trace; the ledger and workers join it."""
    gw = request.app[GATEWAY]
    attributes = {
        Attr.HTTP_REQUEST_METHOD: request.method,
        Attr.URL_PATH: request.path,
        Attr.GEN_AI_OPERATION_NAME: "chat" if kind == "chat" else "text_completion",
    }
    with gw.tracer.start_as_current_span(
        f"{request.method} {request.path}", kind=SpanKind.SERVER, attributes=attributes,
        record_exception=False, set_status_on_exception=False,
    ) as span:  # fmt: skip
        try:
            response = await _run(request, gw, kind, span)
        except ApiError as exc:
            span.set_attribute(Attr.HTTP_RESPONSE_STATUS_CODE, exc.status)
            if exc.status >= 500:
                span.set_status(Status(StatusCode.ERROR, exc.message))
            raise
        span.set_attribute(Attr.HTTP_RESPONSE_STATUS_CODE, response.status)
        return response


async def _run(request: web.Request, gw: Gateway, kind: str, span: Span) -> web.StreamResponse:
    arrival = time.monotonic()
    body = parse_json(await read_body(request, gw.config.body_timeout_s))
    jobs = await asyncio.to_thread(_parse, gw, kind, body)  # tokenizing may take a while
    async with gw.admit():
        limits = gw.limits(await gw.wait_for_ledger())
        # One ledger request per choice (n samples of every prompt), all under one response id.
        children = fan_out([resolve(job, limits) for job in jobs])
        span.set_attribute(Attr.GEN_AI_REQUEST_MODEL, limits.model_name)
        gens: list[Generation] = []
        for job in children:
            response_id = gens[0].response_id if gens else None
            gens.append(Generation(gw, job, lambda: client_gone(request), arrival, response_id))
        try:
            async with contextlib.AsyncExitStack() as stack:
                for gen in gens:
                    await stack.enter_async_context(gen)
                meta = Meta(kind, gens[0].response_id, int(time.time()), limits.model_name)
                if children[0].stream:
                    return await stream(request, gens, meta)
                return await respond(gens, meta)
        finally:
            span.set_attributes(gens[0].span_attributes(total_usage(gens)))


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body within timeout_s: a client trickling it would hold a slot forever."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        _slow_clients.log("info", "request_body_timeout", path=request.path, timeout_s=timeout_s)
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout_s:g}s (--body-timeout-s)",
            headers={"Connection": "close"},
        ) from None


def _parse(gw: Gateway, kind: str, body: dict[str, Any]) -> list[Job]:
    if kind == "chat":
        return [parse_chat(body, gw.tokenizer, gw.tool_settings)]
    return parse_completion(body, gw.tokenizer, gw.config.default_max_tokens)


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()
