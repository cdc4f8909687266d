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
from redis.exceptions import RedisError

from engine.workers import primary_worker
from ledger.scheduler import SchedulerOutput
from observability import get_logger
from services.transport import redis_streams
from services.wire.codec import WireError
from services.wire.messages import StepResult, WorkerHello

log = get_logger("kvledger.ledger")


class StepResults:
    def __init__(
        self,
        r: aioredis.Redis,
        stream: str,
        epoch: Callable[[], str],
        dead_letter: Callable[[redis_streams.Entry, str], Awaitable[None]],
        on_outage: Callable[[str], None] | None = None,
        leader_token: Callable[[], int] = lambda: 0,
    ) -> None:
        self.r = r
        self.stream = stream
        self.epoch = epoch
        self.dead_letter = dead_letter
        self.leader_token = leader_token
        self.on_outage = on_outage
        self.results: dict[int, dict[str, StepResult]] = {}
        # The error a worker reported for the last failed step (None after a timeout or a lost
        # worker: not a request's fault), read once by the engine loop.
        self.failure: StepResult | None = None
        self.arrived = asyncio.Event()

    async def read_forever(self) -> None:
        last_id: bytes | str = "0-0"
        reconnect = redis_streams.Reconnect("results", self.on_outage)
        while True:
            try:
                items = await redis_streams.read_from(
                    self.r, self.stream, last_id, count=64, block_ms=1000
                )
            except (RedisError, OSError) as exc:
                await reconnect.failed(exc)
                continue
            reconnect.succeeded()
            for entry_id, fields in items:
                last_id = entry_id
                entry = redis_streams.Entry(self.stream, entry_id, fields)
                try:
                    result = redis_streams.decode_entry(entry, StepResult)
                except WireError as exc:
                    await self.dead_letter(entry, str(exc))
                    continue
                # Older epochs' results mean nothing now; another leader's token means a step
                # this ledger did not send.
                if result.epoch == self.epoch() and result.leader_token == self.leader_token():
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
                self.failure = result
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
        sent = out.kv_transfers
        jobs = set(sent.load_jobs) | set(sent.store_jobs) if sent is not None else set()
        for worker_id, result in results.items():
            # Every worker ran every copy of the step on its share (one that did not, an older
            # worker, would leave the tier waiting for a copy that never comes).
            if set(result.transfers_done or ()) != jobs:
                log.error(
                    "step_transfers_mismatch", step_id=step_id, worker_id=worker_id,
                    sent=sorted(jobs), done=sorted(result.transfers_done or ()),
                )  # fmt: skip
                return None
        if sent is not None and sent.shared:
            shared = sent.shared
            wanted = {job.job_id for job in (*shared.promotions, *shared.cascades)}
            failed: dict[int, set[int]] = {job_id: set() for job_id in wanted}
            unreachable: set[int] = set()
            for worker_id, result in results.items():
                reported = result.shared_failed or {}
                if set(reported) != wanted:
                    log.error(
                        "step_shared_mismatch", step_id=step_id, worker_id=worker_id,
                        sent=sorted(wanted), done=sorted(reported),
                    )  # fmt: skip
                    return None
                for job_id, indices in reported.items():
                    failed[job_id].update(indices)  # a key is there only if every rank wrote it
                unreachable.update(result.shared_unreachable or ())
            primary.shared_failed = {job_id: sorted(bad) for job_id, bad in failed.items()}
            primary.shared_unreachable = sorted(unreachable & wanted) or None
            # The step waited for the slowest worker's copies.
            timed = [r.shared_seconds for r in results.values() if r.shared_seconds]
            if timed:
                primary.shared_seconds = [max(t[0] for t in timed), max(t[1] for t in timed)]
        got = set(primary.sampled_token_ids)
        if got != out.sampling_req_ids:
            log.error(
                "step_result_mismatch", step_id=step_id, worker_id=primary.worker_id,
                missing=sorted(out.sampling_req_ids - got), unexpected=sorted(got - out.sampling_req_ids),
            )  # fmt: skip
            return None
        return primary

    def take_failure(self) -> StepResult | None:
        failure, self.failure = self.failure, None
        return failure

    def clear(self) -> None:
        self.results.clear()
