"""An in-process kvledger stack for tests: the real ledger and worker services as asyncio tasks
on a real redis-server, plus a client that speaks the gateway's side of the streams."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.engine import Engine
from engine.process import LedgerProcess
from gpu_worker.model import LlamaForCausalLM
from gpu_worker.runner import ModelRunner
from gpu_worker.worker import WorkerService
from services.config import LedgerConfig, WorkerConfig
from services.transport import redis_streams
from services.wire import codec
from services.wire.messages import (
    AbortRequest,
    GenerateRequest,
    OutputBatch,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)

GATEWAY = "test-gateway"


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    final: RequestOutput | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None


def dense_greedy(model: LlamaForCausalLM, prompt: list[int], max_tokens: int) -> list[int]:
    """The ground truth: a cache-free forward over the whole sequence for every token."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            tokens.append(int(model.dense_logits(tokens)[-1].argmax()))
    return tokens[len(prompt) :]


class Stack:
    def __init__(
        self,
        url: str,
        model: LlamaForCausalLM,
        *,
        num_blocks: int = 64,
        block_size: int = 16,
        max_model_len: int = 256,
        prefix: str | None = None,
        replica: str = "default",
        ledger_tracer=None,
        worker_tracer=None,
        worker_kwargs: dict | None = None,
        **ledger_kwargs,
    ) -> None:
        self.url = url
        self.model = model
        self.prefix = prefix or f"t{uuid.uuid4().hex[:8]}"
        self.replica = replica
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.worker_kwargs = dict(worker_kwargs or {})
        if "kv_shared_tier" in ledger_kwargs:  # the ledger and its workers read it alike
            self.worker_kwargs.setdefault("kv_shared_tier", ledger_kwargs["kv_shared_tier"])
        self.ledger_cfg = LedgerConfig(
            redis_url=url,
            stream_prefix=self.prefix,
            replica=replica,
            block_size=block_size,
            max_model_len=max_model_len,
            metrics_port=0,
            worker_ttl_s=2.0,
            snapshot_interval_s=0.0,
            **ledger_kwargs,
        )
        self.r = redis_streams.connect(url)
        # Each service gets its own client, as separate processes would: cancelling one (a
        # simulated crash) must not leave a half-read reply on a connection another one uses.
        self.clients: list = []
        self.ledger_process: LedgerProcess | None = None
        self.tasks: list[asyncio.Task] = []
        self.workers: dict[str, asyncio.Task] = {}
        self.worker_services: dict[str, WorkerService] = {}
        self.results: dict[str, Result] = {}
        self._reader: asyncio.Task | None = None
        # A test may plant a faulty runner (fault injection) or bind a runner's arguments.
        self.runner_factory: Callable[..., ModelRunner] = ModelRunner
        self.ledger_tracer, self.worker_tracer = ledger_tracer, worker_tracer  # None: off

    @property
    def streams(self):
        return self.ledger_cfg.streams

    @property
    def ledger(self) -> Engine:
        """The running ledger's engine (there once `start` returned)."""
        assert self.ledger_process is not None and self.ledger_process.engine is not None
        return self.ledger_process.engine

    async def start(self, num_workers: int = 1) -> Stack:
        self.ledger_process = LedgerProcess(self.ledger_cfg, self._client(), self.ledger_tracer)
        self.tasks.append(asyncio.create_task(self.ledger_process.run(), name="ledger"))
        for i in range(num_workers):
            await self.start_worker(f"w{i}")
        # XREAD's "$" means "after the newest entry at the time of this call": re-sent on every
        # poll it would lose whatever arrived between two polls, so the position is concrete.
        tail = await self.r.xrevrange(self.streams.outputs(GATEWAY), count=1)
        last = tail[0][0] if tail else b"0-0"
        self._reader = asyncio.create_task(self._read_outputs(last), name="outputs")
        await asyncio.wait_for(self.ledger_process.ready.wait(), 30)
        return self

    def _client(self, name: str | None = None):
        client = redis_streams.connect(self.url, client_name=name)
        self.clients.append(client)
        return client

    async def restart_ledger(self) -> None:
        """Kill the ledger task (as a crash would) and start a new ledger on the same streams."""
        old = self.tasks.pop(0)
        old.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await old
        self.ledger_process = LedgerProcess(self.ledger_cfg, self._client(), self.ledger_tracer)
        self.tasks.insert(0, asyncio.create_task(self.ledger_process.run(), name="ledger"))
        await asyncio.wait_for(self.ledger_process.ready.wait(), 30)

    async def start_worker(self, worker_id: str) -> WorkerService:
        runner = self.runner_factory(
            self.model, self.num_blocks, self.block_size, name="kvledger-tiny-llama"
        )
        cfg = WorkerConfig(
            redis_url=self.url,
            model="tiny",
            stream_prefix=self.prefix,
            replica=self.replica,
            worker_id=worker_id,
            block_size=self.block_size,
            heartbeat_s=0.3,
            ttl_s=2.0,
            # The ledger's tiers: the worker measures the CPU tier's load cost at start-up.
            kv_offloading_size=self.ledger_cfg.kv_offloading_size,
            kv_transfer_config=self.ledger_cfg.kv_transfer_config,
            **self.worker_kwargs,
        )
        # Named, so that a test can cut this worker's connections alone (CLIENT KILL).
        service = WorkerService(
            cfg, self._client(f"{self.prefix}-worker-{worker_id}"), runner, self.worker_tracer
        )
        self.workers[worker_id] = asyncio.create_task(service.run(), name=f"worker-{worker_id}")
        self.worker_services[worker_id] = service
        return service

    async def kill_worker(self, worker_id: str) -> None:
        task = self.workers.pop(worker_id)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def submit(
        self,
        req_id: str,
        prompt: list[int],
        max_tokens: int,
        *,
        traceparent: str | None = None,
        priority: int = 0,
        expected_cached_tokens: int | None = None,
        **kwargs,
    ) -> None:
        self.results[req_id] = Result()
        sampling = SamplingParams(max_tokens=max_tokens, **kwargs)
        await redis_streams.append(
            self.r,
            self.streams.requests,
            GenerateRequest(
                req_id=req_id,
                gateway_id=GATEWAY,
                prompt_token_ids=prompt,
                sampling=sampling,
                arrival_time=time.time(),
                traceparent=traceparent,
                priority=priority,
                expected_cached_tokens=expected_cached_tokens,
            ),
        )

    async def abort(self, req_id: str) -> None:
        await redis_streams.append(
            self.r, self.streams.requests, AbortRequest(req_id=req_id, reason="test")
        )

    async def _read_outputs(self, last: bytes) -> None:
        while True:
            for entry_id, fields in await redis_streams.read_from(
                self.r, self.streams.outputs(GATEWAY), last, block_ms=500
            ):
                last = entry_id
                msg = codec.decode(fields[redis_streams.FIELD])
                for out in msg.outputs if isinstance(msg, OutputBatch) else [msg]:
                    self._apply(out)

    def _apply(self, out: RequestOutput) -> None:
        result = self.results.setdefault(out.req_id, Result())
        assert out.position <= len(result.tokens), f"gap in {out.req_id}'s outputs"
        already = len(result.tokens) - out.position
        result.tokens.extend(out.new_token_ids[already:])
        result.logprobs.extend((out.logprobs or [])[already:])
        if out.prompt_logprobs is not None:
            result.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            result.final = out

    async def wait(self, req_ids, timeout: float = 60.0) -> dict[str, Result]:
        deadline = time.monotonic() + timeout
        while any(self.results[r].final is None for r in req_ids):
            if time.monotonic() > deadline:
                pending = [r for r in req_ids if self.results[r].final is None]
                raise TimeoutError(f"requests did not finish: {pending}")
            for task in [*self.tasks, *self.workers.values()]:
                if task.done():
                    task.result()  # surface a crashed service
            await asyncio.sleep(0.05)
        return {r: self.results[r] for r in req_ids}

    async def stop(self) -> None:
        for task in [
            *self.tasks,
            *self.workers.values(),
            *([self._reader] if self._reader else []),
        ]:
            task.cancel()
        await asyncio.gather(
            *self.tasks,
            *self.workers.values(),
            *([self._reader] if self._reader else []),
            return_exceptions=True,
        )
        for client in [self.r, *self.clients]:
            await client.aclose()
