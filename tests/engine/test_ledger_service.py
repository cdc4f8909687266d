"""The ledger and worker services over a real redis-server: correctness under preemption and
eviction, abort, bad entries, and a worker lost mid-run."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import msgpack

from ledger.hashing import to_event_hash
from services.events.snapshot import decode_snapshot, snapshot_counts
from services.transport import redis_streams
from services.wire import codec
from services.wire.messages import GenerateRequest, SamplingParams, WorkerShutdown
from tests.harness.stack import Result, Stack, dense_greedy


def prompts(n: int, length: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    common = [rng.randrange(32, 127) for _ in range(shared)]
    return [common + [rng.randrange(32, 127) for _ in range(length - shared)] for _ in range(n)]


async def test_shared_prefix_requests_hit_the_cache_and_match_the_dense_model(
    redis_url, tiny_model
):
    stack = await Stack(redis_url, tiny_model, num_blocks=64).start()
    try:
        batch = prompts(4, 40, seed=1, shared=32)
        await stack.submit("first", batch[0], 8)
        await stack.wait(["first"])
        for i, prompt in enumerate(batch[1:]):
            await stack.submit(f"r{i}", prompt, 8)
        results = await stack.wait([f"r{i}" for i in range(3)])
        assert stack.results["first"].final.num_cached_tokens == 0
        for i, prompt in enumerate(batch[1:]):
            assert results[f"r{i}"].final.num_cached_tokens == 32
            assert results[f"r{i}"].tokens == dense_greedy(tiny_model, prompt, 8)
    finally:
        await stack.stop()


async def test_preemption_and_eviction_keep_greedy_tokens_exact_and_free_every_block(
    redis_url, tiny_model
):
    # 23 lendable blocks of 16; each request needs up to 7: at most 3 fit at once.
    stack = await Stack(
        redis_url, tiny_model, num_blocks=24, max_model_len=112, max_num_batched_tokens=256
    ).start()
    try:
        batch = prompts(8, 60, seed=2, shared=16)
        for i, prompt in enumerate(batch):
            await stack.submit(f"r{i}", prompt, 40)
        results = await stack.wait([f"r{i}" for i in range(8)], timeout=120)
        for i, prompt in enumerate(batch):
            assert results[f"r{i}"].final.finish_reason == "length"
            assert results[f"r{i}"].tokens == dense_greedy(tiny_model, prompt, 40), f"r{i}"
        ledger = stack.ledger
        assert ledger.scheduler.num_preemptions > 0
        assert (
            sum(r.final.num_preemptions for r in results.values())
            == ledger.scheduler.num_preemptions
        )
        assert ledger.metrics.snapshot().evicted_blocks > 0
        assert ledger.manager.num_free_blocks == 23 and ledger.manager.usage == 0.0
        assert not ledger.manager.req_to_blocks
    finally:
        await stack.stop()


async def test_abort_frees_the_request_and_reports_it(redis_url, tiny_model):
    stack = await Stack(redis_url, tiny_model, num_blocks=64).start()
    try:
        await stack.submit("long", prompts(1, 30, seed=3)[0], 200)
        while len(stack.results["long"].tokens) < 3:
            await asyncio.sleep(0.02)
        await stack.abort("long")
        result = (await stack.wait(["long"]))["long"]
        assert result.final.finish_reason == "abort"
        assert 3 <= len(result.tokens) < 200
        assert stack.ledger.manager.num_free_blocks == 63
    finally:
        await stack.stop()


async def test_malformed_and_invalid_entries_are_dead_lettered_and_serving_goes_on(
    redis_url, tiny_model
):
    stack = await Stack(redis_url, tiny_model, num_blocks=64).start()
    try:
        r, streams = stack.r, stack.streams
        await r.xadd(streams.requests, {b"m": b"\xc1 not msgpack"})
        await r.xadd(streams.requests, {b"other": b"field"})
        await redis_streams.append(r, streams.requests, WorkerShutdown(reason="misrouted"))
        missing = msgpack.packb({"v": 1, "kind": "generate", "req_id": "x"})
        await r.xadd(streams.requests, {b"m": missing})
        await r.xadd(streams.results, {b"m": b"garbage"})
        await r.xadd(streams.steps("default"), {b"m": msgpack.packb([1, 2, 3])})
        # A well-formed request whose content is wrong gets an error output, not a crash.
        await redis_streams.append(
            r,
            streams.requests,
            GenerateRequest(
                req_id="bad-token",
                gateway_id="test-gateway",
                prompt_token_ids=[5, 99999],
                sampling=SamplingParams(max_tokens=4),
                arrival_time=0.0,
            ),
        )
        stack.results["bad-token"] = Result()
        prompt = prompts(1, 20, seed=4)[0]
        await stack.submit("good", prompt, 6)
        results = await stack.wait(["good", "bad-token"])
        assert results["good"].tokens == dense_greedy(tiny_model, prompt, 6)
        bad = results["bad-token"].final
        assert bad.finish_reason == "error" and "outside the vocabulary" in bad.error
        dead = await r.xrange(streams.dead_letters)
        errors = sorted(fields[b"error"].decode() for _, fields in dead)
        assert len(dead) == 6
        assert any("not msgpack" in e for e in errors)
        assert any("field 'm': missing" in e for e in errors)
        assert any("'worker_shutdown' does not belong on the requests stream" in e for e in errors)
        assert any("field 'gateway_id': missing" in e for e in errors)
        assert (
            sum(1 for _, f in dead if f[b"source_stream"] == streams.steps("default").encode()) == 1
        )
        # Nothing is left pending: every entry was acked.
        assert await settled_pending(stack) == 0
    finally:
        await stack.stop()


async def test_a_worker_lost_mid_run_preempts_its_requests_which_then_complete(
    redis_url, tiny_model
):
    stack = await Stack(redis_url, tiny_model, num_blocks=64).start()
    try:
        batch = prompts(3, 24, seed=5)
        for i, prompt in enumerate(batch):
            await stack.submit(f"r{i}", prompt, 60)
        while min(len(stack.results[f"r{i}"].tokens) for i in range(3)) < 5:
            await asyncio.sleep(0.02)
        epoch_before = stack.ledger.epoch
        measured_before = stack.ledger.step_costs.steps
        steps_before = stack.ledger.scheduler.step_id
        await stack.kill_worker("w0")
        await asyncio.sleep(0.5)
        await stack.start_worker("w0")
        results = await stack.wait([f"r{i}" for i in range(3)], timeout=120)
        # The routers' step costs describe the new worker alone, from after its warm-up steps.
        assert measured_before >= 5
        steps_since = stack.ledger.scheduler.step_id - steps_before
        assert 0 < stack.ledger.step_costs.steps <= steps_since - stack.ledger.depth
        for i, prompt in enumerate(batch):
            assert results[f"r{i}"].tokens == dense_greedy(tiny_model, prompt, 60)
            assert results[f"r{i}"].final.num_preemptions >= 1
        assert stack.ledger.epoch != epoch_before
        # The cache was cleared for subscribers too: an AllBlocksCleared after the first one.
        batches = [
            msgpack.unpackb(f[b"batch"]) for _, f in await stack.r.xrange(stack.streams.events)
        ]
        cleared = [b for b in batches if any(e.get("type") == "AllBlocksCleared" for e in b[1])]
        assert len(cleared) >= 2
    finally:
        await stack.stop()


async def test_snapshot_lists_exactly_the_cached_blocks(redis_url, tiny_model):
    stack = await Stack(redis_url, tiny_model, num_blocks=64).start()
    try:
        for i, prompt in enumerate(prompts(3, 50, seed=6)):
            await stack.submit(f"r{i}", prompt, 4)
        await stack.wait([f"r{i}" for i in range(3)])
        cached = Counter(
            to_event_hash(b.block_hash)
            for b in stack.ledger.manager.block_pool.blocks
            if b.block_hash
        )
        # The mirror the periodic snapshots pack is built from the published events alone.
        assert stack.ledger.events.counts == cached and len(cached) == 9
        await stack.ledger._write_snapshot()
        snapshot = decode_snapshot(await stack.r.get(stack.streams.events_snapshot))
        assert snapshot.version == 2 and snapshot_counts(snapshot) == cached
        assert codec.WIRE_VERSION == 1
    finally:
        await stack.stop()


async def test_a_finished_requests_last_block_is_published_before_the_next_request(
    redis_url, tiny_model
):
    # Async scheduling (the default) caches the block a request's last tokens fill when those
    # tokens come back; the ledger, idle afterwards, must publish it then, not with the next
    # request's first step. 14 prompt tokens + 3 outputs: the first block is full, its last slot computed.
    stack = await Stack(redis_url, tiny_model, num_blocks=64).start()
    try:
        assert stack.ledger_cfg.async_scheduling
        prompt = prompts(1, 14, seed=8)[0]
        await stack.submit("a", prompt, 3)
        (result,) = (await stack.wait(["a"])).values()
        block = prompt + result.tokens[:2]
        stored: list[list[int]] = []
        for _ in range(100):
            batches = [
                msgpack.unpackb(f[b"batch"]) for _, f in await stack.r.xrange(stack.streams.events)
            ]
            stored = [e["token_ids"] for b in batches for e in b[1] if e["type"] == "BlockStored"]
            if block in stored:
                break
            await asyncio.sleep(0.05)
        assert stored == [block]
        await stack.submit("b", block + [40], 1)
        assert (await stack.wait(["b"]))["b"].final.num_cached_tokens == 16
    finally:
        await stack.stop()


async def test_requests_left_pending_by_another_ledger_are_claimed_and_served(
    redis_url, tiny_model
):
    stack = Stack(redis_url, tiny_model, num_blocks=64)
    prompt = prompts(1, 20, seed=40)[0]
    # A previous ledger (another consumer name) read this request and died before finishing it.
    await stack.r.xgroup_create(stack.streams.requests, "ledger", id="0", mkstream=True)
    await stack.submit("orphan", prompt, 5)
    await stack.r.xreadgroup("ledger", "old-ledger-host", {stack.streams.requests: ">"}, count=10)
    assert (await stack.r.xpending(stack.streams.requests, "ledger"))["pending"] == 1
    await stack.start()
    try:
        result = (await stack.wait(["orphan"]))["orphan"]
        assert result.tokens == dense_greedy(tiny_model, prompt, 5)
        assert await settled_pending(stack) == 0
    finally:
        await stack.stop()


async def test_a_restarted_ledger_reruns_its_unfinished_requests_to_the_same_tokens(
    redis_url, tiny_model
):
    stack = await Stack(redis_url, tiny_model, num_blocks=64).start()
    try:
        batch = prompts(3, 24, seed=50)
        for i, prompt in enumerate(batch):
            await stack.submit(f"r{i}", prompt, 40)
        while min(len(stack.results[f"r{i}"].tokens) for i in range(3)) < 5:
            await asyncio.sleep(0.02)
        epoch_before = stack.ledger.epoch
        await stack.restart_ledger()
        results = await stack.wait([f"r{i}" for i in range(3)], timeout=120)
        assert stack.ledger.epoch.split(".")[0] != epoch_before.split(".")[0]
        for i, prompt in enumerate(batch):
            # Re-run from scratch: the repeats are dropped by position, nothing is lost or doubled.
            assert results[f"r{i}"].tokens == dense_greedy(tiny_model, prompt, 40)
        assert await settled_pending(stack) == 0
    finally:
        await stack.stop()


async def settled_pending(stack: Stack, timeout_s: float = 10.0) -> int:
    """Entries left pending on the requests stream once the ledger's acks have landed. The
    ledger acks a request after appending its final output, so a client may read that output
    a moment before the ack: poll (bounded) instead of reading the count once."""
    deadline = time.monotonic() + timeout_s
    while True:
        pending = (await stack.r.xpending(stack.streams.requests, "ledger"))["pending"]
        if pending == 0 or time.monotonic() > deadline:
            return pending
        await asyncio.sleep(0.05)


async def test_two_workers_in_a_group_run_the_same_steps_and_agree(redis_url, tiny_model):
    stack = Stack(redis_url, tiny_model, num_blocks=48, num_workers=2)
    await stack.start(num_workers=2)
    try:
        batch = prompts(4, 30, seed=60)
        for i, prompt in enumerate(batch):
            # Sampled, not greedy: the ledger's per-request seeds make both workers draw alike.
            await stack.submit(f"r{i}", prompt, 12, temperature=0.9, top_p=0.95)
        results = await stack.wait([f"r{i}" for i in range(4)])
        assert all(len(r.tokens) == 12 for r in results.values())
        assert sorted(stack.ledger.workers) == ["w0", "w1"]
        assert stack.ledger.attention_backends() == {
            "w0": "torch-reference",
            "w1": "torch-reference",
        }
        assert stack.ledger.epoch.endswith(".1")  # no step failed, no resync was needed
    finally:
        await stack.stop()


async def test_requests_fail_with_an_error_when_no_worker_is_left_and_serve_again_after(
    redis_url, tiny_model
):
    stack = await Stack(redis_url, tiny_model, num_blocks=64, no_worker_timeout_s=1.0).start()
    try:
        batch = prompts(2, 24, seed=7)
        for i, prompt in enumerate(batch):
            await stack.submit(f"r{i}", prompt, 200)
        while min(len(stack.results[f"r{i}"].tokens) for i in range(2)) < 3:
            await asyncio.sleep(0.02)
        await stack.kill_worker("w0")  # gone for good: nothing restarts it
        results = await stack.wait(["r0", "r1"], timeout=30)
        await stack.submit("late", batch[0], 8)  # sent while no worker is left
        results.update(await stack.wait(["late"], timeout=30))
        for result in results.values():
            assert result.final.finish_reason == "error"
            assert "no worker of group 'default'" in result.final.error
            assert "--no-worker-timeout-s 1" in result.final.error
        for i, prompt in enumerate(batch):  # the tokens sent before the loss were right
            tokens = results[f"r{i}"].tokens
            assert 3 <= len(tokens) < 200
            assert tokens == dense_greedy(tiny_model, prompt, len(tokens))
        assert not stack.ledger.scheduler.requests
        assert stack.ledger.manager.num_free_blocks == 63
        await stack.start_worker("w1")
        # Until the ledger sees the new worker, requests still fail fast: wait for it.
        deadline = time.monotonic() + 30
        while not stack.ledger.workers:
            assert time.monotonic() < deadline, "the ledger never saw the new worker"
            await asyncio.sleep(0.05)
        await stack.submit("after", batch[1], 8)
        again = await stack.wait(["after"], timeout=60)
        assert again["after"].final.finish_reason == "length"
        assert again["after"].tokens == dense_greedy(tiny_model, batch[1], 8)
    finally:
        await stack.stop()
