"""One ledger process: it waits for the replica's lease (a hot standby until then), then for its
workers, sizes the pool from what they report and runs the `Engine` built from it. It answers
/health and /metrics throughout (`engine.http`), before the engine exists too.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
from aiohttp import web
from prometheus_client import CollectorRegistry

from engine.engine import Engine
from engine.http import metrics_app
from engine.leadership import Leadership
from engine.workers import group_view, plan_pool
from observability import get_logger, tracer_if_on
from observability.ratelimit import RateLimitedLog
from services.config import LedgerConfig
from services.http_server import CappedSite, connection_cap, limits_of, runner_options
from services.transport import redis_streams, registry
from services.wire.messages import WorkerHello

log = get_logger("kvledger.ledger")


async def serve(config: LedgerConfig) -> None:
    """Run one ledger until cancelled: the lease, the engine, and /metrics and /health on
    --metrics-port. Logging and tracing are the caller's to set up (`kvledger ledger` does)."""
    assert config.redis_url, "the caller checks that there is a Redis to talk to"
    r = redis_streams.connect(config.redis_url)
    ledger = LedgerProcess(config, r, tracer_if_on("kvledger-ledger"))
    runner = None
    try:
        if config.metrics_port:
            limits = limits_of(config)
            runner = web.AppRunner(metrics_app(ledger), access_log=None, **runner_options(limits))
            await runner.setup()
            refusals = RateLimitedLog(log)
            await CappedSite(
                runner, config.metrics_host, config.metrics_port, connection_cap(limits),
                on_refused=lambda n: refusals.log("warning", "connection_refused", open_connections=n),
            ).start()  # fmt: skip
        await ledger.run()
    finally:
        if runner is not None:
            await runner.cleanup()
        await r.aclose()


class LedgerProcess:
    def __init__(self, config: LedgerConfig, r: aioredis.Redis, tracer=None) -> None:
        self.cfg = config
        self.r = r
        self.tracer = tracer
        self.leadership = Leadership(r, config.streams, config.leader_ttl_s)
        self.stopping = asyncio.Event()
        self.ready = asyncio.Event()  # set once the engine serves
        self.engine: Engine | None = None
        self.crashed: BaseException | None = None  # the lease, lost before the engine ran

    async def run(self) -> None:
        await self.leadership.acquire(self.stopping)
        lease = asyncio.create_task(self.leadership.renew_forever(), name="lease")
        lease.add_done_callback(self._lease_done)
        try:
            startup = redis_streams.Reconnect("startup", lambda loop: None)
            workers = await startup.call(self._wait_for_workers)
            plan = plan_pool(
                list(workers.values()),
                self.cfg.block_size,
                self.cfg.max_model_len,
                self.cfg.num_gpu_blocks_override,
            )
            self.engine = Engine(
                self.cfg, self.r, self.leadership, plan, workers, self.stopping, self.tracer
            )
            await self.engine.run(self.ready)
        finally:
            lease.cancel()
            await asyncio.gather(lease, return_exceptions=True)
            await self.leadership.release()

    def _lease_done(self, task: asyncio.Task) -> None:
        # A lease that cannot be renewed must stop the engine loudly (the engine re-raises).
        if self.engine is not None:
            self.engine.background_done(task)
        elif not task.cancelled() and task.exception() is not None:
            log.error("background_task_crashed", task=task.get_name(), error=repr(task.exception()))
            self.crashed = task.exception()
            self.stopping.set()

    async def _wait_for_workers(self) -> dict[str, WorkerHello]:
        announced = 0.0
        while not self.stopping.is_set():
            workers = group_view(
                await registry.live_workers(self.r, self.cfg.streams, self.cfg.group)
            )
            if len(workers) >= self.cfg.num_workers:
                return workers
            if time.monotonic() - announced > 10:
                log.info(
                    "waiting_for_workers",
                    group=self.cfg.group,
                    have=len(workers),
                    want=self.cfg.num_workers,
                )
                announced = time.monotonic()
            await asyncio.sleep(0.2)
        raise self.crashed or asyncio.CancelledError()

    # ------------------------------------------------------------------ what /health tells

    def health(self) -> tuple[int, dict[str, object]]:
        """The HTTP status and body of /health: 200 once the pool is sized and a worker lives;
        a standby answers 200 too (alive and ready to take over: not to be restarted)."""
        if self.leadership.standing_by:
            return 200, {"status": "standby", "leader": self.leadership.leader_seen}
        engine = self.engine
        if engine is None or not self.ready.is_set():
            return 503, {"status": "waiting_for_workers"}
        workers = {
            w: {"device": h.device, "attention_backend": h.attention_backend}
            for w, h in sorted(engine.workers.items())
        }
        body: dict[str, object] = {"status": "ok", "epoch": engine.epoch}
        body.update(capacity=engine.capacity, leader_token=self.leadership.token)
        if not workers:  # not ready: every worker is lost, nothing can compute
            return 503, {**body, "status": "no_workers", "workers": {}}
        return 200, {**body, "workers": workers}

    def metrics_registry(self) -> CollectorRegistry | None:
        """The Prometheus registry, once the engine exists (its metrics are labelled by model)."""
        return None if self.engine is None else self.engine.metrics.registry
