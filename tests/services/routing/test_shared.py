"""Gateways that route as one, over a real redis-server: what each gateway sends where reaches
the others' routers (and an indexer's) through the replicas' routing streams, ends when the
request ends, and expires when its gateway dies."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import pytest

from ledger.step_costs import StepCosts
from services.routing.policy import (
    ReplicaLoad,
    ReplicaPrefixIndex,
    Router,
    RouteRequest,
)
from services.routing.shared import EXPIRE_EVERY_S, SHARED_TTL_S, SharedPending
from services.transport import redis_streams
from services.transport.keys import StreamNames
from services.wire import codec
from services.wire.messages import Routed

NAMES = ["r0", "r1"]


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout}s")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


class Gateway:
    """A router and its shared pending table, as `gateway.router.Replicas` wires them."""

    def __init__(self, url: str, prefix: str, gateway_id: str | None, **timing: float) -> None:
        self.r = redis_streams.connect(url)
        self.index = ReplicaPrefixIndex()
        self.router = Router("precise", NAMES, prefix_source=self.index.cached_blocks)
        streams = {name: StreamNames(prefix, name) for name in NAMES}
        self.shared = SharedPending(self.r, streams, self.router.pending, gateway_id, **timing)

    async def __aenter__(self) -> Gateway:
        await self.shared.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shared.stop()
        await self.r.aclose()

    def route(self, req_id: str, hashes: list[int], now: float | None = None) -> str:
        loads = {n: ReplicaLoad(as_of=0.0, costs=StepCosts(10_000.0)) for n in NAMES}
        request = RouteRequest(len(hashes) * 16 + 1, hashes, 16)
        decision = self.router.route(request, loads, request_id=req_id, now=now or time.time())
        self.shared.routed(req_id)
        return decision.replica

    def release(self, req_id: str) -> None:
        entry = self.router.pending.get(req_id)
        assert entry is not None
        self.router.release(req_id)
        self.shared.ended(req_id, entry.replica)


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


async def test_what_one_gateway_sends_the_others_count_until_it_ends(redis_url, prefix):
    async with (
        Gateway(redis_url, prefix, "gw-a") as a,
        Gateway(redis_url, prefix, "gw-b") as b,
        Gateway(redis_url, prefix, None) as indexer,  # reads only
    ):
        hot = list(range(1000, 1040))
        where = a.route("x", hot)
        seen = await until(lambda: b.router.pending.get("x") is not None)
        await until(lambda: indexer.router.pending.get("x") is not None)
        entry = b.router.pending.get("x")
        assert entry is not None and entry.replica == where and entry.owner == "gw-a"
        assert list(entry.block_hashes) == hot and entry.prefill_tokens == 40 * 16 + 1
        assert seen < 1.0
        # b's router follows a's copy: the prefix is held where a sent it (until it ends) and
        # the request is missing from that replica's published load.
        follow = b.router.route(
            RouteRequest(41 * 16, [*hot, 7], 16),
            {n: ReplicaLoad(as_of=0.0, costs=StepCosts(10_000.0)) for n in NAMES},
            request_id="y", now=time.time(),
        )  # fmt: skip
        assert follow.replica == where
        score = follow.score_of(where)
        assert score.cached_blocks == 40 and score.sent_since_status == 1
        a.release("x")
        await until(lambda: b.router.pending.get("x") is None)
        await until(lambda: indexer.router.pending.get("x") is None)
        assert a.router.pending.get("x") is None


async def test_a_dead_gateways_entries_expire_and_a_lost_release_goes_with_the_heartbeat(
    redis_url, prefix
):
    timing = {"ttl_s": 1.0, "heartbeat_s": 0.2}
    async with Gateway(redis_url, prefix, "gw-b", **timing) as b:
        a = Gateway(redis_url, prefix, "gw-a", **timing)
        await a.shared.start()
        a.route("x1", [1, 2, 3])
        a.route("x2", [4, 5, 6])
        await until(lambda: len(b.shared.remote) == 2)
        # A release lost on the way: a forgets x1 without telling; its next heartbeat does.
        a.router.pending.release("x1")
        await until(lambda: b.router.pending.get("x1") is None, timeout=2.0)
        assert b.router.pending.get("x2") is not None
        # a dies (no last word): its entry lasts ttl_s after its last heartbeat, no longer.
        for task in a.shared._tasks:
            task.cancel()
        await asyncio.gather(*a.shared._tasks, return_exceptions=True)
        died = time.monotonic()
        await until(lambda: b.router.pending.get("x2") is None, timeout=3.0)
        assert time.monotonic() - died <= 1.0 + 0.5
        await a.r.aclose()
    # The production limits: a dead gateway's bookings are gone well within 10 s.
    assert SHARED_TTL_S + EXPIRE_EVERY_S <= 6.5


async def test_a_gateway_that_starts_late_finds_every_pending_request(redis_url, prefix):
    timing = {"ttl_s": 1.0, "heartbeat_s": 0.2}
    async with Gateway(redis_url, prefix, "gw-a", **timing) as a:
        a.route("old", [10, 11])
        a.shared._published["old"] -= 10  # written long ago: the next heartbeat writes it again
        await asyncio.sleep(1.5)  # longer than a late reader looks back
        a.route("new", [12, 13])
        async with Gateway(redis_url, prefix, "gw-c", **timing) as c:
            await until(lambda: {"old", "new"} <= set(c.router.pending.ids()))
            entry = c.router.pending.get("old")
            assert entry is not None and list(entry.block_hashes) == [10, 11]
        # A graceful stop says so: nothing of a's lingers in a reader that stays.
        async with Gateway(redis_url, prefix, None, **timing) as reader:
            await until(lambda: len(reader.shared.remote) == 2)
            await a.shared.stop()
            await until(lambda: len(reader.shared.remote) == 0, timeout=1.0)


async def test_the_routing_stream_is_the_replicas_and_holds_wire_messages(redis_url, prefix):
    async with Gateway(redis_url, prefix, "gw-a") as a:
        where = a.route("x", [1, 2])
        stream = StreamNames(prefix, where).routing
        assert stream == f"{prefix}:{{{where}}}:routing"
        entries: list = []
        for _ in range(50):
            entries = await a.r.xrange(stream)
            if entries:
                break
            await asyncio.sleep(0.02)
        msg = codec.decode(entries[0][1][redis_streams.FIELD], Routed)
        assert (msg.gateway_id, msg.req_id, msg.block_hashes) == ("gw-a", "x", [1, 2])
        assert 0 < await a.r.pttl(stream) <= 60_000
