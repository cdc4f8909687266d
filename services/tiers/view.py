"""What routers see of the shared tiers: a follower of each namespace's catalog, started when a
replica's status first names it, answering whether a block (by its KV-event hash) is there.

The catalog's keys are offload keys (the block hash's bytes, then a 4-byte group index); a
router's block hashes are KV-event hashes, the digest's last 8 bytes. A catalog on a server of
its own (`--kv-shared-tier redis:URL`) is not followed: its address is not published, and the
router scores such a replica as if it had no shared tier.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ledger.hashing import to_event_hash
from ledger.offloading.base import offload_key_block_hash
from services.tiers.catalog import CatalogFollower
from services.transport.keys import SharedTierKeys

RETRY_S = 1.0


def event_hash_of(key: bytes) -> int:
    """A catalog key's block as KV events name it."""
    return to_event_hash(offload_key_block_hash(key))


class SharedTierView:
    """One namespace's catalog, followed: `contains(event_hash)`."""

    def __init__(self, r: aioredis.Redis, keys: SharedTierKeys) -> None:
        self.follower = CatalogFollower(r, keys)
        self.blocks: set[int] = set()
        self.errors = 0
        self.task: asyncio.Task[None] | None = None

    def contains(self, event_hash: int) -> bool:
        return event_hash in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    async def follow(self) -> None:
        while True:
            try:
                change = await self.follower.poll(block_ms=1000)
            except (RedisError, OSError):
                self.errors += 1
                self.follower.restart()
                await asyncio.sleep(RETRY_S)
                continue
            if change is None:
                continue
            if change.reloaded:
                self.blocks = {event_hash_of(key) for key in change.stored}
            else:
                self.blocks.update(event_hash_of(key) for key in change.stored)
                self.blocks.difference_update(event_hash_of(key) for key in change.removed)


class SharedTierViews(Mapping[str, SharedTierView]):
    """The shared tiers a router sees into, by namespace (the Mapping routers are given)."""

    def __init__(self, r: aioredis.Redis, prefix: str) -> None:
        self.r = r
        self.prefix = prefix
        self.views: dict[str, SharedTierView] = {}

    def ensure(self, namespace: str) -> None:
        """Follow `namespace`'s catalog from now on (once; needs a running loop)."""
        if namespace in self.views:
            return
        view = self.views[namespace] = SharedTierView(
            self.r, SharedTierKeys(self.prefix, namespace)
        )
        view.task = asyncio.get_running_loop().create_task(
            view.follow(), name=f"shared-tier-{namespace}"
        )

    def retain(self, namespaces: set[str]) -> None:
        """Stop following the catalogs no replica names any longer (a model changed: its old
        namespace's blocks can never be loaded by these replicas again)."""
        for namespace in [n for n in self.views if n not in namespaces]:
            view = self.views.pop(namespace)
            if view.task is not None:
                view.task.cancel()

    async def stop(self) -> None:
        tasks = [view.task for view in self.views.values() if view.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def __getitem__(self, namespace: str) -> SharedTierView:
        return self.views[namespace]

    def __iter__(self) -> Iterator[str]:
        return iter(self.views)

    def __len__(self) -> int:
        return len(self.views)
