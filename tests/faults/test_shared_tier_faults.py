"""The shared tier under kill -9 of its worker (real processes: `kvledger up` with
--kv-offloading-size and --kv-shared-tier dir:PATH on a GPU pool too small for the prompts, so
blocks cascade GPU -> CPU -> shared while the load runs): every request ends with the quiet run's
text or an explicit error, and afterwards every block the catalog lists is on disk, whole,
under its key and namespace: a copy the kill cut short was never listed.

`slow` (about a minute); the same loss in process, in the default run:
tests/engine/test_shared_tier.py::test_a_worker_lost_mid_run_leaves_no_block_listed_that_is_not_there.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from services.tiers.blocks import block_path, unpack_block
from services.transport.keys import SharedTierKeys, StreamNames
from services.wire import codec
from services.wire.messages import LedgerStatus
from tests.faults.conftest import Load, check, children, expected_texts, fault_stack, wait_recovered
from tests.faults.test_cpu_tier_faults import ledger_metric

BLOCK_BYTES = 32 * 1024  # the tiny Llama's block: 4 layers, K and V, 16 tokens, one 64-wide head


@pytest.mark.slow
def test_a_worker_killed_mid_copy_leaves_only_whole_blocks_listed(tmp_path):
    tier = tmp_path / "kv"
    env = {"KVLEDGER_KV_OFFLOADING_SIZE": str(1 / 1024), "KVLEDGER_KV_SHARED_TIER": f"dir:{tier}"}
    with fault_stack(env=env, num_gpu_blocks=12) as (served, redis_server):
        expected = expected_texts(served.url)
        before = children(served)
        with Load(served.url) as load:
            deadline = time.monotonic() + 30
            while ledger_metric(served, "kvledger:shared_tier_cascaded_blocks_total") == 0:
                assert time.monotonic() < deadline, "no block reached the shared tier"
                time.sleep(0.2)
            os.kill(before["worker"], signal.SIGKILL)
            time.sleep(4.0)
        figures = check(load.outcomes, expected)
        figures["recovered_s"] = wait_recovered(served, expected)
        assert children(served)["worker"] != before["worker"]
        r = redis.Redis.from_url(redis_server.url)
        try:
            status = codec.decode(r.get(StreamNames("kvl", "default").ledger_status), LedgerStatus)
            assert status.shared_tier is not None
            namespace = status.shared_tier.namespace
            listed = r.zrange(SharedTierKeys("kvl", namespace).index, 0, -1)
        finally:
            r.close()
        assert listed
        for key in listed:
            data = block_path(tier, namespace, key, 0).read_bytes()
            unpack_block(data, namespace, key, 0, 1, BLOCK_BYTES)  # raises if not whole
        print(f"kill -9 worker with the shared tier: {figures}, {len(listed)} blocks listed")
