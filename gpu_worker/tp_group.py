"""Forming a worker's tensor-parallel process group, once per ledger epoch.

The ledger starts a new epoch whenever its workers change (a rank lost or back), so every rank
of a group sees the first step of an epoch and re-forms the group for it before running it: a
group that lost a rank cannot be repaired, only replaced. Rank 0 hosts one `TCPStore` for its
life (on `--tp-port`, or any free port) and publishes `host:port` under the epoch's key in Redis;
the other ranks read it (or take `--tp-host/--tp-port` when the port is given) and connect.

A rendezvous that times out, or a step whose collective failed (a peer died), marks the epoch
failed: its remaining steps are refused at once instead of each waiting out a timeout.

Before the blocking `init_process_group`, every rank announces itself under the epoch in Redis
and waits, without blocking the event loop, until all N have: a rank that waits for a peer that
is dead (the ledger may dispatch an epoch while a killed rank's heartbeat key still lives) gives
the epoch up as soon as the ledger dispatches a newer one, instead of waiting out tp_timeout_s
inside a rendezvous that cannot complete while the group's next epoch queues behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import redis.asyncio as aioredis
import torch

from gpu_worker.parallel import (
    TensorParallel,
    connect_store,
    destroy_group,
    form_group,
    host_store,
)
from observability import get_logger
from services.config import WorkerConfig
from services.transport.redis_streams import FIELD
from services.wire.codec import WireError, decode
from services.wire.messages import StepMessage

log = get_logger("kvledger.worker")
RENDEZVOUS_KEY_TTL_S = 600


class GroupFormer:
    def __init__(
        self, cfg: WorkerConfig, r: aioredis.Redis, tp: TensorParallel, device: torch.device
    ) -> None:
        self.cfg, self.r, self.tp, self.device = cfg, r, tp, device
        self.failed_epoch: str | None = None
        self._store: Any = None  # rank 0's, kept for the process's life

    async def ensure(self, epoch: str) -> str | None:
        """Form the group for `epoch` unless it is formed; None, or why this step cannot run."""
        if self.tp.size == 1 or self.tp.epoch == epoch:
            return None
        if self.failed_epoch == epoch:
            return f"tensor-parallel group of epoch {epoch} is broken (a rank failed)"
        started = time.monotonic()
        try:
            await self._all_arrived(epoch)
            store = await self._store_for(epoch)
            await asyncio.to_thread(
                form_group, self.tp, store, epoch, self.device, self.cfg.tp_timeout_s
            )
        except Exception as exc:  # a rank that never came: this epoch is lost, the next may form
            self.broken(epoch)
            log.error("tp_rendezvous_failed", epoch=epoch, rank=self.tp.rank, error=str(exc))
            return f"tensor-parallel rendezvous for epoch {epoch} failed: {exc}"
        log.info(
            "tp_group_formed",
            epoch=epoch,
            rank=self.tp.rank,
            size=self.tp.size,
            seconds=round(time.monotonic() - started, 3),
        )
        return None

    def broken(self, epoch: str) -> None:
        """A collective failed or never formed: drop the group; the next epoch forms a new one."""
        self.failed_epoch = epoch
        try:
            destroy_group(self.tp)
        except Exception as exc:  # a group whose peer died may fail to tear down; it is gone
            log.warning("tp_group_destroy_failed", error=str(exc))
            self.tp.epoch = None

    async def _all_arrived(self, epoch: str) -> None:
        key = self.cfg.streams.tp_rendezvous(self.cfg.group, epoch) + ":ranks"
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.sadd(key, self.tp.rank)
            pipe.expire(key, RENDEZVOUS_KEY_TTL_S)
            await pipe.execute()
        deadline = time.monotonic() + self.cfg.tp_timeout_s
        while (arrived := await self.r.scard(key)) < self.tp.size:
            newest = await self._newest_epoch()
            if newest not in (None, epoch):
                raise RuntimeError(
                    f"{arrived} of {self.tp.size} ranks arrived before the ledger moved on to "
                    f"epoch {newest}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{arrived} of {self.tp.size} ranks arrived in time")
            await asyncio.sleep(0.05)

    async def _newest_epoch(self) -> str | None:
        """The epoch of the newest step the ledger dispatched to this group."""
        stream = self.cfg.streams.steps(self.cfg.group)
        for _, fields in await self.r.xrevrange(stream, count=1) or []:
            data = (fields or {}).get(FIELD)
            with contextlib.suppress(WireError):  # a shutdown message: no epoch
                return decode(data, StepMessage).epoch if isinstance(data, bytes) else None
        return None

    async def _store_for(self, epoch: str) -> Any:
        cfg, key = self.cfg, self.cfg.streams.tp_rendezvous(self.cfg.group, epoch)
        if self.tp.rank == 0:
            if self._store is None:
                self._store = await asyncio.to_thread(
                    host_store, cfg.tp_host, cfg.tp_port, self.tp.size, cfg.tp_timeout_s
                )
            address = f"{cfg.tp_host}:{self._store.port}"
            await self.r.set(key, address, ex=RENDEZVOUS_KEY_TTL_S)
            return self._store
        if cfg.tp_port:
            host, port = cfg.tp_host, cfg.tp_port
        else:
            host, port = await self._published_address(key)
        return await asyncio.to_thread(connect_store, host, port, self.tp.size, cfg.tp_timeout_s)

    async def _published_address(self, key: str) -> tuple[str, int]:
        deadline = time.monotonic() + self.cfg.tp_timeout_s
        while True:
            raw = await self.r.get(key)
            if raw is not None:
                host, _, port = (raw.decode() if isinstance(raw, bytes) else str(raw)).rpartition(
                    ":"
                )
                return host, int(port)
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 published no address under {key}")
            await asyncio.sleep(0.05)
