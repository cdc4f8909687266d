"""The worker's CPU tier: a host buffer of whole KV blocks that the ledger's offloading connector
stores blocks into and loads them back from (vLLM 0.33's CPU offloading worker, synchronous).

One chunk is one block of every layer's K and V, laid out as the GPU cache is (one tensor per
layer and K/V, chunk first), pinned on CUDA so that the copies are DMA, a plain tensor on the
CPU. The ledger decides every chunk: the worker only checks that a step's copies fit its cache
and buffer, runs them in the step's order (flushed stores, loads, the forward pass, the other
stores) and reports them done with the step's result. The buffer lives as long as the worker:
a restarted worker has an empty one, and the ledger forgets the tier when it sees the restart.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch

from kernels import KVCache
from services.wire.messages import KVTransfer, KVTransfers


class TransferError(ValueError):
    """A step's copies that do not fit this worker's cache or buffer (the step is refused)."""


class HostKVTier:
    def __init__(self, kv_caches: Sequence[KVCache], num_chunks: int) -> None:
        self.num_chunks = num_chunks
        device = kv_caches[0][0].device
        pin = device.type == "cuda"
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = [
            tuple(  # type: ignore[misc]
                torch.empty((num_chunks, *cache.shape[1:]), dtype=cache.dtype, pin_memory=pin)
                for cache in layer
            )
            for layer in kv_caches
        ]
        self.bytes_per_chunk = sum(k[0].nbytes + v[0].nbytes for k, v in self.buffers)
        self._bytes: list[np.ndarray] | None = None
        self.loads = self.stores = self.blocks_loaded = self.blocks_stored = 0

    def check(self, transfers: KVTransfers, num_blocks: int) -> None:
        """Refuse, before anything runs, a copy whose ids fall outside the cache or the buffer."""
        if transfers.num_cpu_chunks != self.num_chunks:
            raise TransferError(
                f"the step's CPU tier has {transfers.num_cpu_chunks} chunks, this worker's "
                f"buffer {self.num_chunks}"
            )
        stores = {job.job_id for job in transfers.stores}
        unknown = [job_id for job_id in transfers.flush if job_id not in stores]
        if unknown:
            raise TransferError(f"flush of job {unknown[0]}, not a store of this step")
        for kind, jobs, src_limit, dst_limit in (
            ("load", transfers.loads, self.num_chunks, num_blocks),
            ("store", transfers.stores, num_blocks, self.num_chunks),
        ):
            for job in jobs:
                if len(job.src) != len(job.dst):
                    raise TransferError(
                        f"{kind} job {job.job_id}: {len(job.src)} sources, {len(job.dst)} targets"
                    )
                for ids, limit in ((job.src, src_limit), (job.dst, dst_limit)):
                    bad = next((i for i in ids if not 0 <= i < limit), None)
                    if bad is not None:
                        raise TransferError(
                            f"{kind} job {job.job_id}: id {bad} is outside 0..{limit - 1}"
                        )

    def check_shared(self, transfers: KVTransfers) -> None:
        """Refuse, before anything runs, a shared-tier copy whose chunks fall outside the buffer."""
        for kind, jobs in (("promotion", transfers.promotions), ("cascade", transfers.cascades)):
            for job in jobs:
                if len(job.chunks) != len(job.keys):
                    raise TransferError(
                        f"{kind} job {job.job_id}: {len(job.chunks)} chunks, {len(job.keys)} keys"
                    )
                bad = next((c for c in job.chunks if not 0 <= c < self.num_chunks), None)
                if bad is not None:
                    raise TransferError(
                        f"{kind} job {job.job_id}: chunk {bad} is outside 0..{self.num_chunks - 1}"
                    )

    def _byte_views(self) -> list[np.ndarray]:
        """Every buffer as bytes, one row per chunk (numpy views of the same memory: a copy in
        or out is one call each, not a tensor op's dispatch)."""
        if self._bytes is None:
            self._bytes = [
                buffer.view(torch.uint8).reshape(self.num_chunks, -1).numpy()
                for layer in self.buffers
                for buffer in layer
            ]
        return self._bytes

    def chunk_bytes(self, chunk_id: int) -> bytes:
        """One chunk as the shared tier keeps it: every layer's K then V, in layer order."""
        return b"".join(row[chunk_id].tobytes() for row in self._byte_views())

    def write_chunk(self, chunk_id: int, payload: bytes | memoryview) -> None:
        """Fill one chunk from the shared tier's bytes (`chunk_bytes`' layout, checked length)."""
        assert len(payload) == self.bytes_per_chunk, (len(payload), self.bytes_per_chunk)
        source = np.frombuffer(payload, dtype=np.uint8)
        at = 0
        for rows in self._byte_views():
            width = rows.shape[1]
            rows[chunk_id] = source[at : at + width]
            at += width

    def before_forward(self, transfers: KVTransfers, kv_caches: Sequence[KVCache]) -> list[int]:
        """The flushed stores (their blocks are written by this step), then the loads."""
        flush = set(transfers.flush)
        done = []
        for job in transfers.stores:
            if job.job_id in flush:
                self._store(job, kv_caches)
                done.append(job.job_id)
        for job in transfers.loads:
            self._load(job, kv_caches)
            done.append(job.job_id)
        return done

    def after_forward(self, transfers: KVTransfers, kv_caches: Sequence[KVCache]) -> list[int]:
        """The other stores: the blocks hold what this step computed."""
        flush = set(transfers.flush)
        done = []
        for job in transfers.stores:
            if job.job_id not in flush:
                self._store(job, kv_caches)
                done.append(job.job_id)
        return done

    def _load(self, job: KVTransfer, kv_caches: Sequence[KVCache]) -> None:
        device = kv_caches[0][0].device
        chunks = torch.tensor(job.src, dtype=torch.long)
        blocks = torch.tensor(job.dst, dtype=torch.long, device=device)
        for layer, host in zip(kv_caches, self.buffers, strict=True):
            for cache, buffer in zip(layer, host, strict=True):
                rows = buffer.index_select(0, chunks)
                cache.index_copy_(0, blocks, rows.to(device, non_blocking=True))
        self.loads += 1
        self.blocks_loaded += len(job.dst)

    def _store(self, job: KVTransfer, kv_caches: Sequence[KVCache]) -> None:
        device = kv_caches[0][0].device
        blocks = torch.tensor(job.src, dtype=torch.long, device=device)
        chunks = torch.tensor(job.dst, dtype=torch.long)
        for layer, host in zip(kv_caches, self.buffers, strict=True):
            for cache, buffer in zip(layer, host, strict=True):
                # On CUDA .cpu() waits for the copy: the chunk is whole when it is reported.
                buffer.index_copy_(0, chunks, cache.index_select(0, blocks).cpu())
        self.stores += 1
        self.blocks_stored += len(job.src)


def measure_load_cost(
    kv_caches: Sequence[KVCache], blocks: int = 8, repeats: int = 7
) -> tuple[float, float]:
    """(load, store) seconds per block between a host buffer and this cache, as the tier copies:
    the median of `repeats` jobs of `blocks` blocks, timed to the end of the copy. Each store
    takes blocks 0.. out and the load puts them back, so the cache is unchanged."""
    n = max(1, min(blocks, kv_caches[0][0].shape[0]))
    tier = HostKVTier(kv_caches, n)
    job = KVTransfer(0, list(range(n)), list(range(n)))
    cuda = kv_caches[0][0].device.type == "cuda"

    def timed(copy) -> float:
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        copy(job, kv_caches)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    timed(tier._store), timed(tier._load)  # warm-up: first calls allocate and compile
    stores, loads = [], []
    for _ in range(repeats):
        stores.append(timed(tier._store))
        loads.append(timed(tier._load))
    return statistics.median(loads) / n, statistics.median(stores) / n
