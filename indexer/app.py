"""The indexer's HTTP side: `POST /score` and `GET /health` over a `ReplicaSet`.

It answers what llm-d's KV-cache indexer answers, from kvledger's own events: for a prompt (token
ids, or text it tokenizes with the model's tokenizer) and its cache salt, how many leading blocks
and tokens each replica holds, hashed exactly as that replica's ledger hashes (its block size and
algorithm, from its status key; NONE_HASH from PYTHONHASHSEED), and where the rest of them
would come from there (its CPU tier, the shared tier, or computed). Only the blocks a ledger
could hit count, never the prompt's last token, which a ledger always computes. Each replica's health
comes with its score: `stale` (its events or status are behind, the count may be old) or `out`
(its ledger stopped answering): routers should weigh or drop those.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import redis.asyncio as aioredis
from aiohttp import web
from redis.exceptions import RedisError

from indexer.score import ScoreRequestError, read_score_request
from ledger.events import MEDIUM_CPU
from observability import get_logger
from observability.ratelimit import RateLimitedLog
from services.config import IndexerConfig
from services.environment import ConfigError
from services.http_server import CappedSite, connection_cap, limits_of, runner_options
from services.routing.costs import MeasuredCosts
from services.routing.policy import (
    HealthLimits,
    Precise,
    ReplicaHealth,
    Router,
    RouteRequest,
)
from services.routing.replicas import ReplicaSet, parse_replicas
from services.routing.shared import SharedPending
from services.tiers.view import SharedTierViews
from services.tokenization.load import load_tokenizer
from services.tokenization.tokenizer import Tokenizer
from services.transport import redis_streams
from services.transport.registry import known_replicas

log = get_logger("indexer")

REPLICAS = web.AppKey("replicas", ReplicaSet)
ROUTER = web.AppKey("router", Router)
# The shared tiers the indexer sees into, by namespace (a catalog follower each).
SHARED_TIERS = web.AppKey("shared_tiers", SharedTierViews)
SHARED = web.AppKey("shared", SharedPending)
TOKENIZER = web.AppKey("tokenizer", Tokenizer)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(config: IndexerConfig, redis: aioredis.Redis | None = None) -> web.Application:
    """The indexer as an aiohttp application; `redis` given here stays open when it stops."""
    if redis is None and not config.redis_url:
        raise ConfigError("the indexer needs Redis: set --redis-url or KVLEDGER_REDIS_URL")
    try:
        replicas = parse_replicas(config.replicas, config.stream_prefix)
        limits = HealthLimits(config.stale_after_s, config.out_after_s)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    client = redis if redis is not None else redis_streams.connect(str(config.redis_url))
    replica_set = ReplicaSet(client, replicas, checkpoint_dir=config.checkpoint_dir, limits=limits)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[_errors])
    app[REPLICAS] = replica_set
    # The gateway's precise policy and measured costs, asked to score, never to route.
    shared_tiers = replica_set.shared_tiers  # each catalog followed once a status names it
    app[SHARED_TIERS] = shared_tiers
    app[ROUTER] = Router(
        Precise(replica_set.cached_blocks, replica_set.cpu_blocks, shared_tiers),
        replica_set.names,
        costs=MeasuredCosts(),
    )
    app[TOKENIZER] = load_tokenizer(config.model)

    async def lifetime(_: web.Application) -> AsyncIterator[None]:
        await replica_set.start()
        yield
        await replica_set.stop()
        if redis is None:
            await client.aclose()

    app.cleanup_ctx.append(lifetime)
    app.router.add_post("/score", score)
    app.router.add_get("/health", health)
    return app


async def score(request: web.Request) -> web.Response:
    """Each replica's prefix for the prompt and what sending it there would cost; `best` the
    cheapest when some replica holds a prefix of it, null when none does (then the choice is
    load balancing, which a stateless answer cannot share out: every router following a
    `best` of equals would send every new prompt to the same replica)."""
    try:
        body = await request.json()
    except json.JSONDecodeError as exc:
        raise _bad_request(f"body: not JSON ({exc.msg} at character {exc.pos})", None) from None
    try:
        wanted = read_score_request(body, request.app[TOKENIZER])
    except ScoreRequestError as exc:
        raise _bad_request(str(exc), exc.param) from None
    replicas, router = request.app[REPLICAS], request.app[ROUTER]
    loads, healths, now = replicas.loads(), replicas.healths(), time.time()
    router.costs.prepare(loads)
    scores: dict[str, dict] = {}
    costs: dict[str, float] = {}
    held = False
    for name in replicas.names:
        health = healths[name]
        hashes = replicas.block_hashes(name, wanted.token_ids, wanted.cache_salt)
        status = replicas.replicas[name].status
        block_size = status.block_size if status is not None else None
        cached = replicas.cached_blocks(name, hashes) if hashes is not None else 0
        route = RouteRequest(len(wanted.token_ids), hashes or [], block_size or 1)
        scored = router.score(name, route, loads, healths, now)
        size = block_size or 0
        scores[name] = {
            "cached_blocks": cached,
            "cached_tokens": cached * size,
            "block_size": block_size,
            "health": health.value,
            "expected_cached_tokens": scored.hit_tokens if block_size else 0,
            "evicted_blocks": scored.evicted_blocks,
            "pending_requests": router.pending.on(name),
            # Where the prompt's blocks would come from there: its GPU (at admission), then
            # loads from its CPU tier or the shared tier; the rest is computed.
            "gpu_blocks": scored.cached_blocks if block_size else 0,
            "gpu_tokens": scored.cached_tokens if block_size else 0,
            "cpu_blocks": scored.cpu_blocks,
            "cpu_tokens": scored.cpu_blocks * size,
            "shared_blocks": scored.shared_blocks,
            "shared_tokens": scored.shared_blocks * size,
            "load_cost": round(scored.load_cost, 6),
            "tier_cost": round(scored.tier_cost, 6),
            "cost": round(scored.cost, 6),
        }
        if health is not ReplicaHealth.OUT:
            costs[name] = scored.cost
            held = held or scored.cached_blocks + scored.cpu_blocks + scored.shared_blocks > 0
    best = min(costs, key=lambda n: costs[n]) if held else None
    return web.json_response(
        {
            "num_tokens": len(wanted.token_ids),
            "best": best,
            "cost_unit": router.costs.unit,
            "replicas": scores,
        }
    )


async def health(request: web.Request) -> web.Response:
    """200 while at least one replica is live, 503 otherwise; each replica's view either way."""
    replicas = request.app[REPLICAS]
    report = {}
    for name, state in replicas.replicas.items():
        sub = state.subscriber
        report[name] = {
            "health": replicas.health(name).value,
            "stream_prefix": state.streams.prefix,
            "last_id": sub.last_id,
            "cached_hashes": len(sub.index),
            "cpu_hashes": len(sub.index.tier(MEDIUM_CPU)),
            "batches_applied": sub.batches_applied,
            "entries_skipped": sub.skipped,
            "bootstraps": sub.bootstraps,
            "ledger": state.status is not None,
            "errors": state.errors,
            "last_error": state.last_error,
        }
    ok = any(r["health"] == ReplicaHealth.LIVE.value for r in report.values())
    pending = request.app[ROUTER].pending
    for name in report:
        report[name]["pending_requests"] = pending.on(name)
    return web.json_response(
        {"status": "ok" if ok else "unavailable", "replicas": report}, status=200 if ok else 503
    )


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error as OpenAI-style JSON, as the gateway answers: a client reads one shape."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.content_type == "application/json":
            raise
        return _error(exc.status, exc.text or exc.reason)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """The gateway's error shape (gateway/bodies.py): message, type, param, code (the status)."""
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _bad_request(message: str, param: str | None) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(
        text=json.dumps(error_body(400, message, param)), content_type="application/json"
    )


def _error(status: int, message: str) -> web.Response:
    return web.json_response(error_body(status, message), status=status)


async def _hint_at_replicas(config: IndexerConfig) -> None:
    """`--replicas default` under `kvledger up --replicas N` (named r0, r1, ...) shows nothing:
    say which replicas do publish events here, once, at start."""
    r = redis_streams.connect(str(config.redis_url))
    try:
        found = await known_replicas(r, config.stream_prefix)
    except (RedisError, OSError):
        return  # Redis not up yet: the followers wait for it and log that
    finally:
        await r.aclose()
    wanted = [name for name, _ in parse_replicas(config.replicas, config.stream_prefix)]
    if found and not set(wanted) & set(found):
        message = (
            f"kvledger indexer: --replicas {','.join(wanted)} names no replica publishing KV "
            f"events here; these do: {','.join(found)} (try --replicas {','.join(found)})"
        )
        log.warning("replicas_not_publishing", wanted=wanted, publishing=found)
        print(message, file=sys.stderr, flush=True)


async def serve(config: IndexerConfig) -> None:
    """Run the indexer until SIGINT/SIGTERM."""
    limits = limits_of(config)
    runner = web.AppRunner(create_app(config), access_log=None, **runner_options(limits))
    await runner.setup()
    refusals = RateLimitedLog(log)
    try:
        await CappedSite(
            runner, config.host, config.port, connection_cap(limits),
            on_refused=lambda n: refusals.log("warning", "connection_refused", open_connections=n),
        ).start()  # fmt: skip
        log.info("indexer_listening", host=config.host, port=config.port, replicas=config.replicas)
        await _hint_at_replicas(config)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
