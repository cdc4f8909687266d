"""The worker's step loop over a real redis-server: a step computes on the event loop's thread
while the next read and the last reply are in flight, and the heartbeat beats from a thread of its
own, so a step longer than the registration's TTL does not read as a lost worker."""

from __future__ import annotations

import asyncio
import threading
import time

import redis

from gpu_worker.runner import ModelRunner
from services.wire.messages import StepMessage
from tests.engine.test_ledger_service import prompts
from tests.harness.stack import Stack, dense_greedy

SLOW_STEP_S = 3.0  # the stack's workers register with ttl_s=2.0 and beat every 0.3 s


class SlowFirstStep(ModelRunner):
    """The first step that computes anything sleeps past the TTL (a long prefill, a slow GPU)."""

    def run_step(self, step: StepMessage):
        if step.num_scheduled_tokens and not getattr(self, "slept", False):
            self.slept = True
            time.sleep(SLOW_STEP_S)
        return super().run_step(step)


class KeyWatcher(threading.Thread):
    """Polls the worker's registration key from outside the stack's event loop (which the slow
    step blocks): records every poll that found it missing."""

    def __init__(self, url: str, key: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url)
        self.key, self.polls, self.missing = key, 0, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.05):
            self.polls += 1
            self.missing += not self.client.exists(self.key)


async def test_a_step_longer_than_the_ttl_keeps_the_worker_registered(redis_url, tiny_model):
    stack = Stack(redis_url, tiny_model, num_blocks=64)
    stack.runner_factory = SlowFirstStep
    await stack.start()
    worker_id = next(iter(stack.workers))
    watcher = KeyWatcher(redis_url, stack.streams.worker("default", worker_id))
    watcher.start()
    generation = stack.ledger.generation
    try:
        batch = prompts(2, 20, seed=3)
        for i, prompt in enumerate(batch):
            await stack.submit(f"r{i}", prompt, 6)
        started = time.monotonic()
        results = await stack.wait(["r0", "r1"], timeout=60)
        assert time.monotonic() - started >= SLOW_STEP_S  # the slow step did run
        for i, prompt in enumerate(batch):
            assert results[f"r{i}"].tokens == dense_greedy(tiny_model, prompt, 6)
        watcher.done.set()
        watcher.join()
        assert watcher.polls >= SLOW_STEP_S / 0.05 / 2
        assert watcher.missing == 0, (
            f"the key was gone in {watcher.missing} of {watcher.polls} polls"
        )
        # Not taken for lost: no recompute, the same epoch throughout, every block free.
        assert stack.ledger.scheduler.num_preemptions == 0
        assert stack.ledger.generation == generation
        assert stack.ledger.manager.num_free_blocks == 63
    finally:
        watcher.done.set()
        await stack.stop()


async def test_the_worker_runs_a_long_stream_of_steps_in_order(redis_url, tiny_model):
    """Many requests, many steps: every result arrives (in flight while the next step computes)
    and the tokens are exactly the dense model's, with the ledger a step ahead throughout."""
    stack = await Stack(redis_url, tiny_model, num_blocks=128).start()
    try:
        batch = prompts(12, 24, seed=11)
        for i, prompt in enumerate(batch):
            await stack.submit(f"r{i}", prompt, 16)
        results = await stack.wait([f"r{i}" for i in range(12)], timeout=120)
        for i, prompt in enumerate(batch):
            assert results[f"r{i}"].tokens == dense_greedy(tiny_model, prompt, 16), f"r{i}"
        worker = next(iter(stack.workers))
        pending = await stack.r.xpending(stack.streams.steps("default"), f"worker:{worker}")
        assert pending["pending"] == 0  # every step acked
        assert stack.ledger.manager.num_free_blocks == 127
    finally:
        await stack.stop()


async def kill_connections(r, name: str) -> int:
    """CLIENT KILL every connection of the client called `name`; returns how many."""
    killed = 0
    for client in await r.client_list():
        if client.get("name") == name:
            killed += await r.execute_command("CLIENT", "KILL", "ID", client["id"])
    return killed


async def test_cut_connections_lose_no_step_and_no_result(redis_url, tiny_model):
    """The worker's connections cut again and again while steps run (the ledger's stay up, so
    nothing but the worker can notice): a step delivered whose reply the cut dropped is read
    again from this consumer's pending entries, a result that may not have arrived is sent again,
    and a step already run is not run twice. Every request gets the dense model's tokens."""
    stack = await Stack(redis_url, tiny_model, num_blocks=128, step_timeout_s=300).start()
    generation = stack.ledger.generation
    name = f"{stack.prefix}-worker-w0"
    try:
        batch = prompts(8, 24, seed=5)
        for i, prompt in enumerate(batch):
            await stack.submit(f"r{i}", prompt, 24)
        cuts = 0
        for _ in range(25):
            await asyncio.sleep(0.03)
            cuts += await kill_connections(stack.r, name)
        results = await stack.wait([f"r{i}" for i in range(8)], timeout=60)
        assert cuts >= 12
        for i, prompt in enumerate(batch):
            assert results[f"r{i}"].tokens == dense_greedy(tiny_model, prompt, 24), f"r{i}"
        # Recovered by the worker alone: the ledger never started over, nothing was recomputed.
        assert stack.ledger.generation == generation
        assert stack.ledger.scheduler.num_preemptions == 0
        assert stack.ledger.manager.num_free_blocks == 127
    finally:
        await stack.stop()


async def test_a_group_made_anew_hands_out_steps_already_run_and_none_runs_twice(
    redis_url, tiny_model
):
    """The worker's consumer group vanishes mid-run (Redis came back without it): the worker
    makes it again from the stream's start, which hands out every step since then again; those
    it ran are acked and skipped, not run a second time."""
    stack = await Stack(redis_url, tiny_model, num_blocks=128).start()
    try:
        batch = prompts(6, 24, seed=8)
        for i, prompt in enumerate(batch):
            await stack.submit(f"r{i}", prompt, 20)
        steps = stack.streams.steps("default")
        while await stack.r.xlen(steps) < 8:
            await asyncio.sleep(0.01)
        assert await stack.r.xgroup_destroy(steps, "worker:w0") == 1
        results = await stack.wait([f"r{i}" for i in range(6)], timeout=60)
        for i, prompt in enumerate(batch):
            assert results[f"r{i}"].tokens == dense_greedy(tiny_model, prompt, 20), f"r{i}"
        # Each step ran exactly once although the stream's first steps were handed out twice.
        assert stack.worker_services["w0"].steps_done == await stack.r.xlen(steps)
        assert stack.ledger.scheduler.num_preemptions == 0
        assert stack.ledger.manager.num_free_blocks == 127
    finally:
        await stack.stop()
