"""External replicas: OpenAI-compatible servers (vLLM's) the gateway routes to like its own
replicas and proxies requests to (`--external-replica NAME=URL`).

A request routed to one is sent on unchanged (body bytes, headers less the hop-by-hop ones, a
traceparent added) and its answer comes back as the server sent it: status, headers, body bytes
as they arrive (server-sent events pass through as they are written). Whether a server answers
is probed once a second (`GET /health`, vLLM's and kvledger's); one that does not, or whose
connection fails under a request, is out until it answers again (`out_reason`). A request whose
server does not answer ends in a 502; one whose stream breaks ends with an error event.

The first answer also checks the tokenizer: the server's `/tokenize` of a probe text must be
the gateway's, since the gateway hashes prompts with its own tokenizer to find them in the
server's KV events. A server that tokenizes otherwise is out, with a line saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
from aiohttp import web
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from prometheus_client import CollectorRegistry, Counter

from gateway.bodies import error_body
from gateway.fields import ApiError
from observability import Attr, get_logger, inject_traceparent
from services.tokenization.tokenizer import Tokenizer

log = get_logger("gateway.upstream")

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 5.0
RETRY_AFTER_S = 1
# Never forwarded either way: they describe one connection, not the message (RFC 9110 7.6.1),
# and the lengths are the transport's to set.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length"}
)  # fmt: skip
TOKENIZER_PROBE = "The gateway hashes prompts as this server will: Grüße, 東京, 12345 tokens."


class Upstreams:
    """The external replicas by name: their base URLs, whether each answers, and the proxy."""

    def __init__(
        self,
        urls: dict[str, str],
        tokenizer: Tokenizer,
        tracer: Tracer,
        registry: CollectorRegistry,
        request_timeout_s: float,
    ) -> None:
        self.urls = urls
        self.tokenizer = tokenizer
        self.tracer = tracer
        self.request_timeout_s = request_timeout_s
        self.session: aiohttp.ClientSession | None = None
        self.out: dict[str, str] = {}  # name -> why it is out (absent: it answers)
        self.probed: set[str] = set()  # answered or failed a probe since the gateway started
        self.tokenizer_checked: set[str] = set()
        self._tasks: list[asyncio.Task] = []
        self._proxied = Counter(
            "kvledger:proxied_requests",
            "Requests proxied to an external replica, by the status it answered (unreachable: "
            "no answer; broken: the answer was cut off).",
            ("replica", "status"),
            registry=registry,
        )

    def __contains__(self, name: object) -> bool:
        return name in self.urls

    def out_reason(self, name: str) -> str | None:
        """Why the server is not to be sent anything now (None: it answers)."""
        return self.out.get(name)

    # --- lifetime ----------------------------------------------------------------------------

    async def start(self) -> None:
        # auto_decompress off: a compressed answer passes through as the server compressed it.
        self.session = aiohttp.ClientSession(auto_decompress=False)
        for name in self.urls:
            self._tasks.append(asyncio.create_task(self._probe_forever(name), name=f"probe-{name}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.session is not None:
            await self.session.close()

    # --- health ------------------------------------------------------------------------------

    async def _probe_forever(self, name: str) -> None:
        while True:
            await self.probe(name)
            await asyncio.sleep(PROBE_INTERVAL_S)

    async def probe(self, name: str) -> None:
        assert self.session is not None
        url = f"{self.urls[name]}/health"
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        try:
            async with self.session.get(url, timeout=timeout) as reply:
                await reply.read()
                reason = None if reply.status == 200 else f"GET {url} answered {reply.status}"
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            reason = f"GET {url} failed: {_describe(exc)}"
        if reason is None and name not in self.tokenizer_checked:
            reason = await self._check_tokenizer(name)
        self.probed.add(name)
        self._set_out(name, reason)

    async def _check_tokenizer(self, name: str) -> str | None:
        """Why the server's tokenizer is not the gateway's (None: the same, or it cannot say)."""
        assert self.session is not None
        url = f"{self.urls[name]}/tokenize"
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        try:
            async with self.session.post(
                url, json={"prompt": TOKENIZER_PROBE}, timeout=timeout
            ) as reply:
                body = await reply.read()
                if reply.status != 200:
                    log.warning(
                        "upstream_tokenizer_unchecked", replica=name, url=url, status=reply.status,
                        reason="the server does not serve /tokenize; make sure the gateway's "
                        "--model has the server's tokenizer files",
                    )  # fmt: skip
                    self.tokenizer_checked.add(name)
                    return None
                theirs = json.loads(body).get("tokens")
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, AttributeError) as exc:
            return f"POST {url} failed: {_describe(exc)}"
        self.tokenizer_checked.add(name)
        ours = self.tokenizer.encode(TOKENIZER_PROBE)
        if theirs == ours:
            return None
        self.tokenizer_checked.discard(name)  # asked again each probe: a fixed server comes back
        return (
            f"the server tokenizes differently from this gateway ({len(theirs or [])} tokens for "
            f"a probe text where the gateway's --model gives {len(ours)}): prompts hashed here "
            "would never match its KV events. Give the gateway the server's tokenizer files"
        )

    def _set_out(self, name: str, reason: str | None) -> None:
        before = self.out.get(name)
        if reason is None:
            if self.out.pop(name, None) is not None:
                log.info("upstream_back", replica=name, url=self.urls[name])
            return
        self.out[name] = reason
        if before != reason:
            log.warning("upstream_out", replica=name, url=self.urls[name], reason=reason)

    # --- the proxy ---------------------------------------------------------------------------

    async def proxy(self, request: web.Request, body: bytes, name: str) -> web.StreamResponse:
        """`request` (its body already read) to replica `name`, and its answer back as sent."""
        assert self.session is not None
        url = f"{self.urls[name]}{request.path_qs}"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        timeout = aiohttp.ClientTimeout(
            total=self.request_timeout_s, sock_connect=CONNECT_TIMEOUT_S
        )
        with self.tracer.start_as_current_span(
            f"{request.method} {request.path}", kind=SpanKind.CLIENT,
            attributes={Attr.ROUTE_REPLICA: name, "url.full": url},
            record_exception=False, set_status_on_exception=False,
        ) as span:  # fmt: skip
            traceparent = inject_traceparent(span)
            if traceparent is not None:
                headers["traceparent"] = traceparent
            try:
                upstream = await self.session.request(
                    request.method, url, data=body, headers=headers, timeout=timeout
                )
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                why = _describe(exc)
                self._set_out(name, f"{request.method} {url} failed: {why}")
                self._proxied.labels(name, "unreachable").inc()
                span.set_status(Status(StatusCode.ERROR, why))
                raise ApiError(
                    502,
                    f"replica {name} ({self.urls[name]}) did not answer: {why}. It gets no "
                    f"request until GET {self.urls[name]}/health answers again",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                ) from None
            async with upstream:
                span.set_attribute(Attr.HTTP_RESPONSE_STATUS_CODE, upstream.status)
                return await self._relay(request, upstream, name)

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse, name: str
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for key, value in upstream.headers.items():
            if key.lower() not in HOP_BY_HOP:
                response.headers.add(key, value)
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        await response.prepare(request)
        chunks = upstream.content.iter_any()
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                await self._broken(request, response, upstream, name, _describe(exc))
                return response
            await response.write(chunk)  # a client gone raises here: the upstream is dropped
        await response.write_eof()
        self._proxied.labels(name, str(upstream.status)).inc()
        return response

    async def _broken(
        self,
        request: web.Request,
        response: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
        name: str,
        why: str,
    ) -> None:
        """The server's answer stopped midway: a stream ends with an error event (as vLLM ends
        a stream that fails), any other answer with the connection closed short of its length."""
        self._set_out(name, f"its answer to {request.path} broke off: {why}")
        self._proxied.labels(name, "broken").inc()
        log.warning("upstream_answer_broken", replica=name, path=request.path, error=why)
        if upstream.content_type == "text/event-stream":
            message = f"replica {name} ({self.urls[name]}) stopped answering midway: {why}"
            event = json.dumps(error_body(message, "BadGateway", 502))
            with contextlib.suppress(ConnectionError):
                await response.write(f"data: {event}\n\ndata: [DONE]\n\n".encode())
                await response.write_eof()
            return
        if request.transport is not None:
            request.transport.close()


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
