"""Configuration: one dataclass per service, filled from flags with environment fallbacks
(every variable declared in `services.environment.ENV_VARS`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Container
from dataclasses import Field, dataclass, field, fields
from typing import Any, TypeVar, cast

from services.environment import ConfigError, env
from services.transport.keys import StreamNames

C = TypeVar("C")

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
        "KVLEDGER_METRICS_HOST",
        "127.0.0.1",
        "address of the metrics and health endpoint (0.0.0.0: every interface)",
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
        "override the measured routing costs (seconds, from each ledger's status) with weights "
        "in prefill tokens, e.g. waiting=256,kv_usage=2048 over prefix=1,running=32,"
        "waiting=512,kv_usage=1024 (default: measured)",
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


def flag_of(f: Field[Any]) -> str:
    """The flag a config field is set with (vLLM's name first where it has one)."""
    return (f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),))[0]


def flag_fields(cls: type) -> list[Field[Any]]:
    """The fields of a config class that are flags (those with a help text)."""
    return [f for f in fields(cls) if f.metadata and f.metadata.get("help") is not None]


def add_arguments(
    parser: argparse.ArgumentParser, cls: type, skip: Container[str] = ()
) -> list[Field[Any]]:
    """One --flag per field (but those named in `skip`, by field name or flag); its help shows
    the built-in default and the environment variable (the flag beats the variable, which beats
    the default). Returns the fields added."""
    added = []
    for f in flag_fields(cls):
        if f.name in skip or flag_of(f) in skip:
            continue
        meta = f.metadata
        flags = meta.get("flags") or (flag_of(f),)
        env_name = meta.get("env")
        shown = "" if "(default" in meta["help"] else f"default: {_shown(f.default)}"
        where = "; ".join(part for part in (shown, f"env {env_name}" if env_name else "") if part)
        help_text = meta["help"] + (f" ({where})" if where else "")
        parser.add_argument(
            *flags, dest=f.name, default=None, help=help_text, metavar=f.name.upper()
        )
        added.append(f)
    return added


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
