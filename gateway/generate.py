"""The request path of /v1/completions and /v1/chat/completions, step by step (`_run`):

1. admission, cheaply: a 429 at once when no place in --max-queue is free, before the body is
   read or tokenized (a burst past the queue costs next to nothing);
2. read the body (408 past --body-timeout-s) and count its sequences (prompts x n, or x best_of,
   `count_sequences`): each takes a place in --max-queue (429 when they are not free; a 400
   naming the field when they never could be);
3. wait for a setup turn (`Gateway.setting_up`: SETUP_CONCURRENCY admitted requests are set up
   at once, in order of arrival, so that a burst's setups cannot fill every loop turn), then
   parse it into jobs (`gateway.protocol`: validation, tokenization in a thread; a 400 names
   the field) against a live ledger's limits;
4. one job per sequence (`fan_out`: n samples of every prompt, best_of's candidates), each
   routed to a replica and put on its requests stream (`gateway.inflight.Generation`, which
   `gateway.router` routes), a fan-out a few at a time (`gateway.fanout`); the setup turn ends
   once the first are on the stream. With external
   replicas (other OpenAI servers) the whole request goes to one, chosen for its first prompt:
   there it is proxied unchanged (`gateway.upstream`), and that ends it here;
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

from gateway import genai
from gateway.answer import respond, stream, total_usage
from gateway.bodies import Meta
from gateway.fanout import FanOut, in_flight_bound
from gateway.fields import ApiError
from gateway.inflight import Generation
from gateway.prompts import count_sequences
from gateway.protocol import Job, fan_out, parse_chat, parse_completion, parse_json, resolve
from gateway.state import GATEWAY, Gateway
from observability import Attr, get_logger
from observability.ratelimit import RateLimitedLog

log = get_logger("gateway")
_slow_clients = RateLimitedLog(log)  # a flood of slow bodies logs a line per interval
PARSE_INLINE_BYTES = 64 * 1024  # a body this small parses in well under a millisecond


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    """The request's SERVER span is the root of its trace; its GenAI span (`gateway.genai`)
    holds the generation, and the ledger and workers join that."""
    gw = request.app[GATEWAY]
    attributes = {Attr.HTTP_REQUEST_METHOD: request.method, Attr.URL_PATH: request.path}
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
    gw.refuse_when_full()  # before reading: a full gateway answers a burst at once
    raw = await read_body(request, gw.config.body_timeout_s)
    # A large body is parsed off the loop, so that /health and the others keep answering.
    body = (
        parse_json(raw)
        if len(raw) < PARSE_INLINE_BYTES
        else await asyncio.to_thread(parse_json, raw)
    )
    places = count_sequences(kind, body, gw.config.max_queue)
    async with gw.admit(places), gw.setting_up() as set_up:
        jobs = await asyncio.to_thread(_parse, gw, kind, body)  # tokenizing may take a while
        status = await gw.wait_for_ledger()
        limits = gw.limits(status)
        # One ledger request per choice (n samples of every prompt), all under one response id.
        children = fan_out([resolve(job, limits) for job in jobs])
        assert len(children) == places, "count_sequences and fan_out disagree"
        model, operation = limits.model_name, genai.operation_name(kind)
        first = Generation(gw, children[0], lambda: client_gone(request), arrival)
        if gw.upstreams is not None:  # some replicas are other servers: route the request whole
            first.route = gw.routing.route(children[0], first.req_id)
            if first.route.replica in gw.upstreams:
                set_up()
                try:
                    return await gw.upstreams.proxy(request, raw, first.route.replica)
                finally:
                    gw.routing.release(first.req_id)
        # A trace left out (or tracing off): its GenAI span would be the server span's own
        # non-recording span (kvledger's samplers follow the parent), so it is that, for free.
        genai_span = (
            gw.tracer.start_as_current_span(
                genai.span_name(operation, model), record_exception=False,
                set_status_on_exception=False,
            )
            if span.is_recording()
            else contextlib.nullcontext(span)
        )  # fmt: skip
        with genai_span as generation:
            if generation.is_recording():
                generation.set_attributes(genai.request_attributes(children[0], operation, model))
            gens: list[Generation] = [first]
            try:
                for job in children[1:]:
                    gen = Generation(
                        gw, job, lambda: client_gone(request), arrival, first.response_id
                    )
                    if first.route is not None:  # the request's other sequences follow it
                        gen.route = gw.routing.pin(job, gen.req_id, first.route.replica)
                    gens.append(gen)
                async with contextlib.AsyncExitStack() as stack:
                    fan = FanOut(gens, stack, bound=in_flight_bound(status), shares=gw.shares)
                    try:
                        await fan.start()
                        set_up()  # its first sequences are on the stream: the next one's turn
                        meta = Meta(kind, gens[0].response_id, int(time.time()), model)
                        if children[0].stream:
                            return await stream(request, gens, meta)
                        return await respond(gens, meta)
                    finally:
                        await fan.close()  # nothing more is enqueued once the response ends
            except BaseException as exc:
                for gen in gens:  # decided before and never entered: no longer pending
                    gw.routing.release(gen.req_id)
                error = exc.err_type if isinstance(exc, ApiError) else type(exc).__name__
                generation.set_attribute(Attr.ERROR_TYPE, error)
                generation.set_status(Status(StatusCode.ERROR, str(exc)))
                raise
            finally:
                if generation.is_recording():  # a trace the sampler left out costs nothing here
                    generation.set_attributes(
                        genai.response_attributes(gens, total_usage(gens), model, arrival)
                    )
                    if gens:
                        span.set_attribute(Attr.REQUEST_ID, gens[0].req_id)


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
