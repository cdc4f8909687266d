"""The step stream is fenced in Redis: a leader that passed its lease check and was then paused
(SIGSTOP, a long GC) cannot append a step once a successor has drawn a later token, even though
its own clock still says it holds the lease (the race the process-level test in
test_leadership.py hit one run in many)."""

from __future__ import annotations

import asyncio

import pytest

from engine.leadership import Leadership, LeadershipLost
from services.transport import redis_streams
from services.transport.keys import StreamNames


async def test_a_deposed_leader_whose_lease_check_passed_cannot_append_a_step(redis_url):
    r = redis_streams.connect(redis_url)
    try:
        streams = StreamNames("fence", "r0")
        steps = streams.steps("default")
        first, second = Leadership(r, streams, 30.0), Leadership(r, streams, 30.0)
        stopping = asyncio.Event()
        assert await first.acquire(stopping) == 1
        await first.append_fenced(steps, redis_streams.FIELD, b"step-1", maxlen=100)

        # The lease passes to a successor while the first is paused: to its own clock it still
        # holds the lease, so the check before its write passes.
        await r.delete(streams.leader)
        assert await second.acquire(stopping) == 2
        assert first.held()
        await first.ensure()
        with pytest.raises(LeadershipLost, match="fence 1"):
            await first.append_fenced(steps, redis_streams.FIELD, b"stale", maxlen=100)
        assert not first.held()

        await second.append_fenced(steps, redis_streams.FIELD, b"step-2", maxlen=100)
        assert [f[redis_streams.FIELD] for _, f in await r.xrange(steps)] == [b"step-1", b"step-2"]

        # Redis restarted without its data: no token to compare with, the leader goes on (its
        # renewal puts the token counter back, see Leadership.renew).
        await r.flushall()
        await second.append_fenced(steps, redis_streams.FIELD, b"step-3", maxlen=100)
        assert [f[redis_streams.FIELD] for _, f in await r.xrange(steps)] == [b"step-3"]
    finally:
        await r.aclose()
