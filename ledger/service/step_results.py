"""Collecting the workers' results of each step from the results stream.

Only the ledger reads that stream, so it needs no consumer group: a reader task files every
result of the current epoch by step id, and `wait` hands the engine loop one step's tokens once
every worker answered, or None when the step failed (an error, a timeout, a mismatch).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from ledger.core.scheduler import SchedulerOutput
from ledger.service.workers import primary_worker
from observability import get_logger
from services import transport
from services.messages import StepResult, WorkerHello
from services.wire import WireError

log = get_logger("kvledger.ledger")


class StepResults:
    def __init__(
        self,
        r: aioredis.Redis,
        stream: str,
        epoch: Callable[[], str],
        dead_letter: Callable[[transport.Entry, str], Awaitable[None]],
    ) -> None:
        self.r = r
        self.stream = stream
        self.epoch = epoch
        self.dead_letter = dead_letter
        self.results: dict[int, dict[str, StepResult]] = {}
        self.arrived = asyncio.Event()

    async def read_forever(self) -> None:
        last_id: bytes | str = "0-0"
        while True:
            try:
                items = await transport.read_from(
                    self.r, self.stream, last_id, count=64, block_ms=1000
                )
            except aioredis.ConnectionError as exc:
                log.warning("redis_unavailable", loop="results", error=str(exc))
                await asyncio.sleep(1)
                continue
            for entry_id, fields in items:
                last_id = entry_id
                entry = transport.Entry(self.stream, entry_id, fields)
                try:
                    result = transport.decode_entry(entry, StepResult)
                except WireError as exc:
                    await self.dead_letter(entry, str(exc))
                    continue
                if result.epoch == self.epoch():  # older epochs' results mean nothing now
                    self.results.setdefault(result.step_id, {})[result.worker_id] = result
                    self.arrived.set()

    async def wait(
        self,
        out: SchedulerOutput,
        workers: dict[str, WorkerHello],
        timeout_s: float,
        give_up: Callable[[], bool],
    ) -> StepResult | None:
        """This step's result once every worker answered; None if a worker failed,
        vanished or restarted (`give_up`), timed out, or answered what does not fit the step."""
        deadline = time.monotonic() + timeout_s
        step_id = out.step_id
        while not set(workers) <= set(self.results.get(step_id, {})):
            if give_up():
                return None
            if time.monotonic() > deadline:
                missing = sorted(set(workers) - set(self.results.get(step_id, {})))
                log.error("step_timeout", step_id=step_id, waited_s=timeout_s, missing=missing)
                return None
            self.arrived.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):  # not wait_for: it can swallow a cancellation
                    await self.arrived.wait()
        results = self.results.pop(step_id)
        for old in [s for s in self.results if s < step_id]:
            del self.results[old]
        for worker_id, result in sorted(results.items()):
            if result.error is not None:
                log.error("step_failed", step_id=step_id, worker_id=worker_id, error=result.error)
                return None
        primary = results[primary_worker(workers)]
        for worker_id, result in results.items():
            # Every worker keeps what it sampled: one that drew differently now holds other tokens.
            if result.sampled_token_ids != primary.sampled_token_ids:
                log.error(
                    "workers_disagree",
                    step_id=step_id,
                    worker_id=worker_id,
                    primary=primary.worker_id,
                )
                return None
        got = set(primary.sampled_token_ids)
        if got != out.sampling_req_ids:
            log.error(
                "step_result_mismatch", step_id=step_id, worker_id=primary.worker_id,
                missing=sorted(out.sampling_req_ids - got), unexpected=sorted(got - out.sampling_req_ids),
            )  # fmt: skip
            return None
        return primary

    def clear(self) -> None:
        self.results.clear()
