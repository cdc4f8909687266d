"""`kvledger worker --tp-rank R --tp-size N` parse into the worker's config through the real
command-line parser: flags beat KVLEDGER_TP_*, which beat the defaults; bad values name the flag."""

from __future__ import annotations

import pytest

from kvledger.cli import build_parser
from services.config import WorkerConfig, from_arguments
from services.environment import ConfigError


def worker_config(*argv: str) -> WorkerConfig:
    return from_arguments(WorkerConfig, build_parser().parse_args(["worker", *argv]))


def test_tp_flags_set_rank_size_and_rendezvous_address(monkeypatch):
    monkeypatch.delenv("KVLEDGER_TP_RANK", raising=False)
    monkeypatch.delenv("KVLEDGER_TP_SIZE", raising=False)
    cfg = worker_config(
        "--tp-rank", "1", "--tp-size", "4", "--tp-host", "10.0.0.7", "--tp-port", "29500"
    )
    assert (cfg.tp_rank, cfg.tp_size, cfg.tp_host, cfg.tp_port) == (1, 4, "10.0.0.7", 29500)


def test_without_flags_a_worker_is_a_single_rank(monkeypatch):
    for name in ("KVLEDGER_TP_RANK", "KVLEDGER_TP_SIZE", "KVLEDGER_TP_PORT"):
        monkeypatch.delenv(name, raising=False)
    cfg = worker_config()
    assert (cfg.tp_rank, cfg.tp_size, cfg.tp_port) == (0, 1, 0)


def test_flags_beat_the_environment(monkeypatch):
    monkeypatch.setenv("KVLEDGER_TP_RANK", "3")
    monkeypatch.setenv("KVLEDGER_TP_SIZE", "4")
    assert (worker_config().tp_rank, worker_config().tp_size) == (3, 4)
    cfg = worker_config("--tp-rank", "0", "--tp-size", "2")
    assert (cfg.tp_rank, cfg.tp_size) == (0, 2)


def test_a_rank_that_is_not_a_number_names_the_flag():
    with pytest.raises(ConfigError, match="--tp-rank"):
        worker_config("--tp-rank", "one", "--tp-size", "2")


def test_up_takes_the_tensor_parallel_size():
    args = build_parser().parse_args(["up", "--tensor-parallel-size", "2"])
    assert int(args.tensor_parallel_size) == 2
