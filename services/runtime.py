"""Running one service process: logging, tracing, Redis, signals and a clean shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable

from observability import configure_logging, get_logger, get_tracer, setup_tracing, shutdown_tracing
from services.config import CommonConfig
from services.transport import connect


def require_redis_url(config: CommonConfig, service: str) -> str:
    if not config.redis_url:
        print(
            f"kvledger {service}: no Redis to talk to. Set KVLEDGER_REDIS_URL or --redis-url "
            "(or run `kvledger up`, which starts a private redis-server).",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return config.redis_url


def run_service(
    service: str, config: CommonConfig, main: Callable[[object, object], Awaitable[None]]
) -> int:
    """Run `main(redis, tracer)` until it returns or SIGINT/SIGTERM; returns the exit code."""
    configure_logging(f"kvledger-{service}", level=config.log_level, fmt=config.log_format)
    log = get_logger(f"kvledger.{service}")
    url = require_redis_url(config, service)
    # None when tracing is off, so services skip building spans altogether.
    tracer = get_tracer(f"kvledger-{service}") if setup_tracing(f"kvledger-{service}") else None

    async def runner() -> int:
        r = connect(url)
        task = asyncio.create_task(main(r, tracer))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, task.cancel)
        try:
            await task
            return 0
        except asyncio.CancelledError:
            log.info("service_stopped")
            return 0
        finally:
            await r.aclose()

    try:
        return asyncio.run(runner())
    except Exception as exc:  # the last word a service says: one clear line, then the traceback
        log.exception("service_crashed", error=str(exc))
        return 1
    finally:
        shutdown_tracing()
