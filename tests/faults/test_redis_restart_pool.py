"""Issue 22: once a restarted Redis answers, no request fails for the connections that died
with the old one. The gateway's pool grows under a burst (a connection per concurrent command),
Redis is killed (kill -9) and restarted empty on the same port; once the gateway's /health says
200 (the ledger re-created its groups and wrote its status), bursts of concurrent requests all
succeed: no 503 "cannot reach Redis" from a pooled connection that died with the old server.

Without -m: one burst of 96 before, two after. The full version (`-m faults`): a burst of 300
before (a larger pool to go stale), five of 96 after.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import _http_status
from tests.faults.conftest import Outcome, complete, expected_texts, fault_stack

BURST = 96


def _burst(url: str, size: int, stream: bool | None = None) -> list[Outcome]:
    with ThreadPoolExecutor(size) as pool:
        jobs = [
            pool.submit(complete, url, i % 8, i % 2 == 1 if stream is None else stream)
            for i in range(size)
        ]
        return [job.result() for job in jobs]


def _restart_then_bursts(before: int, bursts: int) -> None:
    # A queue deep enough for the largest burst.
    with fault_stack(env={"KVLEDGER_MAX_QUEUE": "1024"}) as (served, redis):
        expected = expected_texts(served.url)
        warm = _burst(served.url, before)  # the gateway's pool grows to about `before`
        assert all(o.text == expected[o.prompt] for o in warm), [o.error for o in warm][:3]
        redis.restart(keep_data=False)  # SIGKILL, then an empty redis-server on the same port
        deadline = time.monotonic() + 60
        while _http_status(f"{served.url}/health") != 200:
            assert time.monotonic() < deadline, "the gateway's /health never said 200 again"
            time.sleep(0.2)
        failed = []
        for n in range(bursts):
            outcomes = _burst(served.url, BURST)
            errors = [o for o in outcomes if o.text is None]
            wrong = [o for o in outcomes if o.text is not None and o.text != expected[o.prompt]]
            assert not wrong, wrong[:3]
            failed.append(len(errors))
            print(f"burst {n + 1} after the restart: {len(errors)}/{BURST} errors "
                  f"{sorted({o.error[:90] for o in errors})[:3]}")  # fmt: skip
        assert failed == [0] * bursts, f"errors per burst once Redis answered: {failed}"


def test_no_request_fails_once_a_restarted_redis_answers():
    _restart_then_bursts(before=BURST, bursts=2)


@pytest.mark.faults
def test_no_request_fails_once_a_restarted_redis_answers_full():
    _restart_then_bursts(before=300, bursts=5)
