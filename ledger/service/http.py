"""What the ledger tells the others about itself: its own HTTP port (Prometheus /metrics and a
/health for supervisors) and the status message it keeps in Redis for the gateways and routers
(with a TTL: a missing key means no ledger)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from aiohttp import web

from observability import metrics_handler
from services.messages import LedgerStatus

if TYPE_CHECKING:
    from ledger.service.engine import LedgerService


def metrics_app(service: LedgerService) -> web.Application:
    """/metrics (Prometheus) and /health (200 once the pool is sized) on the ledger's own port."""
    app = web.Application()

    async def health(_: web.Request) -> web.Response:
        if service.leadership.standing_by:
            # Alive and ready to take over: a supervisor must not restart a standby.
            standby = {"status": "standby", "leader": service.leadership.leader_seen}
            return web.json_response(standby)
        if not service.ready.is_set():
            return web.json_response({"status": "waiting_for_workers"}, status=503)
        workers = {
            w: {"device": h.device, "attention_backend": h.attention_backend}
            for w, h in sorted(service.workers.items())
        }
        body: dict[str, object] = {"status": "ok", "epoch": service.epoch}
        body.update(capacity=service.capacity, leader_token=service.leadership.token)
        if not workers:  # not ready: every worker is lost, nothing can compute
            return web.json_response({**body, "status": "no_workers", "workers": {}}, status=503)
        return web.json_response({**body, "workers": workers})

    async def metrics(request: web.Request) -> web.StreamResponse:
        if service.metrics is None:
            return web.Response(status=503, text="the ledger has not sized its pool yet\n")
        return await metrics_handler(service.metrics.registry)(request)

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def status_message(service: LedgerService) -> LedgerStatus:
    scheduler = service.scheduler
    cfg = service.cfg
    return LedgerStatus(
        epoch=service.epoch,
        started_at=service.started_at,
        updated_at=time.time(),
        model_name=service.model_name,
        max_model_len=cfg.max_model_len,
        vocab_size=service.vocab_size,
        block_size=cfg.block_size,
        num_gpu_blocks=service.num_gpu_blocks,
        capacity_line=service.capacity,
        hash_algo=cfg.hash_algo,
        num_workers=len(service.workers),
        num_running=scheduler.num_running if scheduler else 0,
        num_waiting=scheduler.num_waiting if scheduler else 0,
        metrics=service.metrics.snapshot().to_dict() if service.metrics else None,
        attention_backends=service.attention_backends(),
        scheduling_policy=cfg.policy,
        async_scheduling=cfg.async_scheduling,
        enable_prefix_caching=cfg.enable_prefix_caching,
    )
