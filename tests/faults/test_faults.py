"""Issue 11's fault injection: under a steady load of streaming and non-streaming completions,
kill -9 each service (the supervisor restarts it), restart Redis with and without AOF, pause it,
and kill the worker for good. For each: every request ends with the quiet run's text or an
explicit error within BOUND_S, nothing hangs, every block is free afterwards and the stack
serves again with no manual restart.

Without -m: the short version (the worker killed, Redis restarted without its data). The full
set: `.venv/bin/python -m pytest tests/faults -m faults`.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.faults.conftest import (
    BOUND_S,
    Load,
    check,
    children,
    complete,
    expected_texts,
    fault_stack,
    wait_recovered,
)

LOAD_BEFORE_S = 2.0
LOAD_AFTER_S = 4.0


def _kill_and_recover(role: str) -> dict[str, float]:
    with fault_stack() as (served, _redis):
        expected = expected_texts(served.url)
        before = children(served)
        with Load(served.url) as load:
            time.sleep(LOAD_BEFORE_S)
            os.kill(before[role], signal.SIGKILL)
            time.sleep(LOAD_AFTER_S)
        figures = check(load.outcomes, expected)
        figures["recovered_s"] = wait_recovered(served, expected)
        after = children(served)
        assert after[role] != before[role], f"the {role} was not restarted"
        assert f"the {role} exited with code -9; restarting it" in served.output(400)
        print(f"kill -9 {role}: {figures}")
        return figures


def _redis_restart(aof: bool) -> dict[str, float]:
    with fault_stack(aof=aof) as (served, redis):
        expected = expected_texts(served.url)
        before = children(served)
        with Load(served.url) as load:
            time.sleep(LOAD_BEFORE_S)
            redis.restart(keep_data=aof)
            time.sleep(LOAD_AFTER_S)
        figures = check(load.outcomes, expected)
        figures["recovered_s"] = wait_recovered(served, expected)
        assert children(served) == before, "a service restarted: it should have reconnected"
        print(f"redis restart aof={aof}: {figures}")
        return figures


def test_worker_killed_is_restarted_and_no_request_is_lost():
    _kill_and_recover("worker")


def test_redis_restarted_without_its_data_fails_lost_requests_and_serves_again():
    _redis_restart(aof=False)


@pytest.mark.faults
@pytest.mark.parametrize("role", ["ledger", "gateway"])
def test_service_killed_is_restarted(role):
    _kill_and_recover(role)


@pytest.mark.faults
def test_redis_restarted_with_aof():
    _redis_restart(aof=True)


@pytest.mark.faults
def test_redis_paused_for_five_seconds():
    with fault_stack() as (served, redis):
        expected = expected_texts(served.url)
        before = children(served)
        with Load(served.url) as load:
            time.sleep(LOAD_BEFORE_S)
            redis.pause(5.0)
            time.sleep(LOAD_AFTER_S)
        figures = check(load.outcomes, expected)
        figures["recovered_s"] = wait_recovered(served, expected)
        assert children(served) == before
        print(f"redis paused 5 s: {figures}")


@pytest.mark.faults
def test_worker_gone_for_good_fails_requests_explicitly():
    # The ledger gives up on requests 10 s after its last worker is gone, well before the
    # gateway's own timeout (BOUND_S - 5): the error says why.
    with fault_stack(env={"KVLEDGER_NO_WORKER_TIMEOUT": "10"}) as (served, _redis):
        expected_texts(served.url)
        served.process.send_signal(signal.SIGSTOP)  # no restart: the supervisor is frozen
        try:
            os.kill(children(served)["worker"], signal.SIGKILL)
            started = time.monotonic()
            outs = [complete(served.url, i % 8, stream=i % 2 == 1) for i in range(4)]
        finally:
            served.process.send_signal(signal.SIGCONT)
        for out in outs:
            assert out.text is None and out.error, out
            assert "timed out" not in out.error, out
            # The ledger's error (a request it held), or the gateway's 503 once the ledger's
            # status says it has no worker (the requests sent after).
            assert "no worker" in out.error, out
            assert out.ended - out.sent <= BOUND_S
        print(f"worker gone: 4 requests failed explicitly in {time.monotonic() - started:.1f}s")
