"""`kvledger up`: the whole system on this machine, with embedded defaults.

Starts a private redis-server on a free loopback port (unless --redis-url is given), then the
ledger, one worker and the gateway as child processes (with --replicas N: a ledger and a worker
per replica r0..rN-1, and one gateway routing across them); waits until the ledger has sized its pool,
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
from typing import cast

from redis.exceptions import RedisError

from kvledger.cli import warn_password_on_command_line
from kvledger.supervisor import Child, Supervisor
from services import redis_client, transport, wire
from services.config import MODEL_HELP
from services.environment import ConfigError, env, read_redis_url_file, redact_url
from services.keys import StreamNames
from services.messages import LedgerStatus
from services.model_source import DEFAULT_MODEL, ModelSourceError, resolve_model
from services.redis_server import RedisServer, RedisServerError, free_port

CPU_KV_CACHE_DEFAULT = "256MiB"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up", help="start Redis, the ledger, a worker and the gateway on this machine"
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
        "--metrics-host",
        default="127.0.0.1",
        help="address of each ledger's /metrics and /health (0.0.0.0: every interface)",
    )
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    p.add_argument("--port", type=int, default=8000, help="gateway port")
    p.add_argument(
        "--model",
        default=None,
        help=f"{MODEL_HELP} (default: {DEFAULT_MODEL}; env KVLEDGER_MODEL)",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch threads per CPU worker (default: the cores this process may use, divided "
        "by the workers started here; env KVLEDGER_CPU_THREADS)",
    )
    p.add_argument("--device", default=None, help="auto, cpu or cuda (default: auto)")
    p.add_argument(
        "--kernels",
        default=None,
        help="attention backend: auto (CUDA kernels on a GPU, torch reference on the CPU), cuda "
        "or reference (default: auto)",
    )
    p.add_argument(
        "--kv-cache-memory-bytes",
        default=None,
        help=f"KV cache per worker (default on the CPU: {CPU_KV_CACHE_DEFAULT}; on CUDA: profiled)",
    )
    p.add_argument(
        "--num-gpu-blocks-override",
        default=None,
        help="pin the block count, for tests and benchmarks (default: profiled)",
    )
    p.add_argument("--max-model-len", default=None, help="tokens per request (default: 2048)")
    p.add_argument("--block-size", default=None, help="tokens per KV block (default: 16)")
    p.add_argument("--max-num-seqs", default=None, help="running requests per step (default: 64)")
    p.add_argument(
        "--max-num-batched-tokens", default=None, help="token budget per step (default: 2048)"
    )
    p.add_argument(
        "--watermark", default=None, help="share of blocks kept free at admission (default: 0)"
    )
    p.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default=None,
        help="the ledger's scheduling policy (default: fcfs; env KVLEDGER_SCHEDULING_POLICY)",
    )
    p.add_argument(
        "--hash-algo",
        "--prefix-caching-hash-algo",
        choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"),
        default=None,
        help="prefix-cache block hash (default: sha256; env KVLEDGER_HASH_ALGO)",
    )
    p.add_argument(
        "--async-scheduling",
        choices=("0", "1"),
        default=None,
        help="1: the ledger schedules a step ahead of the workers, 0: lock-step "
        "(default: 1; env KVLEDGER_ASYNC_SCHEDULING)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="name on /v1/models (default: the model folder's name, or kvledger-tiny-llama; "
        "env KVLEDGER_MODEL_NAME)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="replicas to start, each a ledger and a worker with its own KV cache, named "
        "r0..rN-1; the gateway routes across them (default: 1, named default)",
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
        "--routing",
        choices=("round_robin", "least_loaded", "approx", "precise"),
        default=None,
        help="the gateway's routing across replicas (default: precise; env KVLEDGER_ROUTING)",
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
    p.set_defaults(func=cmd_up)


def _child_env(args: argparse.Namespace, redis_url: str, metrics_port: int) -> dict[str, str]:
    env = dict(os.environ)
    env["KVLEDGER_REDIS_URL"] = redis_url
    env["KVLEDGER_HOST"] = args.host
    env["KVLEDGER_PORT"] = str(args.port)
    env["KVLEDGER_METRICS_PORT"] = str(metrics_port)
    env["KVLEDGER_METRICS_HOST"] = args.metrics_host
    env.pop("KVLEDGER_REDIS_URL_FILE", None)  # resolved here: the children get the URL itself
    flags = {
        "KVLEDGER_MODEL": args.model,
        "KVLEDGER_DEVICE": args.device,
        "KVLEDGER_KERNELS": args.kernels,
        "KVLEDGER_KV_CACHE_MEMORY_BYTES": args.kv_cache_memory_bytes,
        "KVLEDGER_NUM_GPU_BLOCKS_OVERRIDE": args.num_gpu_blocks_override,
        "KVLEDGER_MAX_MODEL_LEN": args.max_model_len,
        "KVLEDGER_BLOCK_SIZE": args.block_size,
        "KVLEDGER_MAX_NUM_SEQS": args.max_num_seqs,
        "KVLEDGER_MAX_NUM_BATCHED_TOKENS": args.max_num_batched_tokens,
        "KVLEDGER_WATERMARK": args.watermark,
        "KVLEDGER_SCHEDULING_POLICY": args.scheduling_policy,
        "KVLEDGER_HASH_ALGO": args.hash_algo,
        "KVLEDGER_ASYNC_SCHEDULING": args.async_scheduling,
        "KVLEDGER_MODEL_NAME": args.served_model_name,
        "KVLEDGER_ROUTING": args.routing,
        "KVLEDGER_CPU_THREADS": args.cpu_threads,
    }
    env.update({k: str(v) for k, v in flags.items() if v is not None})
    # Each CPU worker takes its share of the cores it may use (gpu_worker/threads.py).
    env["KVLEDGER_WORKERS_ON_HOST"] = str(args.replicas * args.tensor_parallel_size)
    if not env.get("KVLEDGER_KV_CACHE_MEMORY_BYTES") and not _cuda_wanted(
        env.get("KVLEDGER_DEVICE", "auto")
    ):
        env["KVLEDGER_KV_CACHE_MEMORY_BYTES"] = CPU_KV_CACHE_DEFAULT
    return env


def _cuda_wanted(device: str) -> bool:
    if device == "cpu":
        return False
    if device == "cuda":
        return True
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def redis_url_of(args: argparse.Namespace) -> str | None:
    """--redis-url, else KVLEDGER_REDIS_URL, else the file of --redis-url-file /
    KVLEDGER_REDIS_URL_FILE; None: start a private redis-server."""
    warn_password_on_command_line("up", args.redis_url)
    url = args.redis_url or env("KVLEDGER_REDIS_URL")
    path = args.redis_url_file or env("KVLEDGER_REDIS_URL_FILE")
    if not url and path:
        url = read_redis_url_file(path)
    return url


def cmd_up(args: argparse.Namespace) -> int:
    server = None
    if args.cpu_threads is not None and args.cpu_threads < 1:
        print(
            f"kvledger up: --cpu-threads must be at least 1, got {args.cpu_threads}",
            file=sys.stderr,
        )
        return 2
    # Checked before anything starts: one line here, not a traceback from a child.
    try:
        resolve_model(args.model or env("KVLEDGER_MODEL") or DEFAULT_MODEL)
    except ModelSourceError as exc:
        print(f"kvledger up: {exc}", file=sys.stderr)
        return 2
    try:
        redis_url = redis_url_of(args)
    except ConfigError as exc:
        print(f"kvledger up: {exc}", file=sys.stderr)
        return 2
    if not redis_url:
        try:
            server = RedisServer().start()
        except RedisServerError as exc:
            print(f"kvledger up: {exc}", file=sys.stderr)
            return 2
        redis_url = server.url
        print(f"kvledger up: private redis-server at {redis_url}", flush=True)
    if args.replicas < 1:
        print(f"kvledger up: --replicas must be at least 1, got {args.replicas}", file=sys.stderr)
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
    supervisor = Supervisor(
        [
            Child(role, [sys.executable, "-m", "kvledger.cli", role.split("-")[0]], child_env)
            for role, child_env in _roles(env_, replicas, ports, args.tensor_parallel_size)
        ]
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
        _banner(status, args.host, args.port, metrics_port, args.metrics_host)
        if len(replicas) > 1:
            print(
                f"kvledger up: {len(replicas)} replicas ({', '.join(replicas)}; ledger metrics "
                f"on ports {', '.join(map(str, ports))}), routing "
                f"{env_.get('KVLEDGER_ROUTING', 'precise')}",
                flush=True,
            )
        # From here on a child that exits is restarted (with backoff) until Ctrl-C / SIGTERM.
        supervisor.run()
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        supervisor.stop()
        if server is not None:
            server.stop()


def replica_names(count: int) -> list[str]:
    """One replica keeps the name every service defaults to; several are r0..rN-1."""
    return ["default"] if count == 1 else [f"r{i}" for i in range(count)]


def _roles(
    env: dict[str, str], replicas: list[str], ports: list[int], tp_size: int = 1
) -> list[tuple[str, dict[str, str]]]:
    """(child name, its environment): a ledger and a worker per replica (a worker per rank
    under tensor parallelism), then the gateway."""
    roles = []
    several = len(replicas) > 1
    for name, port in zip(replicas, ports, strict=True):
        replica_env = {**env, "KVLEDGER_REPLICA": name, "KVLEDGER_METRICS_PORT": str(port)}
        suffix = f"-{name}" if several else ""
        roles.append((f"ledger{suffix}", replica_env))
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
    return [*roles, ("gateway", gateway_env)]


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
                if not transport.is_unavailable(exc):
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
                return wire.decode(data, LedgerStatus)
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
