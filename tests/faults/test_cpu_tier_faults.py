"""The CPU tier under kill -9 of its worker (real processes: `kvledger up` with
--kv-offloading-size on a GPU pool too small for the prompts, so blocks go to the tier and come
back from it): every request ends with the quiet run's text or an explicit error, the restarted
worker's empty buffer is never read as if it held the tier, and the ledger publishes the tier's
blocks removed (medium CPU) when it sees the restart, then fills the tier again.

`slow` (about a minute); the same restart in process, in the default run:
tests/engine/test_cpu_tier.py::test_a_restarted_worker_takes_the_tier_with_it_and_the_ledger_forgets_it.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import msgpack
import pytest
import redis

from services.transport.keys import StreamNames
from tests.e2e.conftest import metric_value
from tests.faults.conftest import (
    Load,
    check,
    children,
    expected_texts,
    fault_stack,
    wait_recovered,
)

# 1 MiB: 32 blocks of the tiny Llama; the GPU lends 11, and the 8 prompts have 16 full blocks.
TIER = {"KVLEDGER_KV_OFFLOADING_SIZE": str(1 / 1024)}


def ledger_metric(served, name: str) -> float:
    text = urllib.request.urlopen(served.ledger_metrics_url, timeout=5).read().decode()
    return metric_value(text, name)


def stream_events(url: str) -> list[tuple[str, str | None]]:
    """(type, medium) of every event on the replica's KV-event stream, in order."""
    r = redis.Redis.from_url(url)
    try:
        entries = r.xrange(StreamNames("kvl", "default").events)
    finally:
        r.close()
    return [
        (event["type"], event.get("medium"))
        for _, fields in entries
        for event in msgpack.unpackb(fields[b"batch"])[1]
    ]


@pytest.mark.slow
def test_a_worker_killed_with_the_tier_on_loses_it_and_every_request_ends():
    with fault_stack(env=TIER, num_gpu_blocks=12) as (served, redis_server):
        expected = expected_texts(served.url)
        before = children(served)
        with Load(served.url) as load:
            deadline = time.monotonic() + 30
            while ledger_metric(served, "kvledger:cpu_tier_loaded_blocks_total") == 0:
                assert time.monotonic() < deadline, "no block was loaded from the tier"
                time.sleep(0.2)
            seen = len(stream_events(redis_server.url))
            os.kill(before["worker"], signal.SIGKILL)
            time.sleep(4.0)
        figures = check(load.outcomes, expected)
        figures["recovered_s"] = wait_recovered(served, expected)
        assert children(served)["worker"] != before["worker"]
        # The 16 prompt blocks fit the tier's 32: nothing was evicted from it before the kill,
        # so a removal of the tier's blocks is the ledger forgetting them, with the new epoch.
        after = stream_events(redis_server.url)[seen:]
        cleared = after.index(("AllBlocksCleared", None))
        assert ("BlockRemoved", "CPU") in after[:cleared], after[: cleared + 1]
        # The tier serves again after the restart: blocks stored into the new worker's buffer.
        assert ("BlockStored", "CPU") in after[cleared:]
        print(f"kill -9 worker with the CPU tier: {figures}")
