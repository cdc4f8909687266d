"""The shared tier's catalog on a real redis-server: commits, removals and touches in one fenced
script, the size bound evicting the blocks used longest ago (and their Redis values), and a
follower that reads the index once and then the log, reloading after a gap; and the views
routers keep of the catalogs."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from ledger.hashing import to_event_hash
from services.tiers.catalog import CatalogFollower, CatalogWriter, Fenced, catalog_size
from services.tiers.view import SharedTierViews
from services.transport import redis_streams
from services.transport.keys import SharedTierKeys


def k(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\0\0\0\0"


@pytest.fixture
async def r(redis_url):
    client = redis_streams.connect(redis_url)
    yield client
    await client.aclose()


def keys() -> SharedTierKeys:
    return SharedTierKeys(f"t{uuid.uuid4().hex[:8]}", "0123456789abcdef")


async def put_values(r, catalog: SharedTierKeys, blocks: list[bytes], ranks: int = 1) -> None:
    """Each block's Redis values, as a worker's cascade writes them (uncommitted: an expiry)."""
    for block in blocks:
        for rank in range(ranks):
            await r.set(catalog.data(block, rank), b"x", px=60_000)


async def test_commits_are_listed_logged_and_counted_once(r):
    catalog = keys()
    writer = CatalogWriter(r, catalog, "r0", max_bytes=10_000)
    follower = CatalogFollower(r, catalog)
    assert (await follower.poll()).stored == []  # the first poll reads the (empty) index
    assert (await writer.apply(1, 100, commits=[k(1), k(2)])).evicted == []
    assert (await writer.apply(1, 100, commits=[k(2), k(3)])).evicted == []  # k(2) counted once
    assert await catalog_size(r, catalog) == (3, 300)
    change = await follower.poll()
    assert change is not None and not change.reloaded
    assert sorted(change.stored) == [k(1), k(2), k(3)] and change.removed == []
    assert await follower.poll(block_ms=None) is None


async def test_removals_drop_the_listing_and_the_values(r):
    catalog = keys()
    writer = CatalogWriter(r, catalog, "r0", max_bytes=10_000, tp_size=2, redis_values=True)
    await put_values(r, catalog, [k(1), k(2)], ranks=2)
    await writer.apply(1, 100, commits=[k(1), k(2)])
    # The commit keeps the values for good (they were written with an expiry).
    assert await r.pttl(SharedTierKeys(catalog.prefix, catalog.namespace).data(k(1), 1)) == -1
    follower = CatalogFollower(r, catalog)
    await follower.poll()
    await writer.apply(1, 100, removals=[k(1)])
    assert await catalog_size(r, catalog) == (1, 200)  # 2 ranks x 100 bytes a block
    for rank in (0, 1):
        assert not await r.exists(
            SharedTierKeys(catalog.prefix, catalog.namespace).data(k(1), rank)
        )
    change = await follower.poll()
    assert change.removed == [k(1)] and change.stored == []


async def test_past_the_size_bound_the_blocks_used_longest_ago_go(r):
    catalog = keys()
    writer = CatalogWriter(r, catalog, "r0", max_bytes=300, redis_values=True)
    await put_values(r, catalog, [k(i) for i in range(1, 6)])
    await writer.apply(1, 100, commits=[k(1)])
    await asyncio.sleep(0.01)
    await writer.apply(1, 100, commits=[k(2)])
    await asyncio.sleep(0.01)
    await writer.apply(1, 100, commits=[k(3)])
    await asyncio.sleep(0.01)
    await writer.apply(1, 100, touches=[k(1)])  # k(1) used again: k(2) is now the oldest
    await asyncio.sleep(0.01)
    victims = (await writer.apply(1, 100, commits=[k(4), k(5)])).evicted
    assert victims == [k(2), k(3)]
    assert await catalog_size(r, catalog) == (3, 300)
    members = await r.zrange(catalog.index, 0, -1)
    assert sorted(members) == [k(1), k(4), k(5)]


async def test_a_commit_whose_value_is_gone_is_not_listed(r):
    """A cascade that found a value there (SET NX) skips its write; if that value expires or is
    evicted before the commit, listing the block would promise bytes that are not there."""
    catalog = keys()
    writer = CatalogWriter(r, catalog, "r0", max_bytes=10_000, tp_size=2, redis_values=True)
    await put_values(r, catalog, [k(1)], ranks=2)
    await put_values(r, catalog, [k(2)], ranks=1)  # rank 1's value of k(2) is gone
    applied = await writer.apply(1, 100, commits=[k(1), k(2), k(3)])
    assert applied.unlisted == [k(2), k(3)] and applied.evicted == []
    assert await r.zrange(catalog.index, 0, -1) == [k(1)]
    assert await catalog_size(r, catalog) == (1, 200)
    # A directory's files are not Redis values: its commits are listed as they come.
    files = CatalogWriter(r, keys(), "r0", max_bytes=10_000)
    assert (await files.apply(1, 100, commits=[k(4)])).unlisted == []


async def test_a_deposed_leaders_writes_are_refused(r):
    catalog = keys()
    old = CatalogWriter(r, catalog, "r0", max_bytes=10_000)
    await old.apply(3, 100, commits=[k(1)])
    await old.apply(4, 100, commits=[k(2)])  # a successor (token 4) has written
    with pytest.raises(Fenced):
        await old.apply(3, 100, commits=[k(3)])
    assert await r.zscore(catalog.index, k(3)) is None
    # Another replica's tokens are its own.
    await CatalogWriter(r, catalog, "r1", max_bytes=10_000).apply(1, 100, commits=[k(3)])
    assert await r.zscore(catalog.index, k(3)) is not None


async def test_the_catalog_names_who_wrote_each_block_in_its_log_and_after_a_reload(r):
    catalog = keys()
    follower = CatalogFollower(r, catalog)
    await follower.poll()
    await CatalogWriter(r, catalog, "r0", max_bytes=10_000).apply(1, 100, commits=[k(1)])
    await CatalogWriter(r, catalog, "r1", max_bytes=10_000).apply(1, 100, commits=[k(1), k(2)])
    change = await follower.poll()
    assert change.origins == {k(1): "r0", k(2): "r1"}  # the first writer stays
    reloaded = await CatalogFollower(r, catalog).poll()
    assert reloaded.reloaded and reloaded.origins == {k(1): "r0", k(2): "r1"}
    await CatalogWriter(r, catalog, "r1", max_bytes=10_000).apply(1, 100, removals=[k(1)])
    assert await r.hgetall(catalog.origin) == {k(2): b"r1"}


async def test_a_follower_past_a_gap_reads_the_whole_index_again(r):
    catalog = keys()
    writer = CatalogWriter(r, catalog, "r0", max_bytes=10_000)
    follower = CatalogFollower(r, catalog)
    await writer.apply(1, 100, commits=[k(1)])
    assert (await follower.poll()).reloaded  # the first read is the index
    await writer.apply(1, 100, commits=[k(2)])
    await r.xtrim(catalog.log, maxlen=0)  # the log moved on without this follower
    await writer.apply(1, 100, commits=[k(3)], removals=[k(1)])
    change = await follower.poll()
    assert change.reloaded and sorted(change.stored) == [k(2), k(3)]
    assert await follower.poll(block_ms=None) is None


async def test_a_routers_views_follow_the_catalogs_named_and_drop_the_rest(r):
    """SharedTierViews (what routers see of the shared tiers): a namespace's catalog followed
    once named, its blocks by KV-event hash; one no replica names any longer is let go."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    old, new = SharedTierKeys(prefix, "a" * 16), SharedTierKeys(prefix, "b" * 16)
    views = SharedTierViews(r, prefix)
    try:
        views.ensure(old.namespace)
        views.ensure(new.namespace)
        await CatalogWriter(r, new, "r0", max_bytes=10_000).apply(1, 100, commits=[k(7)])
        for _ in range(100):
            if views[new.namespace].contains(to_event_hash(k(7)[:-4])):
                break
            await asyncio.sleep(0.02)
        assert views[new.namespace].contains(to_event_hash(k(7)[:-4]))
        task = views[old.namespace].task
        views.retain({new.namespace})
        assert list(views) == [new.namespace]
        await asyncio.sleep(0)
        assert task is not None and task.cancelled()
    finally:
        await views.stop()
