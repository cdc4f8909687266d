"""The worker's side of the shared tier: it copies blocks between its CPU tier (the host buffer)
and the shared store, as the ledger's steps say, and reports what failed.

Two backends, chosen by `--kv-shared-tier`:

- `dir:PATH`: one file per block and rank (`services.tiers.blocks.block_path`), written to a
  temporary name and renamed over any file there, so a reader sees a whole block or none (a
  block is written only when the catalog lacks it: one there was left behind, or is bad).
- `redis`: one value per block and rank in the namespace's hash slot, written with NX and an
  expiry that the ledger's commit lifts (`services.tiers.catalog`): a value whose commit never
  came (its ledger died) goes away on its own.

A directory's files whose commit never came (a ledger fenced or killed, a rank whose write
failed, a delete lost) have no expiry: one worker of the fleet at a time (a lease in the
catalog's hash slot) sweeps the namespace's folder every `SWEEP_INTERVAL_S`, deleting the block
files the catalog does not list and the temporary files, once older than `ORPHAN_GRACE_S` (a
cascade is committed within a step or two of its write), and the probe folders workers left.

Each block is checked on the way back (`unpack_block`: namespace, key, rank, size, CRC-32), so a
missing, truncated or corrupt block is a failed copy of that key, never KV in the cache (the
ledger drops it from the catalog). A job the store could not serve at all (Redis unreachable or
timed out, a file that cannot be read, the namespace's directory gone: an unmounted share) is
reported *unreachable*: the blocks are recomputed, and the catalog keeps them for the replicas
that can still read them. No failure of the store fails the step.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from gpu_worker.offload import HostKVTier
from observability import get_logger
from services.config import SharedTierSpec
from services.tiers.blocks import CorruptBlock, block_path, pack_block, unpack_block
from services.tiers.catalog import connect_tier
from services.transport.keys import SharedTierKeys
from services.wire.messages import KVTransfers, SharedTransfer

log = get_logger("kvledger.worker.shared_tier")

# A Redis value's life until its ledger commits it (then it lives until evicted).
UNCOMMITTED_TTL_MS = 600_000
# What a step's shared-tier I/O may take in all: past it, the jobs left are reported unreachable
# (a hung mount or a server that stopped answering costs one step this much, never the step's
# own timeout; an abandoned read is dropped, an abandoned write leaves an unlisted file).
STEP_DEADLINE_S = 5.0
ORPHAN_GRACE_S = 1800.0
SWEEP_INTERVAL_S = 600.0


class Backend(ABC):
    @abstractmethod
    async def read(self, namespace: str, keys: Sequence[bytes], rank: int) -> list[bytes | None]:
        """Each key's stored bytes (None: not there)."""

    @abstractmethod
    async def write(
        self, namespace: str, keys: Sequence[bytes], rank: int, values: Sequence[bytes]
    ) -> None:
        """Store each key's bytes unless a value is there already."""

    @abstractmethod
    async def delete(self, namespace: str, keys: Sequence[bytes], rank: int) -> None: ...

    async def close(self) -> None:  # noqa: B027 - optional
        pass


class DirectoryBackend(Backend):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    async def read(self, namespace: str, keys: Sequence[bytes], rank: int) -> list[bytes | None]:
        return await asyncio.to_thread(self._read, namespace, keys, rank)

    def _read(self, namespace: str, keys: Sequence[bytes], rank: int) -> list[bytes | None]:
        if not (self.root / namespace).is_dir():
            # Blocks are read only where the catalog lists some, so their folder was written:
            # gone means the share is not there (unmounted), not that every block is missing.
            raise FileNotFoundError(f"the namespace's folder {self.root / namespace} is missing")
        values: list[bytes | None] = []
        for key in keys:
            try:
                values.append(block_path(self.root, namespace, key, rank).read_bytes())
            except FileNotFoundError:
                values.append(None)
        return values

    async def write(
        self, namespace: str, keys: Sequence[bytes], rank: int, values: Sequence[bytes]
    ) -> None:
        await asyncio.to_thread(self._write, namespace, keys, rank, values)

    def _write(
        self, namespace: str, keys: Sequence[bytes], rank: int, values: Sequence[bytes]
    ) -> None:
        for key, value in zip(keys, values, strict=True):
            path = block_path(self.root, namespace, key, rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
            try:
                with temporary.open("wb") as f:
                    f.write(value)
                os.replace(temporary, path)  # atomic: a reader sees all of it or nothing
            finally:
                with contextlib.suppress(FileNotFoundError):
                    temporary.unlink()

    async def delete(self, namespace: str, keys: Sequence[bytes], rank: int) -> None:
        await asyncio.to_thread(self._delete, namespace, keys, rank)

    def _delete(self, namespace: str, keys: Sequence[bytes], rank: int) -> None:
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                block_path(self.root, namespace, key, rank).unlink()


class RedisBackend(Backend):
    def __init__(self, r: aioredis.Redis, prefix: str, owned: bool = False) -> None:
        self.r = r
        self.prefix = prefix
        self.owned = owned

    async def read(self, namespace: str, keys: Sequence[bytes], rank: int) -> list[bytes | None]:
        if not keys:
            return []
        names = [SharedTierKeys(self.prefix, namespace).data(key, rank) for key in keys]
        values: list[Any] = await self.r.mget(names)
        return [bytes(v) if v is not None else None for v in values]

    async def write(
        self, namespace: str, keys: Sequence[bytes], rank: int, values: Sequence[bytes]
    ) -> None:
        if not keys:
            return
        async with self.r.pipeline(transaction=False) as pipe:
            for key, value in zip(keys, values, strict=True):
                pipe.set(
                    SharedTierKeys(self.prefix, namespace).data(key, rank), value,
                    nx=True, px=UNCOMMITTED_TTL_MS,
                )  # fmt: skip
            await pipe.execute()

    async def delete(self, namespace: str, keys: Sequence[bytes], rank: int) -> None:
        if keys:
            await self.r.delete(
                *[SharedTierKeys(self.prefix, namespace).data(key, rank) for key in keys]
            )

    async def close(self) -> None:
        if self.owned:
            await self.r.aclose()


def make_backend(spec: SharedTierSpec, r: aioredis.Redis, prefix: str) -> Backend:
    if spec.backend == "dir":
        return DirectoryBackend(spec.path)
    if spec.redis_url:
        return RedisBackend(connect_tier(spec.redis_url), prefix, owned=True)
    return RedisBackend(r, prefix)


PROBE_NAMESPACE = "probe"


def shared_reports(
    outcomes: Sequence[tuple[SharedTransfer, list[int] | None]],
) -> tuple[dict[int, list[int]], list[int]]:
    """A step's report of its shared-tier jobs from each one's outcome (the indices of its keys
    found bad, or None: the store could not serve it): job id -> failed key indices (all of
    them for an unreachable job), and the unreachable jobs."""
    failed = {
        job.job_id: list(range(len(job.keys))) if bad is None else bad for job, bad in outcomes
    }
    return failed, [job.job_id for job, bad in outcomes if bad is None]


def _old_files(
    root: Path, namespace: str, cutoff: float
) -> tuple[list[tuple[bytes, Path]], list[Path]]:
    """Under the namespace's folder, the block files (key, path) and the other files (temporary,
    and every file of the probe folders workers left), last written before `cutoff`."""
    blocks: list[tuple[bytes, Path]] = []
    others: list[Path] = []
    folders = [(root / namespace, True)]
    if root.is_dir():
        folders += [(Path(e.path), False) for e in os.scandir(root)
                    if e.name.startswith(f"{PROBE_NAMESPACE}-") and e.is_dir()]  # fmt: skip
    for folder, listed in folders:
        if not folder.is_dir():
            continue
        for sub in os.scandir(folder):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                try:
                    if entry.stat(follow_symlinks=False).st_mtime >= cutoff:
                        continue
                except FileNotFoundError:
                    continue
                hex_key, _, rest = entry.name.partition(".")
                if listed and rest.endswith("kvb") and not entry.name.startswith("."):
                    with contextlib.suppress(ValueError):
                        blocks.append((bytes.fromhex(hex_key), Path(entry.path)))
                        continue
                others.append(Path(entry.path))
    return blocks, others


def _unlink_older(paths: list[Path], cutoff: float) -> int:
    """Each path still last written before `cutoff` (one rewritten since is kept), deleted."""
    removed = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
    return removed


async def sweep_orphans(
    r: aioredis.Redis,
    keys: SharedTierKeys,
    root: str | Path,
    grace_s: float = ORPHAN_GRACE_S,
    now: float | None = None,
) -> int:
    """Deletes the namespace's block files the catalog's index does not list, its temporary
    files and the probe folders' files, all last written more than `grace_s` ago; how many."""
    cutoff = (time.time() if now is None else now) - grace_s
    blocks, doomed = await asyncio.to_thread(_old_files, Path(root), keys.namespace, cutoff)
    for start in range(0, len(blocks), 512):
        batch = blocks[start : start + 512]
        async with r.pipeline(transaction=False) as pipe:
            for key, _ in batch:
                pipe.zscore(keys.index, key)
            scores = await pipe.execute()
        doomed += [path for (_, path), score in zip(batch, scores, strict=True) if score is None]
    return await asyncio.to_thread(_unlink_older, doomed, cutoff)


class WorkerSharedTier:
    """Runs a step's shared-tier copies for this rank (`run`: job id -> failed key indices, and
    the jobs the store could not serve at all)."""

    def __init__(
        self, backend: Backend, rank: int = 0, tp_size: int = 1, deadline_s: float = STEP_DEADLINE_S
    ) -> None:
        self.backend = backend
        self.deadline_s = deadline_s
        self.namespace = ""  # the ledger's, as its steps name it
        self.rank = rank
        self.tp_size = tp_size
        self.blocks_read = self.blocks_written = self.failures = 0
        self.seconds = [0.0, 0.0]  # the last step's [reads (promotions), writes (cascades)]

    async def run(
        self, transfers: KVTransfers, host: HostKVTier
    ) -> tuple[dict[int, list[int]], list[int]]:
        namespace = self.namespace = transfers.shared_namespace
        started = time.perf_counter()
        deadline = started + self.deadline_s

        def left() -> float:
            return deadline - time.perf_counter()

        outcomes: list[tuple[SharedTransfer, list[int] | None]] = []
        for job in transfers.promotions:
            bad = await self._promote(namespace, job.keys, job.chunks, host, max(left(), 0.0))
            outcomes.append((job, bad))
        read = time.perf_counter()
        for job in transfers.cascades:
            bad = await self._cascade(namespace, job.keys, job.chunks, host, max(left(), 0.0))
            outcomes.append((job, bad))
        self.seconds = [read - started, time.perf_counter() - read]
        if transfers.shared_deletes:
            try:
                await asyncio.wait_for(
                    self.backend.delete(namespace, transfers.shared_deletes, self.rank),
                    max(left(), 0.0),
                )
            except Exception as exc:  # the data stays; the catalog no longer lists it
                log.warning("shared_tier_delete_failed", error=f"{type(exc).__name__}: {exc}")
        return shared_reports(outcomes)

    async def _promote(
        self,
        namespace: str,
        keys: list[bytes],
        chunks: list[int],
        host: HostKVTier,
        timeout: float | None = None,
    ) -> list[int] | None:
        """Reads `keys` into `chunks`: the indices of the keys missing or corrupt (None: the
        store could not be read within `timeout` seconds)."""
        try:  # a deadline already past cancels the read before it starts
            values = await asyncio.wait_for(self.backend.read(namespace, keys, self.rank), timeout)
        except Exception as exc:
            self._unreachable("read", keys, exc)
            return None
        bad = []
        for index, (key, chunk, value) in enumerate(zip(keys, chunks, values, strict=True)):
            if value is None:
                bad.append(index)
                continue
            try:
                payload = unpack_block(
                    value, namespace, key, self.rank, self.tp_size, host.bytes_per_chunk
                )
            except CorruptBlock as exc:
                log.warning("shared_tier_block_corrupt", key=key.hex(), reason=str(exc))
                bad.append(index)
                continue
            host.write_chunk(chunk, payload)
        self.blocks_read += len(keys) - len(bad)
        self.failures += len(bad)
        return bad

    async def _cascade(
        self,
        namespace: str,
        keys: list[bytes],
        chunks: list[int],
        host: HostKVTier,
        timeout: float | None = None,
    ) -> list[int] | None:
        """Writes `chunks` under `keys`: [] when written (None: the store could not be written
        within `timeout` seconds)."""
        try:
            values = [
                pack_block(namespace, key, self.rank, self.tp_size, host.chunk_bytes(chunk))
                for key, chunk in zip(keys, chunks, strict=True)
            ]
            await asyncio.wait_for(self.backend.write(namespace, keys, self.rank, values), timeout)
        except Exception as exc:
            self._unreachable("write", keys, exc)
            return None
        self.blocks_written += len(keys)
        return []

    async def measure_promotion(
        self, kv_caches: Sequence, worker_id: str, blocks: int = 8, repeats: int = 5
    ) -> float:
        """Seconds per block to read a block back from the store into a host buffer (what a
        promotion costs; the CPU tier's load comes on top): `blocks` probe blocks written under
        a namespace of their own, read back `repeats` times, the median, then deleted."""
        host = HostKVTier(kv_caches, blocks)
        namespace = f"{PROBE_NAMESPACE}-{worker_id}"
        keys = [f"probe{i}".encode().ljust(36, b"\0") for i in range(blocks)]
        chunks = list(range(blocks))
        if await self._cascade(namespace, keys, chunks, host) != []:
            raise OSError("the probe blocks could not be written")
        times = []
        try:
            for _ in range(repeats + 1):  # the first read warms the connection and the page cache
                started = time.perf_counter()
                if await self._promote(namespace, keys, chunks, host) != []:
                    raise OSError("the probe blocks could not be read back")
                times.append((time.perf_counter() - started) / blocks)
        finally:
            await self.backend.delete(namespace, keys, self.rank)
            self.blocks_read = self.blocks_written = 0
        return statistics.median(times[1:])

    def _unreachable(self, what: str, keys: list[bytes], exc: Exception) -> None:
        self.failures += len(keys)
        log.warning(
            "shared_tier_unreachable", op=what, blocks=len(keys),
            error=f"{type(exc).__name__}: {exc}",
        )  # fmt: skip
