"""The aiohttp shell: routes, the auth and error middlewares, /v1/models, /health and
/metrics, and `create_app` / `serve` for `kvledger gateway`. The generation endpoints' request
path is `gateway.generate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.typedefs import Middleware
from opentelemetry.trace import Tracer
from redis.exceptions import RedisError

from gateway.bodies import error_body
from gateway.fields import ApiError
from gateway.generate import chat_completions, completions
from gateway.responses_api import add_responses_routes
from gateway.router import tier_costs_of
from gateway.state import GATEWAY, PROBE_MAX_AGE_S, Gateway
from gateway.utility import add_utility_routes, model_body
from observability import (
    get_logger,
    get_tracer,
    metrics_handler,
)
from observability.ratelimit import RateLimitedLog, install_loop_exception_handler
from services.config import GatewayConfig
from services.environment import ConfigError
from services.http_server import CappedSite, connection_cap, limits_of, runner_options
from services.tokenization.load import load_tokenizer
from services.transport import redis_streams

log = get_logger("gateway")

SERVICE_NAME = "kvledger-gateway"
SHUTDOWN_TIMEOUT_S = 10.0  # in-flight requests are ended at shutdown; this only bounds stragglers
CLIENT_CLOSED_REQUEST = 499  # nginx's code; never delivered, the connection is gone
# A waiting request holds no Redis connection (its tokens come through the outputs reader), so
# the pool only serves short commands: enough for a burst of max_queue requests arriving at
# once, capped, and callers past the cap wait for a connection instead of failing.
REDIS_POOL_MAX = 256
REDIS_POOL_TIMEOUT_S = 30.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(
    config: GatewayConfig, redis: aioredis.Redis | None = None, *, tracer: Tracer | None = None
) -> web.Application:
    """The gateway as an aiohttp application; `redis` given here stays open when it stops."""
    owns_redis = redis is None
    if redis is not None:
        client = redis
    elif config.redis_url:
        client = redis_streams.connect_pooled(
            config.redis_url,
            redis_pool_size(config.max_queue, len((config.replicas or "").split(","))),
            REDIS_POOL_TIMEOUT_S,
        )
    else:
        raise ConfigError("the gateway needs Redis: set --redis-url or KVLEDGER_REDIS_URL")
    tokenizer = load_tokenizer(config.model, config.model_name)
    gw = Gateway(config, client, tokenizer, tracer or get_tracer(SERVICE_NAME))

    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[_errors, _auth(config.api_key)],
    )
    app[GATEWAY] = gw

    async def lifetime(_: web.Application) -> AsyncIterator[None]:
        await gw.start()
        yield
        await gw.stop()
        if owns_redis:
            await client.aclose()

    async def on_shutdown(_: web.Application) -> None:
        gw.begin_shutdown()

    app.cleanup_ctx.append(lifetime)
    app.on_shutdown.append(on_shutdown)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    add_responses_routes(app)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    add_utility_routes(app, GATEWAY)
    return app


def redis_pool_size(max_queue: int, replicas: int = 1) -> int:
    # + the long-lived readers: per replica an outputs reader, an events follower and a
    # routing-stream reader (several gateways route as one), and a few spare.
    return min(max_queue, REDIS_POOL_MAX) + 32 + 3 * max(replicas - 1, 0)


async def serve(config: GatewayConfig) -> None:
    """Run the gateway until cancelled or SIGTERM, then shut down gracefully. Logging and
    tracing are set up by the caller (`kvledger gateway` does both)."""
    install_loop_exception_handler(asyncio.get_running_loop())
    runner = make_runner(config)
    await runner.setup()
    try:
        site = await listen(runner, config)
        log.info(
            "gateway_listening", host=config.host, port=site.port,
            max_connections=site.cap.max_connections if site.cap else None,
            header_timeout_s=config.header_timeout_s, body_timeout_s=config.body_timeout_s,
        )  # fmt: skip
        await _until_sigterm()
    finally:
        await runner.cleanup()


def make_runner(config: GatewayConfig, app: web.Application | None = None) -> web.AppRunner:
    return web.AppRunner(
        app or create_app(config),
        handler_cancellation=True,  # a client that hangs up cancels its handler: abort at once
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        access_log=None,  # request_finished / request_rejected events say more
        **runner_options(limits_of(config)),
    )


async def listen(runner: web.AppRunner, config: GatewayConfig) -> CappedSite:
    """The listening socket, with the connection cap in front (runner set up first)."""
    refusals = RateLimitedLog(log)

    def refused(open_connections: int) -> None:
        refusals.log("warning", "connection_refused", open_connections=open_connections,
                     reason="connection cap reached (--max-connections)")  # fmt: skip

    cap = connection_cap(limits_of(config))
    site = CappedSite(runner, config.host, config.port, cap, on_refused=refused)
    await site.start()
    return site


async def _until_sigterm() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Outside the main thread no handler can be set: cancellation alone stops the gateway.
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
    finally:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGTERM)


# --- middlewares ---------------------------------------------------------------------------------


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes an OpenAI-style JSON error body; its log line says how long the
    gateway took to answer it (`elapsed_s`: from the handler's start, e.g. a 429's cost)."""
    started = time.monotonic()
    try:
        return await handler(request)
    except ApiError as exc:
        failed = exc.status >= 500
        (log.warning if failed else log.info)(
            "request_failed" if failed else "request_rejected", path=request.path,
            status=exc.status, param=exc.param,
            error_type=exc.err_type, reason=exc.message,
            elapsed_s=round(time.monotonic() - started, 6),
        )  # fmt: skip
        return _error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error_response(_from_http(exc, request))
    except ConnectionError:  # the client left; aborting its request was done on the way out
        log.info("client_disconnected", path=request.path)
        return web.Response(status=CLIENT_CLOSED_REQUEST)
    except RedisError as exc:
        log.error("redis_unreachable", path=request.path, error=str(exc))
        message = f"the gateway cannot reach Redis ({type(exc).__name__}); retry shortly"
        return _error_response(ApiError(503, message))
    except Exception:
        log.exception("request_crashed", path=request.path)
        return _error_response(ApiError(500, "internal error in the gateway"))


def _auth(api_key: str | None) -> Middleware:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if api_key and request.path.startswith("/v1/") and not _authorized(request, api_key):
            raise ApiError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>' with "
                "the key the gateway was given in KVLEDGER_API_KEY",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return auth


def _authorized(request: web.Request, api_key: str) -> bool:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    try:
        # A header of bytes that are not UTF-8 arrives with surrogates in it: no key matches.
        given = token.strip().encode()
    except UnicodeEncodeError:
        return False
    # Constant-time: the comparison must not reveal how much of a guess was right.
    return scheme.lower() == "bearer" and hmac.compare_digest(given, api_key.encode())


def _error_response(exc: ApiError) -> web.Response:
    body = error_body(exc.message, exc.err_type, exc.status, exc.param)
    return web.json_response(body, status=exc.status, headers=exc.headers)


def _from_http(exc: web.HTTPException, request: web.Request) -> ApiError:
    if exc.status == 404:
        return ApiError(404, f"no route {request.method} {request.path}")
    if exc.status == 405:
        allowed = exc.headers.get("Allow", "")
        message = f"method {request.method} is not allowed on {request.path}; use {allowed}"
        return ApiError(405, message, headers={"Allow": allowed})
    if exc.status == 413:
        limit = request.app[GATEWAY].config.max_body_bytes
        return ApiError(413, f"the request body is larger than the limit of {limit} bytes")
    return ApiError(exc.status, exc.reason)


# --- models, health, metrics ---------------------------------------------------------------------


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    limits = gw.limits(await gw.ledger_status(max_age_s=0))
    card = model_body(gw, limits.model_name, limits.max_model_len)
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    status = await gw.ledger_status(max_age_s=PROBE_MAX_AGE_S)
    gateway = {"gateway_id": gw.gateway_id, "in_flight": gw.in_flight, "settings": gw.settings()}
    if replicas := gw.routing.describe():
        gateway["replicas"] = replicas
    if status is None:
        body = {"status": "unavailable", "message": gw.unavailable_message(None), **gateway}
        return web.json_response(body, status=503)
    ledger = msgspec.to_builtins(status)  # nested records (costs, shared_tier) as objects
    # /metrics shows the counters; v and kind are the wire's; the eviction head is for routers.
    for name in ("metrics", "v", "kind", "eviction"):
        ledger.pop(name, None)
    ledger["tiers"] = tier_costs_of(status)  # each tier's load cost beside the prefill's
    if status.num_workers == 0 or gw.routing.not_ready() is not None:  # not ready
        body = {"status": "unavailable", "message": gw.unavailable_message(status), **gateway}
        return web.json_response({**body, "ledger": ledger}, status=503)
    return web.json_response({"status": "ok", **gateway, "ledger": ledger})


async def metrics(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    with contextlib.suppress(RedisError):  # the gateway's own metrics still render
        await gw.ledger_status(max_age_s=0)  # refreshes the mirrored ledger snapshot
    return await metrics_handler(gw.registry)(request)
