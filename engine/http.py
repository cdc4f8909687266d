"""The ledger's own HTTP port: Prometheus /metrics and a /health for supervisors, answered from
whatever reports them (a `LedgerProcess`: `health()` and `metrics_registry()`)."""

from __future__ import annotations

from typing import Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry

from observability import metrics_handler


class Reports(Protocol):
    def health(self) -> tuple[int, dict[str, object]]: ...

    def metrics_registry(self) -> CollectorRegistry | None: ...


def metrics_app(ledger: Reports) -> web.Application:
    """/metrics (Prometheus) and /health (200 once the pool is sized) on the ledger's own port."""
    app = web.Application()

    async def health(_: web.Request) -> web.Response:
        status, body = ledger.health()
        return web.json_response(body, status=status)

    async def metrics(request: web.Request) -> web.StreamResponse:
        registry = ledger.metrics_registry()
        if registry is None:
            return web.Response(status=503, text="the ledger has not sized its pool yet\n")
        return await metrics_handler(registry)(request)

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
