"""The worker's step loop over a real redis-server: a step computes on the event loop's thread
while the next read and the last reply are in flight, and the heartbeat beats from a thread of its
own, so a step longer than the registration's TTL does not read as a lost worker."""

from __future__ import annotations

import threading
import time

import redis

from gpu_worker.runner import ModelRunner
from services.messages import StepMessage
from tests.services.stack import Stack, dense_greedy
from tests.services.test_ledger_service import prompts

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
