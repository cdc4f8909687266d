"""`kvledger up`'s supervision with real child processes: a child that exits is started again
after a capped exponential backoff, a stop request ends every child, and a stable child's next
crash starts over from the shortest delay. Also the launcher's exposure settings (issue 11,
items 6 and 10)."""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvledger.launcher import (
    _child_env,
    _roles,
    add_parser,
    kv_events_config_of,
    redis_url_of,
    role_flags,
)
from kvledger.supervisor import Child, Supervisor, backoff_delay
from services.config import KVEventsConfig, LedgerConfig, from_arguments, parse_kv_events_config
from services.environment import ConfigError, read_redis_url_file, redact_url, redis_password

ROOT = Path(__file__).resolve().parents[2]


def _child(role: str, code: str) -> Child:
    return Child(role, [sys.executable, "-c", code], dict(os.environ))


def _wait(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_backoff_is_capped_exponential():
    delays = []
    delay = 0.0
    for _ in range(8):
        delay = backoff_delay(delay, 0.5, 4.0)
        delays.append(delay)
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0]


def test_a_crashing_child_is_restarted_with_growing_delays_and_logged(capsys):
    crasher = _child("worker", "import sys; sys.exit(7)")
    steady = _child("ledger", "import time; time.sleep(60)")
    sup = Supervisor([crasher, steady], min_backoff_s=0.1, max_backoff_s=0.4, stable_after_s=30)
    sup.start()
    try:
        starts = []
        deadline = time.monotonic() + 10
        while crasher.restarts < 4 and time.monotonic() < deadline:
            before = crasher.restarts
            sup.poll()
            if crasher.restarts != before:
                starts.append(time.monotonic())
            time.sleep(0.01)
        assert crasher.restarts == 4
        assert crasher.exit_codes[:4] == [7, 7, 7, 7]
        assert crasher.delay_s == 0.4  # 0.1, 0.2, 0.4, then capped
        gaps = [b - a for a, b in itertools.pairwise(starts)]
        assert gaps[-1] >= 0.35  # the capped delay was waited, not a tight loop
        assert steady.restarts == 0 and steady.process is not None
        assert steady.process.poll() is None
    finally:
        sup.stop(timeout_s=5)
    err = capsys.readouterr().err
    assert "the worker exited with code 7; restarting it in 0.1s (restart 1)" in err
    assert "restarting it in 0.4s (restart 3)" in err
    assert steady.process.poll() is not None  # stopped with the rest


def test_a_child_that_ran_long_enough_starts_over_from_the_shortest_delay():
    clock = [0.0]
    child = _child("gateway", "pass")
    sup = Supervisor([child], min_backoff_s=1.0, max_backoff_s=8.0, stable_after_s=10,
                     clock=lambda: clock[0])  # fmt: skip
    child.delay_s = 8.0  # after a crash loop
    sup.start()
    assert child.process is not None
    child.process.wait(timeout=10)
    clock[0] = 100.0  # it ran 100 s before exiting
    sup.poll()
    assert child.delay_s == 1.0 and child.restart_at == 101.0
    sup.stop(timeout_s=5)


def test_no_restart_once_stopping():
    child = _child("worker", "pass")
    sup = Supervisor([child], min_backoff_s=0.0)
    sup.start()
    assert child.process is not None
    child.process.wait(timeout=10)
    sup.request_stop()
    sup.poll()
    assert child.restarts == 0 and child.restart_at is None


def _up_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["up", *argv])


def test_ledger_metrics_bind_to_localhost_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("KVLEDGER_METRICS_HOST", raising=False)
    assert from_arguments(LedgerConfig).metrics_host == "127.0.0.1"  # `kvledger ledger` alone too
    assert "--metrics-host" not in role_flags(_up_args(), "ledger")
    assert role_flags(_up_args("--metrics-host", "0.0.0.0"), "ledger") == [
        "--metrics-host",
        "0.0.0.0",
    ]


def test_up_passes_each_flag_to_the_roles_that_declare_it():
    args = _up_args("--dtype", "float32", "--routing-weights", "waiting=4", "--max-num-seqs", "8",
                    "--served-model-name", "m", "--log-level", "debug")  # fmt: skip

    def given(role: str) -> dict[str, str]:
        flags = role_flags(args, role)
        return dict(zip(flags[::2], flags[1::2], strict=True))

    assert given("worker") == {
        "--log-level": "debug", "--max-num-seqs": "8", "--served-model-name": "m",
        "--dtype": "float32",
    }  # fmt: skip
    assert given("gateway") == {
        "--log-level": "debug", "--served-model-name": "m", "--routing-weights": "waiting=4",
    }  # fmt: skip
    assert given("ledger") == {"--log-level": "debug", "--max-num-seqs": "8"}
    env = _child_env(args, "redis://127.0.0.1:1/0", 9100)
    assert env["KVLEDGER_REDIS_URL"] == "redis://127.0.0.1:1/0"


def test_up_offsets_each_replicas_zmq_ports_by_its_index(monkeypatch):
    monkeypatch.delenv("KVLEDGER_KV_EVENTS_CONFIG", raising=False)
    text = ('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
            '"replay_endpoint": "tcp://*:5600", "topic": "kv"}')  # fmt: skip
    args = _up_args("--replicas", "3", "--kv-events-config", text)
    assert "--kv-events-config" not in role_flags(args, "ledger")  # per replica, not as given
    config = kv_events_config_of(args)
    assert config is not None
    roles = dict(_roles({}, ["r0", "r1", "r2"], [1, 2, 3], 1, config))
    ledgers = [parse_kv_events_config(roles[f"ledger-r{i}"]["KVLEDGER_KV_EVENTS_CONFIG"])
               for i in range(3)]  # fmt: skip
    assert [(c.endpoint, c.replay_endpoint) for c in ledgers] == [
        ("tcp://*:5557", "tcp://*:5600"), ("tcp://*:5558", "tcp://*:5601"),
        ("tcp://*:5559", "tcp://*:5602"),
    ]  # fmt: skip
    assert {c.topic for c in ledgers} == {"kv"}
    assert "KVLEDGER_KV_EVENTS_CONFIG" not in roles["worker-r0"]
    # From the environment too, and refused by name before anything starts.
    monkeypatch.setenv("KVLEDGER_KV_EVENTS_CONFIG", '{"enable_kv_cache_events": true}')
    assert kv_events_config_of(_up_args()) == KVEventsConfig(True)
    with pytest.raises(ConfigError, match="--kv-events-config: key 'port'"):
        kv_events_config_of(_up_args("--kv-events-config", '{"port": 1}'))


def test_redis_url_from_a_file_and_the_password_never_printed(tmp_path, monkeypatch, capsys):
    secret_url = "redis://kv:s3cr3t-pw@127.0.0.1:6390/0"
    path = tmp_path / "redis-url"
    path.write_text(f"\n{secret_url}\n")
    monkeypatch.delenv("KVLEDGER_REDIS_URL", raising=False)
    monkeypatch.setenv("KVLEDGER_REDIS_URL_FILE", str(path))
    assert redis_url_of(_up_args()) == secret_url
    assert capsys.readouterr().err == ""  # from a file: no warning
    assert redis_url_of(_up_args("--redis-url", secret_url)) == secret_url
    err = capsys.readouterr().err
    assert "password on the command line" in err and "s3cr3t-pw" not in err
    assert "redis://kv:***@127.0.0.1:6390/0" in err
    assert redis_password(secret_url) == "s3cr3t-pw"
    assert redact_url("redis://127.0.0.1:1/0") == "redis://127.0.0.1:1/0"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        read_redis_url_file(str(tmp_path / "empty"))


def test_a_service_warns_about_a_password_flag_without_printing_it():
    # No Redis answers on port 1: the gateway warns, then waits for Redis (logging the wait,
    # the URL's password left out) until stopped.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvledger.cli", "gateway", "--model", "tiny", "--redis-url",
         "redis://:hunter2-secret@127.0.0.1:1/0", "--port", "1"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        for line in proc.stdout:
            lines.append(line)
            if "redis_unavailable" in line or time.monotonic() > deadline:
                break
    finally:
        proc.terminate()
        rest, _ = proc.communicate(timeout=30)
    out = "".join(lines) + rest
    assert "password on the command line" in out
    assert "redis_unavailable" in out
    assert "hunter2-secret" not in out


def test_sigint_stops_a_background_supervisor():
    # A shell starts background jobs with SIGINT ignored; the supervisor must still stop on it.
    code = (
        "import signal, sys, time\n"
        "from kvledger.supervisor import Child, Supervisor\n"
        "sup = Supervisor([Child('worker', [sys.executable, '-c', 'import time; time.sleep(60)'], {})])\n"
        "sup.install_signal_handlers(); sup.start(); print('up', flush=True); sup.run(0.05)\n"
        "sup.stop(5); print('stopped', sup.children['worker'].process.returncode, flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "up"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert out.strip() == f"stopped {-signal.SIGTERM}"


def test_up_starts_several_gateways_on_consecutive_ports():
    from kvledger.launcher import _roles

    args = _up_args("--gateways", "3", "--port", "8100", "--max-queue", "64")
    assert args.gateways == 3
    flags = role_flags(args, "gateway", frozenset({"port"}))
    assert "--port" not in flags and flags[flags.index("--max-queue") + 1] == "64"
    roles = _roles({}, ["r0", "r1"], [9100, 9101], gateways=3, port=8100)
    gateways = [(name, env) for name, env in roles if name.startswith("gateway")]
    assert [name for name, _ in gateways] == ["gateway", "gateway-1", "gateway-2"]
    assert [env["KVLEDGER_PORT"] for _, env in gateways] == ["8100", "8101", "8102"]
    assert all(env["KVLEDGER_REPLICAS"] == "r0,r1" for _, env in gateways)
    # One gateway: as before, its port from the flag or the environment.
    assert [n for n, _ in _roles({}, ["default"], [9100])] == ["ledger", "worker", "gateway"]
