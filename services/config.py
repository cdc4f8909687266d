"""Configuration: one dataclass per service, filled from flags with environment fallbacks.

Every environment variable kvledger reads is declared in `ENV_VARS` (name -> meaning), so the
compose file, the README and the code cannot drift apart. Secrets (the API key) come only from
the environment, never from flags or files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

ENV_VARS: dict[str, str] = {
    "KVLEDGER_REDIS_URL": "Redis URL shared by every service (default: a private redis-server)",
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
    "KVLEDGER_PREFIX_CACHING": "1 to enable prefix caching, 0 to disable (default 1)",
    "KVLEDGER_HASH_ALGO": "sha256, sha256_cbor, xxhash or xxhash_cbor (default sha256)",
    "KVLEDGER_NUM_WORKERS": "workers the ledger waits for before it sizes the pool (default 1)",
    "KVLEDGER_WORKER_ID": "this worker's id (default: host name and pid)",
    "KVLEDGER_METRICS_PORT": "port of the ledger's Prometheus endpoint (default 9100, 0 = off)",
    "KVLEDGER_REQUEST_TIMEOUT": "seconds a request may take before the gateway aborts it (default 600)",
    "KVLEDGER_MAX_QUEUE": "requests the gateway keeps in flight before it answers 429 (default 512)",
    "KVLEDGER_SEED": "seed of the default model's random weights (default 0)",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "OTLP endpoint for traces, e.g. http://jaeger:4318 (unset: off)",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf (default) or grpc",
    "OTEL_TRACES_EXPORTER": "set to console to print spans instead of exporting them",
    "OTEL_SERVICE_NAME": "overrides the service.name of this process's spans",
    "PYTHONHASHSEED": "seed of NONE_HASH for block hashing (vLLM's rule)",
}


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


@dataclass(slots=True)
class StreamNames:
    """Every Redis key kvledger uses, under one prefix."""

    prefix: str = "kvl"

    @property
    def requests(self) -> str:
        return f"{self.prefix}:requests"

    @property
    def results(self) -> str:
        return f"{self.prefix}:results"

    @property
    def events(self) -> str:
        return f"{self.prefix}:kv-events"

    @property
    def events_snapshot(self) -> str:
        return f"{self.prefix}:kv-events:snapshot"

    @property
    def dead_letters(self) -> str:
        return f"{self.prefix}:dead-letters"

    @property
    def ledger_status(self) -> str:
        return f"{self.prefix}:ledger:status"

    def steps(self, group: str) -> str:
        return f"{self.prefix}:steps:{group}"

    def outputs(self, gateway_id: str) -> str:
        return f"{self.prefix}:outputs:{gateway_id}"


@dataclass(slots=True)
class CommonConfig:
    redis_url: str | None = field(default_factory=lambda: env("KVLEDGER_REDIS_URL"))
    stream_prefix: str = field(default_factory=lambda: env("KVLEDGER_STREAM_PREFIX", "kvl"))
    log_level: str = field(default_factory=lambda: env("KVLEDGER_LOG_LEVEL", "info"))
    log_format: str | None = field(default_factory=lambda: env("KVLEDGER_LOG_FORMAT"))

    @property
    def streams(self) -> StreamNames:
        return StreamNames(self.stream_prefix)
