"""A deposed leader's writes are fenced in Redis: a leader that passed its lease check and was
then paused (SIGSTOP, a long GC) cannot append a step once a successor has drawn a later token,
even though its own clock still says it holds the lease (the race the process-level test in
test_leadership.py hit one run in many); nor write outputs, KV events, the snapshot or the status
key, nor ack a request. Its reader takes no request once its lease is in doubt, and a request it
took anyway (paused between its check and its read) is claimed by the leader within seconds
(issue 22's race, reproduced here deterministically)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from engine import event_stream
from engine.event_stream import KVEventStream
from engine.intake import CLAIM_INTERVAL_S, GROUP, MAX_BLOCK_S, RequestIntake
from engine.leadership import Leadership, LeadershipLost
from engine.outputs import GatewayOutputs
from ledger.block_pool import BlockPool
from ledger.events import BlockStored
from services.transport import redis_streams
from services.transport.keys import StreamNames
from services.wire import codec
from services.wire.messages import GenerateRequest, RequestOutput, SamplingParams

# A claim pass runs every CLAIM_INTERVAL_S, between reads that block up to MAX_BLOCK_S; the
# issue's bound is 5 s.
CLAIM_BOUND_S = 5.0
assert CLAIM_INTERVAL_S + MAX_BLOCK_S < CLAIM_BOUND_S


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


# --- the requests stream: a deposed leader takes no request, and one it took is taken over ---


async def _leaders(r, streams: StreamNames, ttl_s: float) -> tuple[Leadership, Leadership]:
    """The first leader holds the lease (never renewed: as if paused); the second waits."""
    first, second = Leadership(r, streams, ttl_s), Leadership(r, streams, ttl_s)
    assert await first.acquire(asyncio.Event()) == 1
    return first, second


def _request(i: int) -> dict[bytes, bytes]:
    msg = GenerateRequest(
        req_id=f"q{i}", gateway_id="g", prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=4), arrival_time=0.0,
    )  # fmt: skip
    return {redis_streams.FIELD: codec.encode(msg)}


async def _consumers(r, stream: str) -> dict[str, int]:
    """consumer name -> entries pending under it"""
    return {c["name"].decode(): c["pending"] for c in await r.xinfo_consumers(stream, GROUP)}


async def _running(intake: RequestIntake) -> asyncio.Task:
    await intake.reader.ensure_groups("0")
    return asyncio.create_task(intake.read_forever())


async def test_a_leader_whose_lease_is_in_doubt_reads_no_request(redis_url):
    """The issue's race: a leader paused past its lease resumes and, before its engine loop
    finds the lease lost, its reader takes a request off the stream; the entry then waits under
    a consumer nobody reads. A reader whose lease is in doubt must not read at all."""
    r = redis_streams.connect(redis_url)
    streams = StreamNames("fence-read", "r0")
    first, _ = await _leaders(r, streams, ttl_s=0.5)
    intake = RequestIntake(r, streams, first, lambda loop: None)
    reader = await _running(intake)
    try:
        await r.xadd(streams.requests, _request(0))
        await asyncio.wait_for(intake.queue.get(), 5)  # read while the lease was held

        await asyncio.sleep(0.6)  # no renewal: the lease's deadline passes (a pause)
        assert not first.held()
        await r.xadd(streams.requests, _request(1))
        await asyncio.sleep(1.5)
        assert intake.queue.empty(), "a reader whose lease was in doubt took a request"
        assert (await r.xpending(streams.requests, GROUP))["pending"] == 1  # only the first
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await r.aclose()


async def test_a_request_read_by_a_deposed_leader_is_claimed_by_the_leader(redis_url):
    """A leader paused just after its lease check reads once when it resumes: Redis hands it a
    request although a successor leads. The successor takes it over within the claim interval,
    with no leader change, and the deposed ledger cannot ack it away."""
    r = redis_streams.connect(redis_url)
    streams = StreamNames("fence-claim", "r0")
    first, second = await _leaders(r, streams, ttl_s=0.5)
    deposed = RequestIntake(r, streams, first, lambda loop: None)
    await deposed.reader.ensure_groups("0")
    await asyncio.sleep(0.6)
    assert await second.acquire(asyncio.Event()) == 2
    leader = RequestIntake(r, streams, second, lambda loop: None)
    assert leader.reader.consumer != deposed.reader.consumer
    renewal = asyncio.create_task(second.renew_forever())
    reader = await _running(leader)
    try:
        await asyncio.sleep(0.2)  # the leader's reader is blocked on its XREADGROUP
        # The deposed reader's read lands first: appended and read in one transaction, as when
        # its XREADGROUP reaches Redis just as the entry does.
        async with r.pipeline(transaction=True) as pipe:
            pipe.xadd(streams.requests, _request(7))
            pipe.xreadgroup(GROUP, deposed.reader.consumer, {streams.requests: ">"}, count=1)
            added, reply = await pipe.execute()
        [(_, [(read_id, _)])] = redis_streams.normalize_reply(reply)
        assert read_id == added
        pending = await _consumers(r, streams.requests)
        assert pending == {deposed.reader.consumer: 1, leader.reader.consumer: 0}

        with pytest.raises(LeadershipLost):  # the deposed ledger cannot ack it away
            await deposed.ack([redis_streams.Entry(streams.requests, read_id, {})])

        entry = await asyncio.wait_for(leader.queue.get(), CLAIM_BOUND_S)
        assert redis_streams.decode_entry(entry, GenerateRequest).req_id == "q7"
        assert leader.claimed == 1
        # Pending under the leader now, and the deposed consumer is gone from the group.
        assert await _consumers(r, streams.requests) == {leader.reader.consumer: 1}
        await leader.ack([entry])
        assert (await r.xpending(streams.requests, GROUP))["pending"] == 0
    finally:
        for task in (reader, renewal):
            task.cancel()
        await asyncio.gather(reader, renewal, return_exceptions=True)
        await r.aclose()


# --- every other write: outputs, KV events, the snapshot (the background writer too), status ---


async def test_every_write_of_a_deposed_leader_is_fenced(redis_url, monkeypatch):
    r = redis_streams.connect(redis_url)
    streams = StreamNames("fence-writes", "r0")
    first, second = await _leaders(r, streams, ttl_s=30.0)
    events = KVEventStream(
        r, streams, max_bytes=10**7, snapshot_interval_s=3600, block_size=16,
        hash_algo="sha256", writer=first,
    )  # fmt: skip
    outputs = GatewayOutputs(first, streams)
    pool = BlockPool(8, enable_caching=True)
    out = RequestOutput("q", [5], position=0)
    try:
        # While it leads, every write lands.
        await events.publish([_stored(1, 2)], pool, "e1")
        assert events._snapshot_task is not None  # the first publish snapshots at once
        await events._snapshot_task
        await outputs.send("g", out)
        await first.write(("SET", streams.ledger_status, b"status-1", "PX", 60_000))
        written = await _state(r, streams)
        assert written["events"] == 1 and written["outputs"] == 1
        assert written["status"] == b"status-1" and written["snapshot"] is not None

        # A successor takes over while the first is paused; to its own clock it still leads.
        await r.delete(streams.leader)
        assert await second.acquire(asyncio.Event()) == 2
        assert first.held()
        with pytest.raises(LeadershipLost):
            await events.publish([_stored(3)], pool, "e1")
        for size in (30_000, 100):  # a transaction past BULK_BYTES, the script below
            with pytest.raises(LeadershipLost):
                await events.append_many([(b"x" * size, [(0, [4])], None, {})] * 3, "e1")
        with pytest.raises(LeadershipLost):
            await outputs.send("g", out)
        with pytest.raises(LeadershipLost):
            await first.write(("SET", streams.ledger_status, b"stale", "PX", 60_000))
        with pytest.raises(LeadershipLost):
            await first.write(("DEL", streams.ledger_status))
        # The background snapshot writer, started before the pause, writes after its encoding
        # thread returns: fenced too (it logs and stops; the engine loop finds out itself).
        events.counts = {9: 1}
        await events._snapshot_in_background("e1")
        # A snapshot too big for one SET is built under a key of its own and renamed, fenced.
        monkeypatch.setattr(event_stream, "SNAPSHOT_PART_BYTES", 64)
        pool.blocks[1].block_hash = (1).to_bytes(32, "big")
        with pytest.raises(LeadershipLost):
            await events.write_snapshot(pool, "e1")
        assert await _state(r, streams) == written, "a deposed leader wrote"
        building = [k async for k in r.scan_iter(f"{streams.events_snapshot}:writing*")]
        assert len(building) == 1 and 0 < await r.ttl(building[0]) <= event_stream.BUILDING_TTL_S

        # The successor writes: its fence is the highest.
        second_outputs = GatewayOutputs(second, streams)
        await second_outputs.send("g", out)
        assert (await _state(r, streams))["outputs"] == 2
    finally:
        await r.aclose()


class _CounterMovesAfterCheck:
    """A Redis client whose transactions have the token counter written by another client just
    after the fence check read it: the race a bulk write's WATCH must catch."""

    def __init__(self, r, other, token_key: str, value) -> None:
        self.r, self.other, self.token_key, self.value = r, other, token_key, value
        self.moves = 1  # how many checks are followed by a move

    def __getattr__(self, name):
        return getattr(self.r, name)

    def pipeline(self, **kwargs):
        pipe = self.r.pipeline(**kwargs)
        read = pipe.get

        async def get(*args):
            value = await read(*args)
            if self.moves:
                self.moves -= 1
                await self.value(self.other, self.token_key)
            return value

        pipe.get = get
        return pipe


@pytest.mark.parametrize("successor", [True, False], ids=["successor", "own-renewal"])
async def test_a_bulk_write_is_fenced_when_the_counter_moves_after_its_check(redis_url, successor):
    r, other = redis_streams.connect(redis_url), redis_streams.connect(redis_url)
    streams = StreamNames(f"fence-bulk-{successor}", "r0")
    try:
        first = Leadership(r, streams, 30.0)
        assert await first.acquire(asyncio.Event()) == 1

        async def move(client, key) -> None:  # a successor's INCR, or the same value set again
            await (client.incr(key) if successor else client.set(key, 1))

        first.r = cast(Any, _CounterMovesAfterCheck(r, other, streams.leader_token, move))
        ops = [("XADD", streams.events, "*", b"batch", b"x" * 30_000)] * 3  # past BULK_BYTES
        if successor:
            with pytest.raises(LeadershipLost, match="fence 1"):
                await first.write_bulk(*ops)
            assert await r.xlen(streams.events) == 0
        else:  # nothing written by the try the move aborted, all of it by the next
            assert len(await first.write_bulk(*ops)) == 3
            assert await r.xlen(streams.events) == 3
    finally:
        await r.aclose()
        await other.aclose()


def _stored(*hashes: int) -> BlockStored:
    return BlockStored(list(hashes), None, [0] * 16 * len(hashes), 16, None, "GPU", None)


async def _state(r, streams: StreamNames) -> dict[str, object]:
    return {
        "events": await r.xlen(streams.events),
        "outputs": await r.xlen(streams.outputs("g")),
        "status": await r.get(streams.ledger_status),
        "snapshot": await r.get(streams.events_snapshot),
    }
