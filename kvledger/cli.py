"""The `kvledger` command line: run the services, and the tools around the ledger.

kvledger up          everything on this machine (private Redis, ledger, worker, gateway)
kvledger ledger|worker|gateway   one service (Docker, or your own process manager)
kvledger indexer     the replicas' KV events as a score service for external routers
kvledger hash        block hashes of a token list, as the ledger and its KV events see them
kvledger capacity    the KV cache capacity line (or the refusal) for a model and a budget
kvledger simulate    the real ledger on the paged-allocator blog's workload
kvledger events      tail the KV-events stream in a readable form
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from services.config import (
    GatewayConfig,
    IndexerConfig,
    LedgerConfig,
    WorkerConfig,
    add_arguments,
    from_arguments,
)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvledger", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from kvledger import launcher, tools

    launcher.add_parser(sub)
    for name, cls, helptext in (
        ("ledger", LedgerConfig, "run the ledger service (scheduler, block pool, KV events)"),
        ("worker", WorkerConfig, "run a worker (model, KV cache tensors, paged attention)"),
        ("gateway", GatewayConfig, "run the OpenAI-compatible HTTP gateway"),
        ("indexer", IndexerConfig, "serve each replica's cached prefix of a prompt (POST /score)"),
    ):
        p = sub.add_parser(name, help=helptext, description=helptext)
        add_arguments(p, cls)
        p.set_defaults(func=_service_main(name, cls))
    tools.add_parsers(sub)
    for command in sub.choices.values():
        show_defaults(command)
    return parser


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option's help ends with its default (or says it is required), so `--help` of
    every command tells what happens when a flag is left out."""
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or action.dest == "help":
            continue
        text = action.help or ""
        if "(default" in text or not action.option_strings:
            continue
        if action.required:
            text += " (required)"
        elif isinstance(action, argparse._StoreTrueAction):
            text += " (default: off)"
        else:
            text += f" (default: {'none' if action.default is None else action.default})"
        action.help = text.strip()


def _service_main(
    name: str, cls: type[LedgerConfig | WorkerConfig | GatewayConfig | IndexerConfig]
) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from services.environment import ConfigError

        try:
            config = from_arguments(cls, args)
            _resolve_redis_url(name, config, getattr(args, "redis_url", None))
        except ConfigError as exc:
            print(f"kvledger {name}: {exc}", file=sys.stderr)
            return 2
        if isinstance(config, LedgerConfig):
            return run_ledger(config)
        if isinstance(config, WorkerConfig):
            return run_worker(config)
        if isinstance(config, IndexerConfig):
            return run_indexer(config)
        return run_gateway(config)

    return run


def warn_password_on_command_line(command: str, flag_value: str | None) -> None:
    """A password in --redis-url shows in `ps` to every user of the machine: say so once."""
    from services.environment import redact_url, redis_password

    if flag_value and redis_password(flag_value):
        print(
            f"kvledger {command}: warning: --redis-url {redact_url(flag_value)} carries a "
            "password on the command line, where `ps` shows it; use KVLEDGER_REDIS_URL or "
            "KVLEDGER_REDIS_URL_FILE instead",
            file=sys.stderr,
            flush=True,
        )


def _resolve_redis_url(command: str, config: object, flag_value: str | None) -> None:
    """No --redis-url nor KVLEDGER_REDIS_URL: KVLEDGER_REDIS_URL_FILE, if set."""
    from services.config import CommonConfig
    from services.environment import env, read_redis_url_file

    assert isinstance(config, CommonConfig)
    warn_password_on_command_line(command, flag_value)
    path = env("KVLEDGER_REDIS_URL_FILE")
    if not config.redis_url and path:
        config.redis_url = read_redis_url_file(path)


def run_ledger(config: LedgerConfig) -> int:
    from aiohttp import web

    from kvledger.runtime import run_service
    from ledger.service.engine import LedgerService
    from ledger.service.http import metrics_app
    from ledger.service.workers import StartupError
    from observability import get_logger
    from observability.ratelimit import RateLimitedLog
    from services.http_server import CappedSite, connection_cap, limits_of, runner_options

    async def main(r, tracer) -> None:
        service = LedgerService(config, r, tracer)
        runner = None
        if config.metrics_port:
            limits = limits_of(config)
            runner = web.AppRunner(metrics_app(service), access_log=None, **runner_options(limits))
            await runner.setup()
            refusals = RateLimitedLog(get_logger("ledger"))
            await CappedSite(
                runner, config.metrics_host, config.metrics_port, connection_cap(limits),
                on_refused=lambda n: refusals.log("warning", "connection_refused", open_connections=n),
            ).start()  # fmt: skip
        try:
            await service.run()
        except StartupError as exc:
            print(f"kvledger ledger: {exc}", file=sys.stderr)
            raise SystemExit(3) from None
        finally:
            if runner is not None:
                await runner.cleanup()

    return run_service("ledger", config, main)


def run_worker(config: WorkerConfig) -> int:
    # Before torch loads OpenMP (gpu_worker/threads.py: spinning threads on a shared CPU).
    from gpu_worker.threads import prefer_passive_openmp_wait

    prefer_passive_openmp_wait()
    from gpu_worker.parallel import TensorParallel, TensorParallelError
    from gpu_worker.profile import ProfileSettings
    from gpu_worker.runner import ModelRunner, RunnerConfig
    from gpu_worker.service import WorkerService
    from gpu_worker.threads import configure_cpu_threads
    from kernels import BackendError
    from kvledger.runtime import run_service

    async def main(r, tracer) -> None:
        import asyncio

        import torch

        device = torch.device(
            config.device
            if config.device != "auto"
            else "cuda"
            if torch.cuda.is_available()
            else "cpu"
        )
        configure_cpu_threads(device, config.cpu_threads, config.workers_on_host)
        try:
            tp = TensorParallel(config.tp_rank, config.tp_size)
        except TensorParallelError as exc:
            print(f"kvledger worker: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        if device.type == "cuda" and tp.size > 1:
            device = torch.device("cuda", tp.rank % torch.cuda.device_count())  # a GPU per rank
            if config.kv_cache_memory_bytes is None:
                # The profile run is a forward pass, a collective the group is not formed for yet.
                print(
                    "kvledger worker: --tp-size > 1 on CUDA needs --kv-cache-memory-bytes "
                    "(the profile run does not run across ranks yet)",
                    file=sys.stderr,
                )
                raise SystemExit(2)
        runner_config = RunnerConfig(
            tp=tp,
            model=config.model,
            dtype=config.dtype,
            device=str(device),
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            seed=config.seed,
            kernels=config.kernels,
            profile=ProfileSettings(
                block_size=config.block_size,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                gpu_memory_utilization=config.gpu_memory_utilization,
                kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                num_gpu_blocks_override=config.num_gpu_blocks_override,
            ),
        )
        try:
            runner = await asyncio.to_thread(ModelRunner.create, runner_config)
        # Missing checkpoint files, no memory for the cache, an attention backend that cannot
        # run this model here (BackendError): one line that says what to change, exit 3.
        except (ValueError, BackendError) as exc:
            print(f"kvledger worker: {exc}", file=sys.stderr)
            raise SystemExit(3) from None
        if config.served_model_name:
            runner.name = config.served_model_name
        await WorkerService(config, r, runner, tracer).run()

    return run_service("worker", config, main)


def run_gateway(config: GatewayConfig) -> int:
    from gateway.app import serve
    from kvledger.runtime import require_redis_url, setup_observability
    from observability import shutdown_tracing
    from services.startup import run_event_loop

    require_redis_url(config, "gateway")
    setup_observability("gateway", config)
    try:
        run_event_loop(serve(config))
    except KeyboardInterrupt:
        pass
    finally:
        shutdown_tracing()
    return 0


def run_indexer(config: IndexerConfig) -> int:
    from indexer import serve
    from kvledger.runtime import require_redis_url, setup_observability
    from observability import shutdown_tracing
    from services.environment import ConfigError
    from services.startup import run_event_loop

    require_redis_url(config, "indexer")
    setup_observability("indexer", config)
    try:
        run_event_loop(serve(config))
    except ConfigError as exc:
        print(f"kvledger indexer: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    finally:
        shutdown_tracing()
    return 0


if __name__ == "__main__":
    sys.exit(main())
