"""Running one service process: logging, tracing, Redis, signals and a clean shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

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
from services.environment import ConfigError, env, redact_url, redis_password, secret_values
from services.lifeline import watch_parent
from services.startup import StartupError, run_event_loop


def require_redis_url(config: CommonConfig, service: str) -> str:
    if not config.redis_url:
        print(
            f"kvledger {service}: no Redis to talk to. Set KVLEDGER_REDIS_URL or --redis-url "
            "(or run `kvledger up`, which starts a private redis-server).",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return config.redis_url


def tracing_settings(config: CommonConfig | None = None) -> TracingSettings:
    """vLLM's flags (--otlp-traces-endpoint, --collect-detailed-traces) and OpenTelemetry's
    standard variables (declared in services.environment.ENV_VARS)."""
    return TracingSettings(
        endpoint=env("OTEL_EXPORTER_OTLP_ENDPOINT"),
        exporters=env("OTEL_TRACES_EXPORTER"),
        protocol=env("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf",
        service_name=env("OTEL_SERVICE_NAME"),
        traces_endpoint=config.otlp_traces_endpoint if config is not None else None,
        sampler=env("OTEL_TRACES_SAMPLER"),
        sampler_arg=env("OTEL_TRACES_SAMPLER_ARG"),
        detailed=config.collect_detailed_traces if config is not None else (),
    )


def setup_observability(service: str, config: CommonConfig) -> Tracer | None:
    """Logging and tracing for one service process; the tracer is None when tracing is off,
    so services skip building spans altogether. A tracing setting that does not work raises
    ConfigError naming it."""
    name = f"kvledger-{service}"
    password = redis_password(config.redis_url or "")  # also when it came from a file
    secrets = secret_values() + ((password,) if password else ())
    configure_logging(name, level=config.log_level, fmt=config.log_format, secrets=secrets)
    settings = tracing_settings(config)
    try:
        provider = setup_tracing(name, settings)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(str(exc)) from None
    if provider is None and settings.detailed:
        raise ConfigError(
            "--collect-detailed-traces needs tracing on: set --otlp-traces-endpoint "
            "(or OTEL_EXPORTER_OTLP_ENDPOINT)"
        )
    return get_tracer(name) if provider is not None else None


def run_role(
    role: str, config: CommonConfig, serve: Callable[[Any], Coroutine[Any, Any, None]]
) -> int:
    """Run a role's `serve(config)` until it returns or SIGINT/SIGTERM cancels it, with logging
    and tracing set up first; returns the exit code. A `StartupError` (or a setting that does
    not parse) is one line on stderr and its exit code; anything else is logged and exits 1."""
    log = get_logger(f"kvledger.{role}")
    require_redis_url(config, role)
    try:
        setup_observability(role, config)
    except ConfigError as exc:
        print(f"kvledger {role}: {exc}", file=sys.stderr)
        return 2
    # Started by `kvledger up`: stop when it is gone, even killed with SIGKILL.
    watch_parent(lambda why: log.warning("launcher_gone", reason=why))

    async def runner() -> int:
        task = asyncio.create_task(serve(config))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            # A role may install its own (the gateway drains on SIGTERM): it replaces this one.
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            log.info("service_stopped")
        return 0

    try:
        return run_event_loop(runner())
    except StartupError as exc:
        print(f"kvledger {role}: {exc}", file=sys.stderr)
        return exc.exit_code
    except ConfigError as exc:
        print(f"kvledger {role}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # the last word a service says: one clear line, then the traceback
        log.exception("service_crashed", error=str(exc))
        return 1
    finally:
        shutdown_tracing()


def warn_password_on_command_line(command: str, flag_value: str | None) -> None:
    """A password in --redis-url shows in `ps` to every user of the machine: say so once."""
    if flag_value and redis_password(flag_value):
        print(
            f"kvledger {command}: warning: --redis-url {redact_url(flag_value)} carries a "
            "password on the command line, where `ps` shows it; use KVLEDGER_REDIS_URL or "
            "KVLEDGER_REDIS_URL_FILE instead",
            file=sys.stderr,
            flush=True,
        )
