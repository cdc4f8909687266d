"""The worker's side of the shared tier (gpu_worker/shared_tier.py) against real stores: what a
block found bad is (missing, corrupt: the catalog drops it) against a store that cannot serve
(unreachable: the catalog keeps it), and a store that hangs costing a step its deadline, not
the step's timeout."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence

import torch

from gpu_worker.offload import HostKVTier
from gpu_worker.shared_tier import Backend, DirectoryBackend, WorkerSharedTier, sweep_orphans
from services.tiers.blocks import block_path
from services.transport import redis_streams
from services.transport.keys import SharedTierKeys
from services.wire.messages import KVTransfers, SharedTransfer

NAMESPACE = "0123456789abcdef"


def caches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two layers of K and V, 4 blocks of 2 tokens, one head of 4: 32 bytes a block a tensor."""
    return [
        (torch.arange(32.0).reshape(4, 2, 1, 4) + 100 * layer, torch.full((4, 2, 1, 4), -1.0))
        for layer in range(2)
    ]


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\0\0\0\0"


def steps(
    promote: list[int] = (), cascade: list[int] = (), chunks: Sequence[int] = (0, 1, 2, 3)
) -> KVTransfers:
    transfers = KVTransfers(num_cpu_chunks=4, shared_namespace=NAMESPACE)
    if promote:
        transfers.promotions = [
            SharedTransfer(1, list(chunks[: len(promote)]), [key(i) for i in promote])
        ]
    if cascade:
        transfers.cascades = [
            SharedTransfer(2, list(chunks[: len(cascade)]), [key(i) for i in cascade])
        ]
    return transfers


class HungStore(Backend):
    """A store that never answers (a hard-mounted share whose server went away)."""

    async def read(self, namespace, keys, rank):
        await asyncio.sleep(3600)
        return []

    async def write(self, namespace, keys, rank, values):
        await asyncio.sleep(3600)

    async def delete(self, namespace, keys, rank):
        await asyncio.sleep(3600)


async def test_blocks_written_come_back_and_bad_ones_are_named(tmp_path):
    host = HostKVTier(caches(), 4)
    for chunk in range(4):
        host.write_chunk(chunk, bytes([chunk]) * host.bytes_per_chunk)
    tier = WorkerSharedTier(DirectoryBackend(tmp_path))
    assert await tier.run(steps(cascade=[1, 2, 3]), host) == ({2: []}, [])
    # Damage key 2's file and remove key 3's: bad blocks (the catalog drops them), not an outage.
    path = block_path(tmp_path, NAMESPACE, key(2), 0)
    path.write_bytes(path.read_bytes()[:-1] + b"\xff")
    block_path(tmp_path, NAMESPACE, key(3), 0).unlink()
    back = HostKVTier(caches(), 4)
    assert await tier.run(steps(promote=[1, 2, 3]), back) == ({1: [1, 2]}, [])
    assert back.chunk_bytes(0) == bytes([0]) * host.bytes_per_chunk


async def test_a_missing_namespace_folder_is_an_outage_not_missing_blocks(tmp_path):
    """An unmounted share reads as an empty folder: every block 'missing' would have the catalog
    drop them for every replica. Its namespace folder gone is the store away instead."""
    host = HostKVTier(caches(), 4)
    tier = WorkerSharedTier(DirectoryBackend(tmp_path / "unmounted"))
    assert await tier.run(steps(promote=[1, 2]), host) == ({1: [0, 1]}, [1])


async def test_a_store_that_hangs_costs_the_step_its_deadline_and_nothing_else():
    host = HostKVTier(caches(), 4)
    tier = WorkerSharedTier(HungStore(), deadline_s=0.2)
    transfers = steps(promote=[1, 2], cascade=[3], chunks=(0, 1, 2, 3))
    transfers.cascades[0].chunks = [3]
    transfers.shared_deletes = [key(9)]
    started = time.perf_counter()
    failed, unreachable = await tier.run(transfers, host)
    assert time.perf_counter() - started < 1.0
    assert failed == {1: [0, 1], 2: [0]} and sorted(unreachable) == [1, 2]


async def test_the_sweep_deletes_old_files_no_catalog_lists_and_nothing_else(tmp_path, redis_url):
    """A directory's orphans (a cascade whose commit never came, a temporary file a kill -9
    left, a probe folder) go once older than the grace; listed blocks and fresh files stay."""
    r = redis_streams.connect(redis_url)
    try:
        keys = SharedTierKeys(f"t{uuid.uuid4().hex[:8]}", NAMESPACE)
        host = HostKVTier(caches(), 4)
        tier = WorkerSharedTier(DirectoryBackend(tmp_path))
        await tier.run(steps(cascade=[1, 2, 3]), host)
        await r.zadd(keys.index, {key(1): 1})  # only key 1 was committed
        temporary = block_path(tmp_path, NAMESPACE, key(4), 0).with_name(".x.tmp")
        temporary.write_bytes(b"half a block")
        probe = tmp_path / "probe-w9" / "ab" / "abcd.r0.kvb"
        probe.parent.mkdir(parents=True)
        probe.write_bytes(b"a probe block")
        # Nothing is old enough yet.
        assert await sweep_orphans(r, keys, tmp_path, grace_s=60) == 0
        # An hour later: the unlisted blocks, the temporary file and the probe's file go.
        later = time.time() + 3600
        assert await sweep_orphans(r, keys, tmp_path, grace_s=60, now=later) == 4
        assert block_path(tmp_path, NAMESPACE, key(1), 0).exists()
        for gone in (2, 3):
            assert not block_path(tmp_path, NAMESPACE, key(gone), 0).exists()
        assert not temporary.exists() and not probe.exists()
        assert await sweep_orphans(r, keys, tmp_path, grace_s=60, now=later) == 0
    finally:
        await r.aclose()
