"""Configuration: one dataclass per service, filled from flags with environment fallbacks.

Every environment variable kvledger reads is declared in `ENV_VARS` (name -> meaning), so the
compose file, the README and the code cannot drift apart. Secrets (the API key) come only from
the environment, never from flags or files.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

C = TypeVar("C")

ENV_VARS: dict[str, str] = {
    "KVLEDGER_REDIS_URL": "Redis URL shared by every service (default: a private redis-server)",
    "KVLEDGER_REDIS_URL_FILE": "a file holding the Redis URL (keeps a password out of `ps`)",
    "KVLEDGER_REPLICA": "this replica's name, a hash tag in its keys (default default)",
    "KVLEDGER_REPLICAS": "the gateway's replicas to route across, comma-separated (default: its own)",
    "KVLEDGER_ROUTING": "gateway routing: round_robin, least_loaded, approx or precise (default precise)",
    "KVLEDGER_ROUTING_WEIGHTS": "routing costs in prefill tokens, e.g. prefix=1,running=32,waiting=512,kv_usage=1024",
    "KVLEDGER_ROUTE_STALE_AFTER_S": "seconds a replica's events or ledger status may lag before the gateway stops trusting its events index (default 2)",
    "KVLEDGER_ROUTE_OUT_AFTER_S": "seconds a replica's events or ledger status may lag before the gateway sends it nothing (default 10)",
    "KVLEDGER_STREAM_PREFIX": "prefix of every Redis key kvledger uses (default kvl)",
    "KVLEDGER_LOG_LEVEL": "log level: debug, info, warning, error (default info)",
    "KVLEDGER_LOG_FORMAT": "json or console (default: console on a terminal, else json)",
    "KVLEDGER_API_KEY": "bearer token the gateway requires on /v1/* (unset: no auth)",
    "KVLEDGER_HOST": "gateway bind address (default 127.0.0.1)",
    "KVLEDGER_PORT": "gateway port (default 8000)",
    "KVLEDGER_MODEL": "model folder (Hugging Face layout) or 'default' for the seeded tiny Llama",
    "KVLEDGER_MODEL_NAME": "name served on /v1/models (default: the folder name, or kvledger-tiny-llama)",
    "KVLEDGER_DEVICE": "worker device: auto, cpu or cuda (default auto)",
    "KVLEDGER_DTYPE": "worker dtype: auto, float32, float16, bfloat16 (default auto)",
    "KVLEDGER_BLOCK_SIZE": "tokens per KV block (default 16)",
    "KVLEDGER_MAX_MODEL_LEN": "maximum tokens per request, prompt plus output (default 2048)",
    "KVLEDGER_MAX_NUM_SEQS": "maximum running requests per step (default 64)",
    "KVLEDGER_MAX_NUM_BATCHED_TOKENS": "token budget per scheduler step (default 2048)",
    "KVLEDGER_GPU_MEMORY_UTILIZATION": "share of the GPU this worker may use (default 0.92)",
    "KVLEDGER_KV_CACHE_MEMORY_BYTES": "fixed KV cache size per worker, e.g. 64MiB; skips profiling",
    "KVLEDGER_NUM_GPU_BLOCKS_OVERRIDE": "replace the profiled block count (benchmarks, tests)",
    "KVLEDGER_WATERMARK": "share of blocks kept free when admitting waiting requests (default 0)",
    "KVLEDGER_SCHEDULING_POLICY": "fcfs or priority (default fcfs)",
    "KVLEDGER_EVENT_LOOP": "uvloop (default where installed) or asyncio: the services' event loop",
    "KVLEDGER_ASYNC_SCHEDULING": "1 to schedule a step ahead of the workers (default), 0 for lock-step",
    "KVLEDGER_PREFIX_CACHING": "1 to enable prefix caching, 0 to disable (default 1)",
    "KVLEDGER_HASH_ALGO": "sha256, sha256_cbor, xxhash or xxhash_cbor (default sha256)",
    "KVLEDGER_NUM_WORKERS": "workers the ledger waits for before it sizes the pool (default 1)",
    "KVLEDGER_WORKER_ID": "this worker's id (default: host name and pid)",
    "KVLEDGER_KV_EVENTS_MAX_MB": "Redis memory the KV-events stream may take, in MB (default 256)",
    "KVLEDGER_METRICS_HOST": "address of the ledger's /metrics and /health (default 0.0.0.0; kvledger up: 127.0.0.1)",
    "KVLEDGER_METRICS_PORT": "port of the ledger's Prometheus endpoint (default 9100, 0 = off)",
    "KVLEDGER_NO_WORKER_TIMEOUT": "seconds the ledger holds requests with no live worker before failing them (default 60, 0 = never)",
    "KVLEDGER_REQUEST_TIMEOUT": "seconds a request may take before the gateway aborts it (default 600)",
    "KVLEDGER_MAX_QUEUE": "requests the gateway keeps in flight before it answers 429 (default 512)",
    "KVLEDGER_STALL_TIMEOUT": "seconds a waiting request lives without a ledger or workers and "
    "without output before a 503 (default 60)",
    "KVLEDGER_MAX_REQUEST_FAILURES": "failed steps a request may take part in before the ledger "
    "quarantines it (default 3)",
    "KVLEDGER_HEADER_TIMEOUT_S": "seconds an HTTP client may take to send its headers, or sit idle between requests (default 10)",
    "KVLEDGER_BODY_TIMEOUT_S": "seconds an HTTP client may take to send a request body before a 408 (default 60)",
    "KVLEDGER_MAX_CONNECTIONS": "open HTTP connections per service before new ones get a 503 (default: half the open-file limit)",
    "KVLEDGER_SEED": "seed of the default model's random weights (default 0)",
    "KVLEDGER_TP_RANK": "a worker's tensor-parallel rank (default 0)",
    "KVLEDGER_TP_SIZE": "ranks of a worker's tensor-parallel group (default 1)",
    "KVLEDGER_TP_HOST": "address rank 0 binds its rendezvous store on (default 127.0.0.1)",
    "KVLEDGER_TP_PORT": "rank 0's rendezvous port (default 0: any free one, shared via Redis)",
    "KVLEDGER_KERNELS": "attention backend: auto (default), cuda, or reference (the torch reference, even on a GPU)",
    "KVLEDGER_KERNEL_CACHE": "where JIT-built CUDA kernels are cached (default ~/.cache/kvledger/kernels)",
    "KVLEDGER_KERNEL_LIB": "a prebuilt libkvledger_kernels.so to load instead of building one",
    "KVLEDGER_NVCC": "the nvcc to build the CUDA kernels with (default: PATH, CUDA_HOME)",
    "KVLEDGER_TORCH_SPEC": "the torch requirement scripts/bootstrap.sh installs (default torch==2.13.0)",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "OTLP endpoint for traces, e.g. http://jaeger:4318 (unset: off)",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf (default) or grpc",
    "OTEL_TRACES_EXPORTER": "set to console to print spans instead of exporting them",
    "OTEL_SERVICE_NAME": "overrides the service.name of this process's spans",
    "PYTHONHASHSEED": "seed of NONE_HASH for block hashing (vLLM's rule)",
}


# Values the logs never print, wherever they appear (the logging set-up redacts them).
SECRET_ENV_VARS = ("KVLEDGER_API_KEY",)


def secret_values() -> tuple[str, ...]:
    values = [value for name in SECRET_ENV_VARS if (value := env(name))]
    password = redis_password(env("KVLEDGER_REDIS_URL") or "")
    return tuple(values + ([password] if password else []))


def redis_password(url: str) -> str | None:
    """The password in redis://user:password@host (None without one)."""
    try:
        return urlsplit(url).password or None
    except ValueError:
        return None


def redact_url(url: str) -> str:
    """The URL as it may be logged: the password replaced by ***."""
    password = redis_password(url)
    return url.replace(f":{password}@", ":***@", 1) if password else url


def read_redis_url_file(path: str) -> str:
    """The Redis URL from a file (first non-empty line): a password there stays out of `ps`."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--redis-url-file / KVLEDGER_REDIS_URL_FILE: {exc}") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise ConfigError(f"--redis-url-file / KVLEDGER_REDIS_URL_FILE: {path} is empty")
    return lines[0]


def env(name: str, default: str | None = None) -> str | None:
    if name not in ENV_VARS:
        raise KeyError(f"{name} is not declared in services.config.ENV_VARS")
    value = os.environ.get(name)
    return default if value is None or value == "" else value


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str | int) -> int:
    """'55910MiB' -> 58625163264; plain integers are bytes."""
    if isinstance(text, int):
        return text
    raw = text.strip().lower().replace("_", "").replace(",", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number) :].strip()
    if unit not in _UNITS or not number:
        raise ValueError(
            f"cannot read {text!r} as a size: use bytes or a unit such as 512MiB, 20GiB"
        )
    return int(float(number) * _UNITS[unit])


# A gateway's outputs stream lives this long after the ledger last wrote to it or its reader
# last refreshed it: the streams of gateways that restarted (a new id each start) or never
# existed (a request naming an unknown gateway) go away on their own.
OUTPUTS_TTL_S = 600


@dataclass(slots=True)
class StreamNames:
    """Every Redis key of one replica (a ledger and its workers): `{prefix}:{{{replica}}}:...`.
    The replica's name is a hash tag, so all of one replica's keys live in one slot of a Redis
    Cluster (multi-stream reads and pipelines need that) and replicas spread over the masters."""

    prefix: str = "kvl"
    replica: str = "default"

    @property
    def base(self) -> str:
        return f"{self.prefix}:{{{self.replica}}}"

    @property
    def requests(self) -> str:
        return f"{self.base}:requests"

    @property
    def results(self) -> str:
        return f"{self.base}:results"

    @property
    def events(self) -> str:
        return f"{self.base}:kv-events"

    @property
    def events_snapshot(self) -> str:
        return f"{self.base}:kv-events:snapshot"

    @property
    def dead_letters(self) -> str:
        return f"{self.base}:dead-letters"

    @property
    def ledger_status(self) -> str:
        return f"{self.base}:ledger:status"

    @property
    def leader(self) -> str:
        """The ledger lease: who leads this replica (ledger.service.leadership)."""
        return f"{self.base}:ledger:leader"

    @property
    def leader_token(self) -> str:
        """The leaders' fencing counter: each new leader's token is above every earlier one."""
        return f"{self.base}:ledger:leader-token"

    def steps(self, group: str) -> str:
        return f"{self.base}:steps:{group}"

    def outputs(self, gateway_id: str) -> str:
        """A gateway's outputs stream; it expires OUTPUTS_TTL_S after the last write or read."""
        return f"{self.base}:outputs:{gateway_id}"

    def gateway_marker(self, gateway_id: str) -> str:
        """A key the gateway renews: its absence means Redis lost its data (see gateway.outputs)."""
        return f"{self.base}:gateways:{gateway_id}"

    def worker(self, group: str, worker_id: str) -> str:
        """A worker's registration key (`*` as worker_id: the pattern of the group's keys)."""
        return f"{self.base}:workers:{group}:{worker_id}"

    def tp_rendezvous(self, group: str, epoch: str) -> str:
        """Where rank 0 of a tensor-parallel group publishes its store's host:port for an epoch."""
        return f"{self.base}:tp:{group}:{epoch}"


@dataclass
class CommonConfig:
    redis_url: str | None = field(
        default=None, metadata={"env": "KVLEDGER_REDIS_URL", "help": "Redis URL", "parse": None}
    )
    stream_prefix: str = field(
        default="kvl",
        metadata={
            "env": "KVLEDGER_STREAM_PREFIX",
            "help": "prefix of every Redis key",
            "parse": None,
        },
    )
    replica: str = field(
        default="default",
        metadata={
            "env": "KVLEDGER_REPLICA",
            "help": "name of this replica (a ledger and its workers); a hash tag in every key",
            "parse": lambda text: _replica_name(text),
        },
    )
    log_level: str = field(
        default="info",
        metadata={
            "env": "KVLEDGER_LOG_LEVEL",
            "help": "debug, info, warning, error",
            "parse": lambda text: _choice(text, ("debug", "info", "warning", "error", "critical")),
        },
    )
    log_format: str | None = field(
        default=None,
        metadata={
            "env": "KVLEDGER_LOG_FORMAT",
            "help": "json or console",
            "parse": lambda text: _choice(text, ("json", "console")),
        },
    )

    @property
    def streams(self) -> StreamNames:
        return StreamNames(self.stream_prefix, self.replica)


def _opt(
    env_name: str | None,
    default: Any,
    help: str,
    parse: Callable[[str], Any] | None = None,
    flags: tuple[str, ...] = (),
) -> Any:
    """A config field that argparse exposes as a flag (its name, or `flags`: vLLM's name first)
    and the environment can set."""
    return field(
        default=default, metadata={"env": env_name, "help": help, "parse": parse, "flags": flags}
    )


def _replica_name(text: str) -> str:
    name = text.strip()
    if not name or any(c in name for c in "{}:*?[] "):
        raise ValueError(f"{text!r}: a replica name is non-empty, without {{}}:*?[] or spaces")
    return name


def _choice(text: str, allowed: tuple[str, ...]) -> str:
    value = text.strip().lower()
    if value not in allowed:
        raise ValueError(f"{text!r}: use one of {', '.join(allowed)}")
    return value


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {text!r}")


def _optional_int(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none") else int(text)


def _optional_bytes(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none") else parse_bytes(text)


@dataclass
class HttpServerConfig:
    """Limits of a service's HTTP listener against slow and numerous clients
    (services.http_server)."""

    header_timeout_s: float = _opt(
        "KVLEDGER_HEADER_TIMEOUT_S",
        10.0,
        "seconds a client may take to send its request headers, or sit idle between requests",
        float,
    )
    body_timeout_s: float = _opt(
        "KVLEDGER_BODY_TIMEOUT_S",
        60.0,
        "seconds a client may take to send a body (408 after)",
        float,
    )
    max_connections: int | None = _opt(
        "KVLEDGER_MAX_CONNECTIONS",
        None,
        "open connections before new ones get a 503 and are closed (default: half the "
        "open-file limit, which is raised to its hard maximum)",
        _optional_int,
    )


@dataclass
class EngineShape:
    """Settings the gateway, ledger and worker must agree on."""

    block_size: int = _opt("KVLEDGER_BLOCK_SIZE", 16, "tokens per KV block", int)
    max_model_len: int = _opt("KVLEDGER_MAX_MODEL_LEN", 2048, "maximum tokens per request", int)


@dataclass
class LedgerConfig(CommonConfig, EngineShape, HttpServerConfig):
    group: str = _opt(None, "default", "worker group this ledger schedules")
    num_workers: int = _opt(
        "KVLEDGER_NUM_WORKERS", 1, "workers to wait for before sizing the pool", int
    )
    max_num_seqs: int = _opt("KVLEDGER_MAX_NUM_SEQS", 64, "maximum running requests per step", int)
    max_num_batched_tokens: int = _opt(
        "KVLEDGER_MAX_NUM_BATCHED_TOKENS", 2048, "token budget per scheduler step", int
    )
    enable_prefix_caching: bool = _opt(
        "KVLEDGER_PREFIX_CACHING", True, "prefix caching on/off", _bool
    )
    hash_algo: str = _opt(
        "KVLEDGER_HASH_ALGO",
        "sha256",
        "prefix-cache hash algorithm: sha256, sha256_cbor, xxhash or xxhash_cbor",
        lambda text: _choice(text, ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")),
        flags=("--hash-algo", "--prefix-caching-hash-algo"),
    )
    watermark: float = _opt(
        "KVLEDGER_WATERMARK", 0.0, "share of blocks kept free at admission", float
    )
    policy: str = _opt(
        "KVLEDGER_SCHEDULING_POLICY",
        "fcfs",
        "scheduling policy: fcfs or priority",
        lambda text: _choice(text, ("fcfs", "priority")),
        flags=("--scheduling-policy", "--policy"),
    )
    async_scheduling: bool = _opt(
        "KVLEDGER_ASYNC_SCHEDULING",
        True,
        "schedule the next step while the workers run this one",
        _bool,
    )
    num_gpu_blocks_override: int | None = _opt(
        "KVLEDGER_NUM_GPU_BLOCKS_OVERRIDE",
        None,
        "use this many blocks instead of the workers' report",
        _optional_int,
    )
    metrics_port: int = _opt(
        "KVLEDGER_METRICS_PORT", 9100, "Prometheus /metrics and /health port (0: off)", int
    )
    metrics_host: str = _opt(
        "KVLEDGER_METRICS_HOST", "0.0.0.0", "address of the metrics and health endpoint"
    )
    step_timeout_s: float = _opt(
        None, 600.0, "seconds a worker may take for one step before it is dropped", float
    )
    worker_ttl_s: float = _opt(
        None, 6.0, "seconds without a worker heartbeat before it counts as lost", float
    )
    max_request_failures: int = _opt(
        "KVLEDGER_MAX_REQUEST_FAILURES",
        3,
        "failed steps a request may take part in before it is quarantined (failed with an error)",
        int,
    )
    no_worker_timeout_s: float = _opt(
        "KVLEDGER_NO_WORKER_TIMEOUT",
        60.0,
        "seconds with no live worker before the requests held fail with an error (0: never)",
        float,
    )
    snapshot_interval_s: float = _opt(None, 1.0, "seconds between KV-event snapshots", float)
    leader_ttl_s: float = _opt(
        None, 5.0, "seconds a leader's lease lasts unrenewed; a standby takes over after it", float
    )
    kv_events_max_mb: float = _opt(
        "KVLEDGER_KV_EVENTS_MAX_MB",
        256.0,
        "Redis memory the KV-events stream may take, in MB (its MAXLEN follows the entry size)",
        float,
    )


@dataclass
class WorkerConfig(CommonConfig, EngineShape):
    group: str = _opt(None, "default", "worker group to join")
    worker_id: str | None = _opt("KVLEDGER_WORKER_ID", None, "this worker's id (default: host-pid)")
    model: str = _opt("KVLEDGER_MODEL", "default", "model folder, or 'default' for the tiny Llama")
    served_model_name: str | None = _opt(
        "KVLEDGER_MODEL_NAME",
        None,
        "name the model is served under (default: the model folder's name, or kvledger-tiny-llama)",
        flags=("--served-model-name",),
    )
    device: str = _opt("KVLEDGER_DEVICE", "auto", "auto, cpu or cuda")
    kernels: str = _opt(
        "KVLEDGER_KERNELS",
        "auto",
        "attention backend: auto (CUDA kernels on a GPU, the torch reference on the CPU), cuda "
        "or reference",
        lambda text: _choice(text, ("auto", "cuda", "reference")),
    )
    dtype: str = _opt("KVLEDGER_DTYPE", "auto", "auto, float32, float16 or bfloat16")
    seed: int = _opt("KVLEDGER_SEED", 0, "seed of the default model's weights", int)
    gpu_memory_utilization: float = _opt(
        "KVLEDGER_GPU_MEMORY_UTILIZATION", 0.92, "share of the GPU this worker may use", float
    )
    kv_cache_memory_bytes: int | None = _opt(
        "KVLEDGER_KV_CACHE_MEMORY_BYTES",
        None,
        "fixed KV cache size, e.g. 64MiB (skips profiling)",
        _optional_bytes,
    )
    num_gpu_blocks_override: int | None = _opt(
        "KVLEDGER_NUM_GPU_BLOCKS_OVERRIDE", None, "replace the profiled block count", _optional_int
    )
    max_num_batched_tokens: int = _opt(
        "KVLEDGER_MAX_NUM_BATCHED_TOKENS",
        2048,
        "token budget per step (sizes the profile run)",
        int,
    )
    max_num_seqs: int = _opt("KVLEDGER_MAX_NUM_SEQS", 64, "maximum requests per step", int)
    heartbeat_s: float = _opt(None, 1.0, "seconds between heartbeats", float)
    ttl_s: float = _opt(None, 6.0, "lifetime of the registration key without a heartbeat", float)
    tp_rank: int = _opt("KVLEDGER_TP_RANK", 0, "this worker's tensor-parallel rank", int)
    tp_size: int = _opt(
        "KVLEDGER_TP_SIZE", 1, "ranks of this worker's tensor-parallel group (1: no sharding)", int
    )
    tp_host: str = _opt(
        "KVLEDGER_TP_HOST",
        "127.0.0.1",
        "address rank 0 binds its rendezvous store on and publishes through Redis",
    )
    tp_port: int = _opt(
        "KVLEDGER_TP_PORT", 0, "rank 0's rendezvous port (0: any free port, via Redis)", int
    )
    tp_timeout_s: float = _opt(
        None, 15.0, "seconds a rendezvous or a collective may wait for the other ranks", float
    )


@dataclass
class GatewayConfig(CommonConfig, EngineShape, HttpServerConfig):
    host: str = _opt("KVLEDGER_HOST", "127.0.0.1", "bind address")
    port: int = _opt("KVLEDGER_PORT", 8000, "port", int)
    model: str = _opt("KVLEDGER_MODEL", "default", "model folder (for its tokenizer), or 'default'")
    model_name: str | None = _opt(
        "KVLEDGER_MODEL_NAME",
        None,
        "name served on /v1/models (default: the model folder's name, or kvledger-tiny-llama)",
        flags=("--served-model-name", "--model-name"),
    )
    gateway_id: str | None = _opt(None, None, "this gateway's id (default: host-pid)")
    max_queue: int = _opt("KVLEDGER_MAX_QUEUE", 512, "requests in flight before 429", int)
    request_timeout_s: float = _opt(
        "KVLEDGER_REQUEST_TIMEOUT", 600.0, "seconds before a request is aborted", float
    )
    ledger_wait_s: float = _opt(None, 10.0, "seconds to wait for a live ledger before 503", float)
    stall_timeout_s: float = _opt(
        "KVLEDGER_STALL_TIMEOUT",
        60.0,
        "seconds a waiting request lives without a ledger (its status key expired) or without "
        "workers, and without output, before it fails with a 503",
        float,
        flags=("--stall-timeout",),
    )
    max_body_bytes: int = _opt(
        None, 4 * 1024 * 1024, "largest request body accepted (413 above)", int
    )
    default_max_tokens: int = _opt(None, 16, "max_tokens of a completion that sets none", int)
    replicas: str | None = _opt(
        "KVLEDGER_REPLICAS",
        None,
        "replicas to route across, comma-separated (default: --replica alone)",
    )
    routing: str = _opt(
        "KVLEDGER_ROUTING",
        "precise",
        "routing policy across replicas: round_robin, least_loaded, approx or precise",
        lambda text: _choice(text, ("round_robin", "least_loaded", "approx", "precise")),
    )
    route_stale_after_s: float = _opt(
        "KVLEDGER_ROUTE_STALE_AFTER_S", 2.0,
        "seconds behind (events or ledger status) before a replica's events index is not trusted",
        float,
    )  # fmt: skip
    route_out_after_s: float = _opt(
        "KVLEDGER_ROUTE_OUT_AFTER_S", 10.0,
        "seconds behind (events or ledger status) before a replica gets no request", float,
    )  # fmt: skip
    routing_weights: str | None = _opt(
        "KVLEDGER_ROUTING_WEIGHTS",
        None,
        "routing costs in prefill tokens, e.g. waiting=256,kv_usage=2048 (default "
        "prefix=1,running=32,waiting=512,kv_usage=1024)",
    )

    @property
    def api_key(self) -> str | None:
        # A secret: from the environment only, never a flag or a file.
        return env("KVLEDGER_API_KEY")


@dataclass
class IndexerConfig(CommonConfig, HttpServerConfig):
    host: str = _opt(None, "127.0.0.1", "bind address")
    port: int = _opt(None, 8300, "port", int)
    model: str = _opt("KVLEDGER_MODEL", "default", "model folder (for its tokenizer), or 'default'")
    replicas: str = _opt(
        None,
        "default",
        "names of the replicas to follow, comma-separated (each ledger's --replica)",
    )
    checkpoint_dir: str | None = _opt(
        None, None, "folder of per-replica checkpoints to resume from after a restart"
    )
    stale_after_s: float = _opt(
        None, 2.0, "seconds behind (events or status) before a replica is stale", float
    )
    out_after_s: float = _opt(
        None, 10.0, "seconds behind (events or status) before a replica is out", float
    )
    max_body_bytes: int = _opt(
        None, 4 * 1024 * 1024, "largest request body accepted (413 above)", int
    )


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One --flag per field; its help shows the built-in default and the environment variable
    (the flag beats the variable, which beats the default)."""
    for f in fields(cls):
        meta = f.metadata
        if not meta or meta.get("help") is None:
            continue
        flags = meta.get("flags") or ("--" + f.name.replace("_", "-"),)
        env_name = meta.get("env")
        shown = "" if "(default" in meta["help"] else f"default: {_shown(f.default)}"
        where = "; ".join(part for part in (shown, f"env {env_name}" if env_name else "") if part)
        help_text = meta["help"] + (f" ({where})" if where else "")
        parser.add_argument(
            *flags, dest=f.name, default=None, help=help_text, metavar=f.name.upper()
        )


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def from_arguments(
    cls: type[C], namespace: argparse.Namespace | None = None, **overrides: Any
) -> C:
    """Flags beat the environment, which beats the built-in default; values are parsed once."""
    kwargs: dict[str, Any] = {}
    for f in fields(cast(Any, cls)):
        raw = getattr(namespace, f.name, None) if namespace is not None else None
        meta = f.metadata
        if raw is None and meta and meta.get("env"):
            raw = env(meta["env"])
        if raw is None:
            continue
        parse = meta.get("parse") if meta else None
        try:
            kwargs[f.name] = (
                parse(raw)
                if parse
                else (cast(Any, type(f.default))(raw) if f.default is not None else raw)
            )
        except (TypeError, ValueError) as exc:
            source = (
                f"--{f.name.replace('_', '-')}"
                if namespace is not None and getattr(namespace, f.name, None) is not None
                else meta.get("env")
            )
            raise ConfigError(f"{source}: {exc}") from None
    kwargs.update(overrides)
    return cls(**kwargs)


class ConfigError(ValueError):
    """A setting that does not parse; the message names the flag or variable."""
