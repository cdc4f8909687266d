"""The ledger's shell over the shared tier (`ledger.offloading.shared`): it keeps the core's index
of the tier current from the catalog in Redis, and writes the core's changes to it.

A task follows the catalog's log (every replica's writes and evictions) into an inbox; the
engine loop applies the inbox between steps (`apply`) and, while the workers compute, writes
what its workers did (`write`): blocks cascaded, blocks found bad, blocks loaded again. The
writes are fenced twice: only while this ledger holds its lease, and by the catalog's own fence
(a later leader of this replica has written: `Fenced`). The catalog unreachable is never a
failed request: a commit that cannot be written leaves its blocks out of the index (they are
recomputed where they would have been loaded), and the follower reads the index again once
Redis answers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from engine.leadership import Leadership
from ledger.offloading.shared import TieringManager
from observability import get_logger
from services.config import LedgerConfig
from services.tiers.catalog import (
    CatalogChange,
    CatalogFollower,
    CatalogWriter,
    Fenced,
    catalog_size,
    connect_tier,
)
from services.transport import redis_streams
from services.transport.keys import SharedTierKeys
from services.wire.messages import SharedTierStatus

log = get_logger("kvledger.ledger.shared_tier")


class SharedTierShell:
    def __init__(
        self,
        config: LedgerConfig,
        r: aioredis.Redis,
        manager: TieringManager,
        namespace: str,
        fields: Mapping[str, Any],
        leadership: Leadership,
        bytes_per_block: int,
        tp_size: int,
    ) -> None:
        spec = config.kv_shared_tier
        assert spec is not None
        self.spec = spec
        self.owns_connection = bool(spec.redis_url)
        self.r = connect_tier(spec.redis_url) if spec.redis_url else r
        self.manager = manager
        self.namespace = namespace
        self.fields = dict(fields)
        self.leadership = leadership
        self.bytes_per_block = bytes_per_block
        self.max_bytes = config.kv_shared_tier_size
        self.keys = SharedTierKeys(config.stream_prefix, namespace)
        self.writer = CatalogWriter(
            self.r, self.keys, config.replica, config.kv_shared_tier_size, tp_size,
            redis_values=spec.backend == "redis",
        )  # fmt: skip
        self.follower = CatalogFollower(self.r, self.keys)
        self.inbox: list[CatalogChange] = []
        self.task: asyncio.Task[None] | None = None
        self.fenced = False
        self.commit_failures = 0
        self.size = (0, 0)  # (blocks, bytes) the catalog listed at the last look

    def start(self) -> None:
        self.task = asyncio.create_task(self._follow(), name="shared-tier-catalog")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        if self.owns_connection:
            await self.r.aclose()

    async def _follow(self) -> None:
        reconnect = redis_streams.Reconnect("shared-tier catalog")
        while True:
            try:
                change = await self.follower.poll(block_ms=1000)
                reconnect.succeeded()
            except (RedisError, OSError) as exc:
                self.follower.restart()  # what changed meanwhile is read as a whole index
                if redis_streams.is_unavailable(exc):
                    await reconnect.failed(exc)
                else:  # a reply it cannot read: logged, and tried again from a fresh read
                    log.warning(
                        "shared_tier_catalog_unreadable", error=f"{type(exc).__name__}: {exc}"
                    )
                    await asyncio.sleep(1.0)
                continue
            if change is not None:
                self.inbox.append(change)

    def apply(self) -> None:
        """The catalog's changes since the last call, into the core's index."""
        if not self.inbox:
            return
        inbox, self.inbox = self.inbox, []
        for change in inbox:
            if change.reloaded:  # read whole: at start, or once the catalog answers again
                self.manager.index.replace(change.stored, change.origins)
                self.manager.resume()
            else:
                self.manager.apply_catalog(change.stored, change.removed, change.origins)

    async def write(self) -> None:
        """The core's changes to the catalog (fenced); evictions past the size bound back in."""
        changes = self.manager.take_catalog_changes()
        if not changes:
            return
        if self.fenced:  # a later leader writes the catalog: these blocks are not listed
            self.manager.commit_failed(changes.commits)
            return
        if not self.leadership.held():
            self.manager.commit_failed(changes.commits)
            return
        try:
            applied = await self.writer.apply(
                self.leadership.token, self.bytes_per_block,
                changes.commits, changes.removals, changes.touches,
            )  # fmt: skip
        except Fenced as exc:
            if await self._fence_outlived_its_counter():
                await self.writer.lower_fence(self.leadership.token)
                log.warning(
                    "shared_tier_fence_lowered", token=self.leadership.token, reason=str(exc),
                    hint="the replica's token counter restarted (its Redis lost its data)",
                )  # fmt: skip
                self.manager.retry_catalog_changes(changes)
                return
            self.fenced = True
            self.manager.commit_failed(changes.commits)
            log.warning("shared_tier_fenced", reason=str(exc))
            return
        except (RedisError, OSError) as exc:
            self.commit_failures += len(changes.commits)
            self.manager.commit_failed(changes.commits)
            log.warning(
                "shared_tier_catalog_unreachable", blocks=len(changes.commits),
                error=f"{type(exc).__name__}: {exc}",
            )  # fmt: skip
            return
        self.manager.evicted(applied.evicted)
        if applied.unlisted:  # their values were gone by the commit: not in the tier after all
            self.manager.commit_failed(applied.unlisted)

    async def _fence_outlived_its_counter(self) -> bool:
        """Refused by the catalog's fence although no later leader drew a token: the fence was
        written under a token counter that has restarted since."""
        leadership = self.leadership
        try:
            drawn = int(await leadership.r.get(leadership.token_key) or 0)
        except (RedisError, OSError):
            return False
        return leadership.held() and drawn == leadership.token

    async def refresh_size(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            self.size = await catalog_size(self.r, self.keys)

    def status(self) -> SharedTierStatus:
        """For the ledger's status and /health."""
        blocks, size = self.size
        return SharedTierStatus(
            namespace=self.namespace,
            backend=self.spec.backend,
            locality=self.manager.locality or "",
            blocks=blocks,
            bytes=size,
            max_bytes=self.max_bytes,
            indexed_blocks=len(self.manager.index),
            own_server=self.owns_connection,
        )
