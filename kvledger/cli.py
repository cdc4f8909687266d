"""The `kvledger` command line: run the services, and the tools around the ledger.

kvledger up          everything on this machine (private Redis, ledger, worker, gateway)
kvledger ledger|worker|gateway   one service (Docker, or your own process manager)
kvledger indexer     the replicas' KV events as a score service for external routers
kvledger bridge      a vLLM server's ZMQ KV events onto a replica's Redis stream and snapshot
kvledger hash        block hashes of a token list, as the ledger and its KV events see them
kvledger capacity    the KV cache capacity line (or the refusal) for a model and a budget
kvledger simulate    the real ledger on the paged-allocator blog's workload
kvledger events      tail the KV-events stream in a readable form
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from services.config import (
    BridgeConfig,
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
        ("bridge", BridgeConfig, "follow a vLLM server's ZMQ KV events (PUB + replay) and write "
         "them to a replica's Redis stream and snapshot, as a kvledger ledger would"),
    ):  # fmt: skip
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
    name: str,
    cls: type[LedgerConfig | WorkerConfig | GatewayConfig | IndexerConfig | BridgeConfig],
) -> Callable[[argparse.Namespace], int]:
    """`kvledger ROLE`: the role's config from flags and environment, then its `serve`."""

    def run(args: argparse.Namespace) -> int:
        from kvledger.runtime import run_role
        from services.environment import ConfigError

        try:
            config = from_arguments(cls, args)
            _resolve_redis_url(name, config, getattr(args, "redis_url", None))
        except ConfigError as exc:
            print(f"kvledger {name}: {exc}", file=sys.stderr)
            return 2
        return run_role(name, config, _role_serve(name))

    return run


def _role_serve(name: str) -> Callable[[Any], Coroutine[Any, Any, None]]:
    """Each role's `serve(config)`, imported only for the role that runs (the gateway and the
    indexer never load torch)."""
    if name == "ledger":
        from engine import serve as serve_ledger

        return serve_ledger
    if name == "worker":
        from gpu_worker import serve as serve_worker

        return serve_worker
    if name == "gateway":
        from gateway import serve as serve_gateway

        return serve_gateway
    if name == "bridge":
        from kvledger.bridge import serve as serve_bridge

        return serve_bridge
    from indexer import serve as serve_indexer

    return serve_indexer


def _resolve_redis_url(command: str, config: object, flag_value: str | None) -> None:
    """No --redis-url nor KVLEDGER_REDIS_URL: KVLEDGER_REDIS_URL_FILE, if set."""
    from kvledger.runtime import warn_password_on_command_line
    from services.config import CommonConfig
    from services.environment import env, read_redis_url_file

    assert isinstance(config, CommonConfig)
    warn_password_on_command_line(command, flag_value)
    path = env("KVLEDGER_REDIS_URL_FILE")
    if not config.redis_url and path:
        config.redis_url = read_redis_url_file(path)


if __name__ == "__main__":
    sys.exit(main())
