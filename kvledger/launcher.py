"""`kvledger up`: the whole system on this machine, with embedded defaults.

Starts a private redis-server on a free loopback port (unless --redis-url is given), then the
ledger, one worker and the gateway as child processes (with --replicas N: a ledger and a worker
per replica r0..rN-1, and one gateway routing across them; with --gateways N: N gateways on
consecutive ports from --port, each with its own --max-queue, routing as one through Redis);
waits until the ledger has sized its pool,
prints the capacity line, the URL and a curl example. From then on `kvledger.supervisor` restarts
any child that exits (capped exponential backoff, one line each time) until Ctrl-C or SIGTERM,
which stop everything it started. Each ledger's /metrics and /health listen on 127.0.0.1 unless
--metrics-host says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import TypeVar, cast

from redis.exceptions import RedisError

from kvledger.runtime import warn_password_on_command_line
from kvledger.supervisor import Child, Supervisor
from services.config import (
    GatewayConfig,
    KVEventsConfig,
    LedgerConfig,
    WorkerConfig,
    add_arguments,
    flag_fields,
    flag_of,
    from_arguments,
    offloading_config,
    parse_kv_events_config,
    parse_kv_transfer_config,
    parse_offloading_size,
    parse_shared_tier,
)
from services.environment import ConfigError, env, read_redis_url_file, redact_url
from services.lifeline import Lifeline
from services.tokenization.model_source import DEFAULT_MODEL, ModelSourceError, resolve_model
from services.transport import redis_client, redis_streams
from services.transport.keys import StreamNames
from services.transport.redis_server import (
    RedisServer,
    RedisServerError,
    free_port,
    remove_stale,
)
from services.wire import codec
from services.wire.messages import LedgerStatus

CPU_KV_CACHE_DEFAULT = "256MiB"


# The roles `up` starts, whose flags it takes from their one declaration (services.config).
ROLE_CONFIGS: dict[str, type] = {
    "ledger": LedgerConfig,
    "worker": WorkerConfig,
    "gateway": GatewayConfig,
}
# What `up` sets itself for each child (or declares with a meaning of its own).
UP_OWNS = frozenset(
    {"redis_url", "replica", "replicas", "metrics_port", "tp_rank", "tp_size", "worker_id",
     "gateway_id", "group", "num_workers", "stream_prefix", "workers_on_host"}
)  # fmt: skip
# Flags `up` takes as declared but hands each replica's ledger its own way: vLLM offsets the KV
# events' ZMQ ports by data-parallel rank, `up` by replica index (through the environment).
PER_REPLICA = frozenset({"kv_events_config"})


T = TypeVar("T")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up",
        help="start Redis, the ledger, a worker and the gateway on this machine",
        description="Start Redis, the ledger, a worker and the gateway on this machine. Every "
        "flag of `kvledger ledger`, `worker` and `gateway` is taken and passed to the roles that "
        f"declare it; on the CPU the KV cache defaults to {CPU_KV_CACHE_DEFAULT} per worker.",
    )
    p.add_argument(
        "--redis-url",
        help="use this Redis instead of starting a private redis-server (a password here shows "
        "in `ps`: prefer env KVLEDGER_REDIS_URL or --redis-url-file)",
    )
    p.add_argument(
        "--redis-url-file",
        default=None,
        help="a file holding the Redis URL (env KVLEDGER_REDIS_URL_FILE)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="replicas to start, each a ledger and a worker with its own KV cache, named "
        "r0..rN-1; the gateway routes across them (default: 1, named default)",
    )
    p.add_argument(
        "--gateways",
        type=int,
        default=1,
        help="gateways to start, on consecutive ports from --port, each with its own "
        "--max-queue; with several replicas they route as one (what each sends where is "
        "shared through Redis)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="workers per replica that shard the model and its KV cache (torch.distributed: "
        "gloo on the CPU, NCCL on CUDA); a killed rank is restarted and the group re-forms",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="ledger Prometheus port (0: a free one; replica i of several uses this + i)",
    )
    p.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds to wait for the ledger"
    )
    declared: set[str] = set(UP_OWNS)
    for cls in ROLE_CONFIGS.values():
        added = add_arguments(p, cls, skip=declared)
        declared |= {flag_of(f) for f in added} | {f.name for f in added}
    p.set_defaults(func=cmd_up)


def role_flags(
    args: argparse.Namespace, role: str, skip: frozenset[str] = frozenset()
) -> list[str]:
    """The flags given to `up` that `role` declares, as that role's command line (less the
    fields in `skip`, which `up` sets per child)."""
    argv = []
    for f in flag_fields(ROLE_CONFIGS[role]):
        if f.name in UP_OWNS or f.name in PER_REPLICA or f.name in skip:
            continue
        value = getattr(args, _dest_of(args, flag_of(f)), None)
        for one in value if isinstance(value, list) else [] if value is None else [value]:
            argv += [flag_of(f), str(one)]  # a repeatable flag, once per value
    return argv


def _dest_of(args: argparse.Namespace, flag: str) -> str:
    """The attribute `up`'s parser stores `flag` under: the field of the first role that
    declares it (the gateway's --served-model-name is the worker's)."""
    for cls in ROLE_CONFIGS.values():
        for f in flag_fields(cls):
            if flag_of(f) == flag and hasattr(args, f.name):
                return f.name
    return flag.lstrip("-").replace("-", "_")


def _child_env(args: argparse.Namespace, redis_url: str, metrics_port: int) -> dict[str, str]:
    """The environment every child shares: this one, with the Redis URL `up` resolved and the
    CPU's default KV cache size when neither a flag nor a variable sets one."""
    env_ = dict(os.environ)
    env_["KVLEDGER_REDIS_URL"] = redis_url
    env_["KVLEDGER_METRICS_PORT"] = str(metrics_port)
    env_.pop("KVLEDGER_REDIS_URL_FILE", None)  # resolved here: the children get the URL itself
    # Each CPU worker takes its share of the cores it may use (gpu_worker/threads.py).
    env_["KVLEDGER_WORKERS_ON_HOST"] = str(args.replicas * args.tensor_parallel_size)
    # ...less a core for Redis, the ledger and the gateway, which run beside them here: a torch
    # thread they preempt holds up every other at the next barrier (gpu_worker/threads.py).
    env_.setdefault("KVLEDGER_CPU_RESERVED_CORES", "1")
    device = args.device or env_.get("KVLEDGER_DEVICE", "auto")
    if (
        args.kv_cache_memory_bytes is None
        and not env_.get("KVLEDGER_KV_CACHE_MEMORY_BYTES")
        and not _cuda_wanted(device)
    ):
        env_["KVLEDGER_KV_CACHE_MEMORY_BYTES"] = CPU_KV_CACHE_DEFAULT
    return env_


def _cuda_wanted(device: str) -> bool:
    from gpu_worker.devices import resolve_device

    return resolve_device(device).type == "cuda"


def redis_url_of(args: argparse.Namespace) -> str | None:
    """--redis-url, else KVLEDGER_REDIS_URL, else the file of --redis-url-file /
    KVLEDGER_REDIS_URL_FILE; None: start a private redis-server."""
    warn_password_on_command_line("up", args.redis_url)
    url = args.redis_url or env("KVLEDGER_REDIS_URL")
    path = args.redis_url_file or env("KVLEDGER_REDIS_URL_FILE")
    if not url and path:
        url = read_redis_url_file(path)
    return url


def kv_events_config_of(args: argparse.Namespace) -> KVEventsConfig | None:
    """--kv-events-config, else KVLEDGER_KV_EVENTS_CONFIG, parsed once here (a bad key stops
    `up` before anything starts)."""
    text = args.kv_events_config or env("KVLEDGER_KV_EVENTS_CONFIG")
    if not text:
        return None
    try:
        return parse_kv_events_config(text)
    except ValueError as exc:
        source = "--kv-events-config" if args.kv_events_config else "KVLEDGER_KV_EVENTS_CONFIG"
        raise ConfigError(f"{source}: {exc}") from None


def check_offloading(args: argparse.Namespace) -> None:
    """--kv-offloading-size and --kv-transfer-config (or their variables) checked once here, as
    the ledger will read them: a bad field stops `up` before anything starts."""

    def parsed(name: str, variable: str, parse: Callable[[str], T]) -> T | None:
        text = getattr(args, name, None) or env(variable)
        try:
            return parse(text) if text else None
        except ValueError as exc:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag if getattr(args, name, None) else variable}: {exc}") from None

    size = parsed("kv_offloading_size", "KVLEDGER_KV_OFFLOADING_SIZE", parse_offloading_size)
    transfer = parsed("kv_transfer_config", "KVLEDGER_KV_TRANSFER_CONFIG", parse_kv_transfer_config)
    block_size = int(args.block_size or env("KVLEDGER_BLOCK_SIZE") or 16)
    tier = offloading_config(size, transfer, block_size)
    shared = parsed("kv_shared_tier", "KVLEDGER_KV_SHARED_TIER", parse_shared_tier)
    if shared is not None and tier is None:
        raise ConfigError(
            "--kv-shared-tier: the shared tier sits behind the CPU tier (blocks go GPU -> CPU "
            "-> shared and back): give --kv-offloading-size GiB too"
        )


def cmd_up(args: argparse.Namespace) -> int:
    server = None
    # Checked before anything starts: one line here, not a traceback from a child.
    try:
        resolve_model(args.model or env("KVLEDGER_MODEL") or DEFAULT_MODEL)
    except ModelSourceError as exc:
        print(f"kvledger up: {exc}", file=sys.stderr)
        return 2
    try:
        redis_url = redis_url_of(args)
        kv_events = kv_events_config_of(args)
        check_offloading(args)
        from_arguments(WorkerConfig, args)  # the worker's flags (--cpu-threads, ...), parsed once
    except ConfigError as exc:
        print(f"kvledger up: {exc}", file=sys.stderr)
        return 2
    if not redis_url:
        for folder in remove_stale():
            print(
                f"kvledger up: removed {folder}, left by a kvledger up that was killed", flush=True
            )
        try:
            server = RedisServer(owned=True).start()
        except RedisServerError as exc:
            print(f"kvledger up: {exc}", file=sys.stderr)
            return 2
        redis_url = server.url
        print(f"kvledger up: private redis-server at {redis_url}", flush=True)
    if args.replicas < 1:
        print(f"kvledger up: --replicas must be at least 1, got {args.replicas}", file=sys.stderr)
        return 2
    if args.gateways < 1:
        print(f"kvledger up: --gateways must be at least 1, got {args.gateways}", file=sys.stderr)
        return 2
    if args.tensor_parallel_size < 1:
        print(
            f"kvledger up: --tensor-parallel-size must be at least 1, got "
            f"{args.tensor_parallel_size}",
            file=sys.stderr,
        )
        return 2
    replicas = replica_names(args.replicas)
    ports = [
        (args.metrics_port + i) if args.metrics_port else free_port() for i in range(len(replicas))
    ]
    metrics_port = ports[0]
    env_ = _child_env(args, redis_url, metrics_port)
    prefix = env_.get("KVLEDGER_STREAM_PREFIX", "kvl")
    routing = args.routing or env_.get("KVLEDGER_ROUTING", "precise")
    lifeline = Lifeline()  # every child dies with this process, even one killed with SIGKILL
    port = int(args.port or env_.get("KVLEDGER_PORT", 8000))
    # Each gateway's port comes in its environment: the flag would give them all the same.
    skip = frozenset({"port"}) if args.gateways > 1 else frozenset()
    supervisor = Supervisor(
        [
            Child(
                name,
                [sys.executable, "-m", "kvledger.cli", role, *role_flags(args, role, skip)],
                child_env,
            )
            for name, child_env in _roles(
                env_, replicas, ports, args.tensor_parallel_size, kv_events, args.gateways, port
            )
            for role in [name.split("-")[0]]
        ],
        lifeline=lifeline,
    )
    supervisor.install_signal_handlers()
    try:
        supervisor.start()
        status = None
        for name in replicas:
            status = _wait_for_ledger(
                redis_url, StreamNames(prefix, name), supervisor, args.startup_timeout
            )
            if status is None:
                return 0 if supervisor.stopping else 1
        assert status is not None
        host = args.host or env_.get("KVLEDGER_HOST", "127.0.0.1")
        _banner(
            status,
            host,
            port,
            metrics_port,
            args.metrics_host or env_.get("KVLEDGER_METRICS_HOST", "127.0.0.1"),
        )
        if args.gateways > 1:
            urls = ", ".join(f"http://{host}:{port + i}" for i in range(args.gateways))
            print(f"kvledger up: {args.gateways} gateways ({urls}), routing as one", flush=True)
        if len(replicas) > 1:
            print(
                f"kvledger up: {len(replicas)} replicas ({', '.join(replicas)}; ledger metrics "
                f"on ports {', '.join(map(str, ports))}), routing "
                f"{routing}",
                flush=True,
            )
        # From here on a child that exits is restarted (with backoff) until Ctrl-C / SIGTERM.
        supervisor.run()
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        supervisor.stop()
        lifeline.close()
        if server is not None:
            server.stop()


def replica_names(count: int) -> list[str]:
    """One replica keeps the name every service defaults to; several are r0..rN-1."""
    return ["default"] if count == 1 else [f"r{i}" for i in range(count)]


def _roles(
    env: dict[str, str],
    replicas: list[str],
    ports: list[int],
    tp_size: int = 1,
    kv_events: KVEventsConfig | None = None,
    gateways: int = 1,
    port: int = 8000,
) -> list[tuple[str, dict[str, str]]]:
    """(child name, its environment): a ledger and a worker per replica (a worker per rank
    under tensor parallelism), then the gateways (gateway, gateway-1, ... on port, port + 1,
    ...). Replica i's ledger publishes its KV events over ZMQ on the configured ports + i."""
    roles = []
    several = len(replicas) > 1
    for index, (name, metrics_port) in enumerate(zip(replicas, ports, strict=True)):
        replica_env = {**env, "KVLEDGER_REPLICA": name, "KVLEDGER_METRICS_PORT": str(metrics_port)}
        suffix = f"-{name}" if several else ""
        ledger_env = dict(replica_env)
        if kv_events is not None:
            ledger_env["KVLEDGER_KV_EVENTS_CONFIG"] = kv_events.offset(index).to_json()
        roles.append((f"ledger{suffix}", ledger_env))
        if tp_size == 1:
            roles.append((f"worker{suffix}", replica_env))
            continue
        for rank in range(tp_size):
            rank_env = {
                **replica_env,
                "KVLEDGER_TP_RANK": str(rank),
                "KVLEDGER_TP_SIZE": str(tp_size),
            }
            roles.append((f"worker{suffix}-tp{rank}", rank_env))
    gateway_env = {**env, "KVLEDGER_REPLICA": replicas[0], "KVLEDGER_REPLICAS": ",".join(replicas)}
    if gateways == 1:
        return [*roles, ("gateway", gateway_env)]
    for index in range(gateways):
        name = "gateway" if index == 0 else f"gateway-{index}"
        roles.append((name, {**gateway_env, "KVLEDGER_PORT": str(port + index)}))
    return roles


REDIS_WAIT_MIN_S = 0.05  # as the services' Reconnect: doubling to 2 s
REDIS_WAIT_MAX_S = 2.0


def _wait_for_ledger(
    url: str, streams: StreamNames, supervisor: Supervisor, timeout: float
) -> LedgerStatus | None:
    """The ledger's first status; None when a child exits first (at start-up that is a
    setting to fix, not a crash to retry), on a stop request, or after `timeout`.

    An external Redis may come up after the stack (the services wait for it with backoff too):
    until it answers, the wait is logged once and `timeout` does not run, since the ledger
    cannot start before it."""
    client = redis_client.connect_sync(url)
    deadline = time.monotonic() + timeout
    delay_s, down_since = REDIS_WAIT_MIN_S, None
    try:
        while (down_since is not None or time.monotonic() < deadline) and not supervisor.stopping:
            for child in supervisor.exited():
                code = child.process.returncode if child.process is not None else None
                print(
                    f"kvledger up: the {child.role} exited at start-up with code {code}",
                    file=sys.stderr,
                )
                return None
            try:
                data = cast("bytes | None", client.get(streams.ledger_status))
            except (RedisError, OSError) as exc:
                if not redis_streams.is_unavailable(exc):
                    raise
                if down_since is None:
                    down_since = time.monotonic()
                    print(
                        f"kvledger up: waiting for Redis at {redact_url(url)} ({exc})",
                        file=sys.stderr,
                        flush=True,
                    )
                time.sleep(delay_s)
                delay_s = min(delay_s * 2, REDIS_WAIT_MAX_S)
                continue
            if down_since is not None:
                print(
                    f"kvledger up: Redis answered after {time.monotonic() - down_since:.1f}s",
                    flush=True,
                )
                deadline = time.monotonic() + timeout
                delay_s, down_since = REDIS_WAIT_MIN_S, None
            if data:
                return codec.decode(data, LedgerStatus)
            time.sleep(0.2)
    finally:
        client.close()
    if supervisor.stopping:
        return None
    print(
        f"kvledger up: the ledger of replica {streams.replica} did not come up within "
        f"{timeout:.0f}s",
        file=sys.stderr,
    )
    return None


def _banner(
    status: LedgerStatus, host: str, port: int, metrics_port: int, metrics_host: str
) -> None:
    url = f"http://{host}:{port}"
    auth = (
        ' -H "Authorization: Bearer $KVLEDGER_API_KEY"'
        if os.environ.get("KVLEDGER_API_KEY")
        else ""
    )
    print(
        f"\n{status.capacity_line}\n"
        f"kvledger is serving {status.model_name} at {url}  (metrics: http://{_reachable(metrics_host)}:{metrics_port}/metrics)\n"
        f"Try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"    -d '{_example_body(status.model_name)}'\n"
        "Press Ctrl-C to stop.\n",
        flush=True,
    )


EXAMPLE_QUESTION = "What is the capital of France?"


def _example_body(model_name: str) -> str:
    """The banner's request: a question a person would ask, greedy so its answer is stable."""
    return json.dumps(
        {
            "model": model_name,
            "messages": [{"role": "user", "content": EXAMPLE_QUESTION}],
            "max_tokens": 32,
            "temperature": 0,
        }
    )


def _reachable(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
