"""Running one service process: logging, tracing, Redis, signals and a clean shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import redis.asyncio as aioredis
from opentelemetry.trace import Tracer

from observability import (
    TracingSettings,
    configure_logging,
    get_logger,
    get_tracer,
    setup_tracing,
    shutdown_tracing,
)
from services.config import CommonConfig
from services.environment import env, redis_password, secret_values
from services.startup import run_event_loop
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


def tracing_settings() -> TracingSettings:
    """OpenTelemetry's standard variables (declared in services.environment.ENV_VARS)."""
    return TracingSettings(
        endpoint=env("OTEL_EXPORTER_OTLP_ENDPOINT"),
        exporters=env("OTEL_TRACES_EXPORTER"),
        protocol=env("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf",
        service_name=env("OTEL_SERVICE_NAME"),
    )


def setup_observability(service: str, config: CommonConfig) -> Tracer | None:
    """Logging and tracing for one service process; the tracer is None when tracing is off,
    so services skip building spans altogether."""
    name = f"kvledger-{service}"
    password = redis_password(config.redis_url or "")  # also when it came from a file
    secrets = secret_values() + ((password,) if password else ())
    configure_logging(name, level=config.log_level, fmt=config.log_format, secrets=secrets)
    return get_tracer(name) if setup_tracing(name, tracing_settings()) else None


def run_service(
    service: str,
    config: CommonConfig,
    main: Callable[[aioredis.Redis, Tracer | None], Coroutine[Any, Any, None]],
) -> int:
    """Run `main(redis, tracer)` until it returns or SIGINT/SIGTERM; returns the exit code."""
    log = get_logger(f"kvledger.{service}")
    url = require_redis_url(config, service)
    tracer = setup_observability(service, config)

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
        return run_event_loop(runner())
    except Exception as exc:  # the last word a service says: one clear line, then the traceback
        log.exception("service_crashed", error=str(exc))
        return 1
    finally:
        shutdown_tracing()
