"""The worker service: registers its capacity, then executes every step the ledger appends.

A step computes on the event loop's own thread: the read of the next step and the reply to the
last are already written to Redis when it starts, so their round trips pass while it computes,
and no compute thread contends with the loop for the GIL. The heartbeat beats from a thread of its
own (`registry.Heartbeat`), so a long step still does not read as a lost worker; the ledger takes
a vanished heartbeat (or a new `started_at`) as a lost worker and recomputes its requests.
Each worker reads the group's step stream through a consumer group of its own (fan-out), made
afresh at start-up: a restarted worker must not replay steps that refer to state it lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import redis.asyncio as aioredis
import torch

from gpu_worker.devices import resolve_device
from gpu_worker.kv_identity import kv_identity
from gpu_worker.offload import measure_load_cost
from gpu_worker.parallel import TensorParallel, TensorParallelError
from gpu_worker.profile import ProfileSettings
from gpu_worker.request_spans import RequestSpans
from gpu_worker.runner import ModelRunner, RequestsFailed, RunnerConfig, StepError, StepOutput
from gpu_worker.shared_tier import (
    SWEEP_INTERVAL_S,
    DirectoryBackend,
    WorkerSharedTier,
    make_backend,
    shared_reports,
    sweep_orphans,
)
from gpu_worker.threads import configure_cpu_threads
from gpu_worker.tp_group import GroupFormer
from kernels import BackendError
from observability import get_logger, tracer_if_on
from services.config import WorkerConfig
from services.startup import StartupError, freeze_after_startup
from services.transport import redis_streams, registry
from services.transport.keys import RESULTS_MAXLEN, SharedTierKeys
from services.wire.codec import WireError, encode, kind_of
from services.wire.messages import (
    TIER_CPU,
    TIER_SHARED,
    StepMessage,
    StepResult,
    WorkerHello,
    WorkerShutdown,
)

log = get_logger("kvledger.worker")
T = TypeVar("T")


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerService:
    def __init__(
        self,
        config: WorkerConfig,
        r: aioredis.Redis,
        runner: ModelRunner,
        tracer=None,
        *,
        detailed_traces: bool = False,
    ) -> None:
        if not config.redis_url:
            raise ValueError(
                "WorkerConfig.redis_url is required: the heartbeat has a connection of its own"
            )
        self.cfg = config
        self.redis_url = config.redis_url
        self.r = r
        self.runner = runner
        self.tracer = tracer
        self.worker_id = config.worker_id or default_worker_id()
        self.steps_stream = config.streams.steps(config.group)
        self.reader = redis_streams.GroupReader(
            r, [self.steps_stream], f"worker:{self.worker_id}", self.worker_id
        )
        profile = runner.profile
        # Exactly what the allocated cache tensors cost per block, K and V over every layer.
        bytes_per_block = sum(k[0].nbytes + v[0].nbytes for k, v in runner.kv_caches)
        model = runner.config
        identity = kv_identity(
            config.model, config.seed, runner.kv_caches[0][0].dtype, model.num_hidden_layers,
            model.num_key_value_heads, model.head_dim, runner.model.tp.size,
        )  # fmt: skip
        # What a load from the CPU tier costs here, for routers to weigh against a prefill.
        self.tier_costs: tuple[float, float] | None = None
        if config.offloading is not None:
            try:
                self.tier_costs = measure_load_cost(runner.kv_caches)
            except (RuntimeError, MemoryError) as exc:  # routers then borrow another's figure
                log.warning("cpu_tier_load_cost_unmeasured", error=str(exc))
        self.hello = WorkerHello(
            worker_id=self.worker_id,
            group=config.group,
            num_gpu_blocks=runner.num_blocks,
            block_size=runner.block_size,
            bytes_per_block=bytes_per_block,
            available_kv_bytes=profile.available_kv_bytes
            if profile
            else bytes_per_block * runner.num_blocks,
            model_name=runner.name,
            max_model_len=config.max_model_len,
            vocab_size=runner.config.vocab_size,
            device=str(runner.device),
            started_at=time.time(),
            attention_backend=runner.backend.name,
            detail=profile.describe() if profile else "",
            tp_rank=runner.model.tp.rank,
            tp_size=runner.model.tp.size,
            kv_identity=json.dumps(identity, sort_keys=True),
            load_s_per_block={TIER_CPU: self.tier_costs[0]} if self.tier_costs else None,
        )
        # The shared tier's copies (--kv-shared-tier), run after each step's forward pass.
        self.shared: WorkerSharedTier | None = None
        if config.kv_shared_tier is not None:
            self.shared = WorkerSharedTier(
                make_backend(config.kv_shared_tier, r, config.stream_prefix),
                runner.model.tp.rank,
                runner.model.tp.size,
            )
        self.steps_done = 0
        self.last_run: tuple[str, int] = ("", -1)  # (epoch, step_id) of the last step run
        # Results run but not known to have reached Redis (at most the last two): sent again
        # after a reconnect, in order.
        self.unconfirmed: list[tuple[redis_streams.Entry, StepResult]] = []
        self.leader_token = 0  # the highest ledger fencing token seen on a step
        self.tp_group = GroupFormer(config, r, runner.model.tp, runner.device)
        # Rank 0 shows the requests' work; every rank keeps its own step spans.
        self.spans: RequestSpans | None = None
        self._untraced: tuple[StepMessage, int, int, str | None] | None = None
        if tracer is not None:
            self.spans = RequestSpans(
                tracer, self.worker_id, self.steps_stream,
                requests=runner.model.tp.rank == 0, detailed=detailed_traces,
            )  # fmt: skip

    async def run(self) -> None:
        if self.shared is not None:
            await self._measure_shared_tier()
        # The worker may start before its Redis (or while it restarts): wait for it with the
        # loops' backoff, logging the outage once, instead of crashing.
        await redis_streams.Reconnect("startup").call(self._join)
        log.info(
            "worker_registered",
            gc_frozen=freeze_after_startup(),
            worker_id=self.worker_id,
            num_gpu_blocks=self.hello.num_gpu_blocks,
            device=self.hello.device,
            model=self.hello.model_name,
            profile=self.hello.detail,
            **self._tier_cost_fields(),
        )
        heartbeat = registry.Heartbeat(
            self.redis_url, self.cfg.streams, self.hello, self.cfg.ttl_s, self.cfg.heartbeat_s
        )
        heartbeat.start()
        sweeper = None
        if self.shared is not None and isinstance(self.shared.backend, DirectoryBackend):
            sweeper = asyncio.create_task(self._sweep(self.shared), name="shared-tier-sweeper")
        try:
            await self._loop()
        finally:
            if sweeper is not None:
                sweeper.cancel()
            if self.spans is not None:
                self._trace_last_step()
                self.spans.close_all("shutdown")
            await asyncio.to_thread(heartbeat.stop)
            with contextlib.suppress(aioredis.RedisError):
                await registry.unregister(self.r, self.cfg.streams, self.hello)

    def _tier_cost_fields(self) -> dict[str, float]:
        if self.tier_costs is None:
            return {}
        load, store = self.tier_costs
        return {
            "cpu_tier_load_s_per_block": round(load, 7),
            "cpu_tier_store_s_per_block": round(store, 7),
        }

    async def _sweep(self, shared: WorkerSharedTier, interval_s: float = SWEEP_INTERVAL_S) -> None:
        """A directory's files no catalog lists, deleted by one worker of the fleet an interval
        (a lease in the catalog's hash slot); never the step's business, never fatal."""
        backend = shared.backend
        assert isinstance(backend, DirectoryBackend)
        while True:
            await asyncio.sleep(interval_s)
            if not shared.namespace:
                continue  # no step has named the ledger's namespace yet
            keys = SharedTierKeys(self.cfg.stream_prefix, shared.namespace)
            try:
                lease = int(interval_s * 1000)
                if await self.r.set(keys.sweeper, self.worker_id, nx=True, px=lease):
                    removed = await sweep_orphans(self.r, keys, backend.root)
                    log.info("shared_tier_swept", namespace=shared.namespace, removed=removed)
            except Exception as exc:
                log.warning("shared_tier_sweep_failed", error=f"{type(exc).__name__}: {exc}")

    async def _measure_shared_tier(self) -> None:
        """What a load from the shared tier costs here, for routers: a promotion (store -> host
        buffer) measured through the backend, then the CPU tier's load on top. A store that
        cannot be measured now (unreachable) leaves the figure to the fleet's."""
        assert self.shared is not None
        try:
            promotion = await self.shared.measure_promotion(self.runner.kv_caches, self.worker_id)
        except Exception as exc:
            log.warning("shared_tier_load_cost_unmeasured", error=f"{type(exc).__name__}: {exc}")
            return
        cpu = self.tier_costs[0] if self.tier_costs else 0.0
        loads = dict(self.hello.load_s_per_block or {})
        loads[TIER_SHARED] = promotion + cpu
        self.hello.load_s_per_block = loads
        log.info("shared_tier_load_cost", promotion_s_per_block=promotion, load_s_per_block=loads)

    async def _join(self) -> None:
        with contextlib.suppress(aioredis.ResponseError):
            await self.r.xgroup_destroy(self.steps_stream, self.reader.group)
        await self.reader.ensure_groups("$")
        # Fencing survives a worker restart: steps of leaders older than the current one stay dropped.
        self.leader_token = int(await self.r.get(self.cfg.streams.leader_token) or 0)
        await registry.register(self.r, self.cfg.streams, self.hello, self.cfg.ttl_s)

    async def _loop(self) -> None:
        reconnect = redis_streams.Reconnect("worker")
        while True:
            try:
                for entry, result in list(self.unconfirmed):
                    # It may not have arrived: sent again (the ledger files results by step and
                    # worker, so a second copy changes nothing).
                    await self._reply(entry, result)
                await self._steps()
                return
            except (aioredis.RedisError, OSError) as exc:
                if redis_streams.is_nogroup(exc):
                    # Redis came back without the group: made again from the stream's start,
                    # it hands out the steps already run again (each is only acked).
                    await self.reader.ensure_groups("0")
                    continue
                await reconnect.failed(exc)
                await reconnect.until_up(self.r)
                # A step delivered on the broken connection whose reply never came is pending
                # for this consumer: read those again first.
                self.reader.reread_pending()

    async def _steps(self) -> None:
        entries: list[redis_streams.Entry] = []
        # While a step computes, the read of the next one and the reply to the last are already
        # written to Redis: their answers wait in the socket, and with the ledger a step ahead
        # the next step is here when this one ends (no round trip between two steps).
        ahead: asyncio.Task[list[redis_streams.Entry]] | None = None
        reply: asyncio.Task[None] | None = None
        try:
            while True:
                if not entries:
                    entries = await (ahead or self.reader.read(count=4, block_ms=1000))
                    if not entries and ahead is None and self.spans is not None:
                        self.spans.idle()  # a second without a step
                    ahead = None
                    continue
                entry = entries.pop(0)
                msg = await self._admit(entry)
                if msg is None:
                    continue
                if isinstance(msg, WorkerShutdown):
                    log.info("worker_shutdown", reason=msg.reason)
                    if reply is not None:
                        await reply  # the last result reaches the ledger before this worker goes
                    await self.reader.ack([entry])
                    return
                if not entries and ahead is None:
                    ahead = await _started(self.reader.read(count=4, block_ms=1000))
                result = await self._execute(msg)
                self.last_run = (msg.epoch, msg.step_id)
                self.unconfirmed.append((entry, result))
                if reply is not None:
                    await reply  # answered while the step computed; raises if it failed
                reply = await _started(self._reply(entry, result))
                self._trace_last_step()  # while the result travels to the ledger
        finally:
            # Leaving on an error or a cancel: what is still in flight is dropped here, its
            # outcome retrieved; after a reconnect `_loop` sends the unconfirmed results again
            # and the reader hands out the steps delivered but never seen.
            for task in (ahead, reply):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, aioredis.RedisError, OSError):
                        await task

    async def _admit(self, entry: redis_streams.Entry) -> StepMessage | WorkerShutdown | None:
        """The entry's step, or None when it is not one to run (dead-lettered or stale; acked)."""
        try:
            msg = redis_streams.decode_entry(entry)
            if not isinstance(msg, StepMessage | WorkerShutdown):
                raise WireError(f"field 'kind': {kind_of(msg)!r} does not belong on a step stream")
        except WireError as exc:
            await redis_streams.dead_letter(self.r, self.cfg.streams.dead_letters, entry, str(exc))
            await self.reader.ack([entry])
            return None
        if isinstance(msg, StepMessage) and msg.leader_token < self.leader_token:
            # A deposed ledger (paused past its lease) still stepping: its step would reset
            # the state the new leader built. No result: that ledger must not progress.
            log.warning("stale_leader_step", step_id=msg.step_id, fence=msg.leader_token,
                        highest_fence=self.leader_token)  # fmt: skip
            await self.reader.ack([entry])
            return None
        if isinstance(msg, StepMessage):
            epoch, step_id = self.last_run
            if msg.epoch == epoch and msg.step_id <= step_id:
                # Handed out again (pending entries after a reconnect, a group made anew): the
                # worker's state already holds its tokens, so it runs once.
                await self.reader.ack([entry])
                return None
            self.leader_token = msg.leader_token
        return msg

    def _trace_last_step(self) -> None:
        """The spans of the step just run: after its result is on its way, off the critical
        path of the step loop."""
        if self.spans is not None and self._untraced is not None:
            step, start_ns, end_ns, error = self._untraced
            self._untraced = None
            self.spans.step(step, start_ns, end_ns, error)

    async def _reply(self, entry: redis_streams.Entry, result: StepResult) -> None:
        """The result and the ack in one round trip; confirmed once Redis answered."""
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.xadd(
                self.cfg.streams.results,
                {redis_streams.FIELD: encode(result)},
                maxlen=RESULTS_MAXLEN,
                approximate=True,
            )
            pipe.xack(self.steps_stream, self.reader.group, entry.entry_id)
            await pipe.execute()
        self.unconfirmed = [u for u in self.unconfirmed if u[0] is not entry]

    async def _execute(self, step: StepMessage) -> StepResult:
        started = time.perf_counter()
        start_ns = time.time_ns()
        error = None
        failed: dict[str, str] | None = None
        output = StepOutput({}, None, 0)
        shared_failed: dict[int, list[int]] | None = None
        shared_unreachable: list[int] | None = None
        shared_seconds: list[float] | None = None
        try:
            unformed = await self.tp_group.ensure(step.epoch)
            if unformed is not None:
                raise StepError(unformed)
            output = self.runner.run_step(step)
            shared = await self._shared_copies(step)
            if shared is not None:
                shared_failed, shared_unreachable = shared[0], shared[1] or None
                if self.shared is not None:
                    shared_seconds = self.shared.seconds
        except RequestsFailed as exc:
            error, failed = (
                f"step {step.step_id} failed on {len(exc.errors)} request(s)",
                exc.errors,
            )
            log.error("requests_failed", step_id=step.step_id, errors=exc.errors)
        except StepError as exc:
            error = f"step {step.step_id} refused: {exc}"
            log.error("step_refused", step_id=step.step_id, error=str(exc))
        except Exception as exc:  # a failed step must reach the ledger, not kill the worker
            error = f"step {step.step_id} failed: {type(exc).__name__}: {exc}"
            log.exception("step_failed", step_id=step.step_id)
            if self.runner.model.tp.size > 1:  # a collective failed: this group is gone
                self.tp_group.broken(step.epoch)
        elapsed = time.perf_counter() - started
        self.steps_done += 1
        if self.spans is not None:
            self._untraced = (step, start_ns, start_ns + int(elapsed * 1e9), error)
        return StepResult(
            step_id=step.step_id,
            epoch=step.epoch,
            worker_id=self.worker_id,
            sampled_token_ids=output.sampled,
            logprobs=output.logprobs or None,
            prompt_logprobs=output.prompt_logprobs or None,
            execute_seconds=elapsed,
            error=error,
            leader_token=step.leader_token,
            failed_requests=failed,
            transfers_done=output.transfers_done,
            shared_failed=shared_failed,
            shared_unreachable=shared_unreachable,
            shared_seconds=shared_seconds,
            transfer_seconds=output.transfer_seconds,
        )

    async def _shared_copies(
        self, step: StepMessage
    ) -> tuple[dict[int, list[int]], list[int]] | None:
        """The step's shared-tier copies (after its forward pass): job id -> failed keys, and
        the jobs the store could not serve at all."""
        transfers = step.kv_transfers
        if transfers is None or not (
            transfers.promotions or transfers.cascades or transfers.shared_deletes
        ):
            return None
        jobs = [*transfers.promotions, *transfers.cascades]
        host = self.runner.host_tier
        if self.shared is None or host is None:
            log.warning(
                "shared_tier_not_configured", step_id=step.step_id,
                hint="start the worker with the ledger's --kv-shared-tier",
            )  # fmt: skip
            return shared_reports([(job, None) for job in jobs])
        try:
            return await self.shared.run(transfers, host)
        except Exception:  # never the step's failure: the blocks are recomputed
            log.exception("shared_tier_failed", step_id=step.step_id)
            return shared_reports([(job, None) for job in jobs])


async def serve(config: WorkerConfig) -> None:
    """Run one worker until cancelled: load the model, profile memory, size the KV cache, then
    register and execute the ledger's steps. Logging and tracing are the caller's to set up
    (`kvledger worker` does). A model, device or attention backend that cannot serve raises
    `StartupError` with one line that says what to change."""
    assert config.redis_url, "the caller checks that there is a Redis to talk to"
    device = resolve_device(config.device)
    configure_cpu_threads(
        device, config.cpu_threads, config.workers_on_host, config.cpu_reserved_cores
    )
    try:
        tp = TensorParallel(config.tp_rank, config.tp_size)
    except TensorParallelError as exc:
        raise StartupError(str(exc), exit_code=2) from None
    if device.type == "cuda" and tp.size > 1:
        device = torch.device("cuda", tp.rank % torch.cuda.device_count())  # a GPU per rank
        if config.kv_cache_memory_bytes is None:
            # The profile run is a forward pass, a collective the group is not formed for yet.
            raise StartupError(
                "--tp-size > 1 on CUDA needs --kv-cache-memory-bytes (the profile run does not "
                "run across ranks yet)",
                exit_code=2,
            )
    runner_config = RunnerConfig(
        tp=tp,
        model=config.model,
        dtype=config.dtype,
        device=str(device),
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        seed=config.seed,
        kernels=config.kernels,
        profile=ProfileSettings(
            block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            gpu_memory_utilization=config.gpu_memory_utilization,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            num_gpu_blocks_override=config.num_gpu_blocks_override,
        ),
    )
    try:
        runner = await asyncio.to_thread(ModelRunner.create, runner_config)
    # Missing checkpoint files, no memory for the cache, an attention backend that cannot run
    # this model here (BackendError): one line that says what to change.
    except (ValueError, BackendError) as exc:
        raise StartupError(str(exc)) from None
    if config.served_model_name:
        runner.name = config.served_model_name
    r = redis_streams.connect(config.redis_url)
    try:
        await WorkerService(
            config, r, runner, tracer_if_on("kvledger-worker"),
            detailed_traces=bool(config.collect_detailed_traces),
        ).run()  # fmt: skip
    finally:
        await r.aclose()


async def _started(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """`coro` as a task, run up to its first wait: a Redis command has been written by then
    (taking a pooled connection and sending do not wait), so its round trip runs while the
    caller computes. Were it not yet written, it would go out at the next wait: slower, not wrong."""
    task = asyncio.create_task(coro)
    await asyncio.sleep(0)
    return task
