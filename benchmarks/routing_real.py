"""Routing with real processes: replicas of the tiny model on this machine, gateways in front.

Each run starts a fresh redis-server, N ledger + worker pairs (`--replica r0..`, each its own KV
cache: `KVLEDGER_NUM_GPU_BLOCKS_OVERRIDE` small enough that the system prompts do not all fit, so
eviction matters, or the default cache `kvledger up` gives a CPU worker) and one gateway (or
several, routing as one, each request sent to the next in turn) under the policy, then replays
either the seeded multi-tenant trace (tests/harness/routing_workload.py) open loop over
streaming HTTP, a conversation's first turn at its arrival time, a follow-up its think time
after the previous turn's last token; or the public trace (`closed_loop`: the requests in order,
`concurrency` in flight, the next sent as one ends). Figures per run:
prefill tokens computed and prefix hit rate (every ledger's vllm:prefix_cache_* counters), TTFT
p50/p99 (first streamed token), output tokens/s (wall clock, first send to last token), and each
request's cached tokens (usage.prompt_tokens_details.cached_tokens). A run may restart the
gateway after a given number of requests (new arrivals wait, in-flight ones finish, a new
gateway starts and resumes). The worker's per-step execute time, read back from each replica's
steps and results streams, feeds the simulation's step model (see calibrate()).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import json
import os
import statistics
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

from services.transport.redis_server import RedisServer, free_port
from services.transport.redis_streams import FIELD
from services.wire import codec
from services.wire.messages import StepMessage, StepResult
from tests.harness.processes import ServiceProcess
from tests.harness.routing_workload import Turn

PREFIX = "kvl"


@dataclass(frozen=True, slots=True)
class RealConfig:
    replicas: int = 4
    num_gpu_blocks: int | None = 400  # None: the default cache (kv_cache_memory)
    kv_cache_memory: str = "256MiB"  # what `kvledger up` gives a CPU worker
    gateways: int = 1
    max_model_len: int = 4096
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    request_timeout_s: float = 900.0
    # When set: each gateway logs at debug level (its `routed` records: every replica's score,
    # health and lag) to <log_dir>/<policy>-gateway.log, and each run's requests to a JSON file.
    log_dir: str | None = None
    # The gateway's stale_after_s; a smaller one than the default 2 s makes replicas stale as
    # often as a more loaded machine does (ledger status heartbeats late).
    stale_after_s: float | None = None
    # More environment for every ledger and worker: the offloaded tiers, for instance
    # (KVLEDGER_KV_OFFLOADING_SIZE, KVLEDGER_KV_SHARED_TIER).
    extra_env: dict[str, str] = field(default_factory=dict)


class Stack:
    """redis-server + N ledger/worker pairs + the gateways, as separate processes."""

    def __init__(self, config: RealConfig, policy: str) -> None:
        self.config, self.policy = config, policy
        self.names = [f"r{i}" for i in range(config.replicas)]
        self.server = RedisServer()
        self.procs: list[ServiceProcess] = []
        self.metrics_urls: list[str] = []
        self.gateways: list[ServiceProcess] = []
        self.urls: list[str] = []

    @property
    def url(self) -> str:
        return self.urls[0]

    def __enter__(self) -> Stack:
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)  # no ledger, worker or redis-server left behind
            raise
        return self

    def _start(self) -> None:
        self.server.__enter__()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEDGER_", "OTEL_"))}
        self.base = {
            **env, "PYTHONUNBUFFERED": "1", "KVLEDGER_LOG_LEVEL": "warning",
            "KVLEDGER_REDIS_URL": self.server.url, "KVLEDGER_STREAM_PREFIX": PREFIX,
            "KVLEDGER_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "KVLEDGER_MODEL": "tiny",
            "KVLEDGER_NUM_GPU_BLOCKS_OVERRIDE": str(self.config.num_gpu_blocks),
            "KVLEDGER_MAX_MODEL_LEN": str(self.config.max_model_len),
            "KVLEDGER_MAX_NUM_SEQS": str(self.config.max_num_seqs),
            "KVLEDGER_MAX_NUM_BATCHED_TOKENS": str(self.config.max_num_batched_tokens),
            **self.config.extra_env,
        }  # fmt: skip
        if self.config.num_gpu_blocks is not None:
            self.base["KVLEDGER_NUM_GPU_BLOCKS_OVERRIDE"] = str(self.config.num_gpu_blocks)
        else:
            self.base["KVLEDGER_KV_CACHE_MEMORY_BYTES"] = self.config.kv_cache_memory
        for name in self.names:
            port = free_port()
            env = {**self.base, "KVLEDGER_REPLICA": name, "KVLEDGER_METRICS_PORT": str(port)}
            self.procs += [
                ServiceProcess("ledger", env, keep_lines=200).start(),
                ServiceProcess("worker", env, keep_lines=200).start(),
            ]
            self.metrics_urls.append(f"http://127.0.0.1:{port}/metrics")
        self.client = redis.Redis.from_url(self.server.url)
        deadline = time.monotonic() + 300
        while not all(self._has_worker(name) for name in self.names):
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError("replicas never got their workers")
            time.sleep(0.5)
        self.start_gateways()

    def _has_worker(self, name: str) -> bool:
        from services.transport.keys import StreamNames
        from services.wire.messages import LedgerStatus

        data = self.client.get(StreamNames(PREFIX, name).ledger_status)
        return bool(data) and codec.decode(data, LedgerStatus).num_workers > 0  # type: ignore[arg-type]

    def _check_alive(self) -> None:
        for proc in [*self.procs, *self.gateways]:
            if proc.process is not None and proc.process.poll() is not None:
                raise RuntimeError(f"{proc.role} exited: {''.join(proc.lines[-15:])}")

    def start_gateways(self) -> None:
        self.gateways, self.urls = [], []
        for index in range(self.config.gateways):
            self.start_gateway(index)
        time.sleep(1.0)  # the routing view: snapshots loaded, streams followed

    def start_gateway(self, index: int = 0) -> None:
        port = free_port()
        env = {**self.base, "KVLEDGER_PORT": str(port), "KVLEDGER_REPLICAS": ",".join(self.names),
               "KVLEDGER_ROUTING": self.policy, "KVLEDGER_MAX_QUEUE": "100000",
               "KVLEDGER_REQUEST_TIMEOUT": str(self.config.request_timeout_s)}  # fmt: skip
        if self.config.stale_after_s is not None:
            env["KVLEDGER_ROUTE_STALE_AFTER_S"] = str(self.config.stale_after_s)
        log_path = None
        if self.config.log_dir is not None:
            env["KVLEDGER_LOG_LEVEL"] = "debug"
            log_path = Path(self.config.log_dir) / f"{self.policy}-gateway{index}.log"
        gateway = ServiceProcess("gateway", env, log_path, keep_lines=200).start()
        url = f"http://127.0.0.1:{port}"
        self.gateways.append(gateway)
        self.urls.append(url)
        deadline = time.monotonic() + 120
        while True:
            self._check_alive()
            try:
                with urllib.request.urlopen(f"{url}/ping", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway never answered /ping")
            time.sleep(0.3)

    def restart_gateway(self) -> None:
        for gateway in self.gateways:
            gateway.stop()
        self.start_gateways()

    def prefix_counters(self) -> tuple[float, ...]:
        """Summed over every ledger: (queried tokens, GPU hit tokens, preemptions, tokens
        loaded from the offloaded tiers, blocks promoted from the shared tier); the last two 0
        without the tiers."""
        totals = [0.0] * len(COUNTERS)
        for url in self.metrics_urls:
            with urllib.request.urlopen(url, timeout=10) as reply:
                text = reply.read().decode()
            for k, (name, required) in enumerate(COUNTERS):
                totals[k] += _metric(text, name, required)
        return tuple(totals)

    def step_samples(self) -> list[tuple[int, int, float]]:
        """(prefill tokens, decode sequences, worker execute seconds) of every step run."""
        samples = []
        for name in self.names:
            base = f"{PREFIX}:{{{name}}}"
            seconds = {}
            for _, fields in self.client.xrange(f"{base}:results"):
                result = codec.decode(fields[FIELD], StepResult)
                if result.error is None:
                    seconds[result.step_id] = result.execute_seconds
            for key in self.client.scan_iter(match=f"{base}:steps:*", _type="stream"):
                for _, fields in self.client.xrange(key):
                    step = codec.decode(fields[FIELD], StepMessage)
                    if step.step_id not in seconds:
                        continue
                    cached = {r.req_id for r in step.cached_reqs}
                    decode = sum(
                        1 for r, n in step.num_scheduled_tokens.items() if n == 1 and r in cached
                    )
                    prefill = sum(step.num_scheduled_tokens.values()) - decode
                    samples.append((prefill, decode, seconds[step.step_id]))
        return samples

    def __exit__(self, *exc: object) -> None:
        for proc in [*self.gateways, *self.procs]:
            proc.stop()
        if hasattr(self, "client"):
            self.client.close()
        self.server.__exit__(*exc)


COUNTERS = (
    ("vllm:prefix_cache_queries_total", True),
    ("vllm:prefix_cache_hits_total", True),
    ("vllm:num_preemptions_total", True),
    ("vllm:external_prefix_cache_hits_total", False),  # the CPU tier's loads, in tokens
    ("kvledger:shared_tier_promoted_blocks_total", False),
)


def _metric(text: str, name: str, required: bool = True) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    if not required:
        return 0.0
    raise ValueError(f"the ledger's /metrics has no {name}")


@dataclass
class Sent:
    request_id: str
    prompt_tokens: int
    sent_at: float
    ttft_s: float | None = None
    ended_at: float = 0.0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


@dataclass
class RealRun:
    policy: str
    repetition: int
    sent: list[Sent] = field(default_factory=list)
    wall_s: float = 0.0
    queried: float = 0.0
    hits: float = 0.0
    preemptions: float = 0.0
    loaded: float = 0.0  # tokens loaded from the offloaded tiers (counted as hits below)
    shared_blocks: float = 0.0  # blocks promoted from the shared tier (another replica's work)
    restart_after: int | None = None

    def row(self) -> dict[str, object]:
        done = [s for s in self.sent if s.error is None]
        ttfts = sorted(s.ttft_s for s in done if s.ttft_s is not None)
        output = sum(s.output_tokens for s in done)
        return {
            "policy": self.policy,
            "repetition": self.repetition,
            "requests": len(self.sent),
            "errors": len(self.sent) - len(done),
            "prompt_tokens": int(self.queried),
            "prefill_tokens": int(self.queried - self.hits - self.loaded),
            "hit_rate": round((self.hits + self.loaded) / max(self.queried, 1), 4),
            "loaded_tokens": int(self.loaded),
            "shared_blocks": int(self.shared_blocks),
            "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
            "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 3)
            if ttfts
            else None,
            "throughput_tok_s": round(output / self.wall_s, 1) if self.wall_s else 0.0,
            "wall_s": round(self.wall_s, 1),
            "preemptions": int(self.preemptions),
        }


async def replay(
    stack: Stack,
    turns: Sequence[Turn],
    run: RealRun,
    *,
    restart_after: int | None = None,
) -> None:
    """Send the trace open loop; follow-ups wait for their previous turn's end plus think time."""
    import aiohttp

    follow_up = {t.previous: i for i, t in enumerate(turns) if t.previous is not None}
    due = [(t.arrival_s, i) for i, t in enumerate(turns) if t.previous is None]
    heapq.heapify(due)
    wake = asyncio.Event()
    started = time.monotonic()
    in_flight: set[asyncio.Task[None]] = set()
    timeout = aiohttp.ClientTimeout(total=stack.config.request_timeout_s + 60)

    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(i: int) -> None:
            turn = turns[i]
            sent = Sent(turn.request_id, len(turn.prompt_token_ids), time.monotonic())
            run.sent.append(sent)
            body = {
                "prompt": list(turn.prompt_token_ids), "max_tokens": turn.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True,
            }  # fmt: skip
            try:
                async with session.post(f"{stack.url}/v1/completions", json=body) as resp:
                    if resp.status != 200:
                        sent.error = f"{resp.status}: {(await resp.text())[:200]}"
                    async for raw in resp.content:
                        line = raw.decode().strip()
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        choices = chunk.get("choices")
                        if choices and choices[0].get("token_ids") and sent.ttft_s is None:
                            sent.ttft_s = time.monotonic() - sent.sent_at
                        if usage := chunk.get("usage"):
                            sent.output_tokens = usage["completion_tokens"]
                            details = usage.get("prompt_tokens_details") or {}
                            sent.cached_tokens = details.get("cached_tokens") or 0
            except (TimeoutError, aiohttp.ClientError) as exc:
                sent.error = f"{type(exc).__name__}: {exc}"
            sent.ended_at = time.monotonic()
            nxt = follow_up.get(i)
            if nxt is not None:
                heapq.heappush(due, (sent.ended_at - started + turns[nxt].think_s, nxt))
                wake.set()

        count = 0
        while count < len(turns):
            wake.clear()
            delay = due[0][0] - (time.monotonic() - started) if due else None
            if delay is None or delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), delay)
                continue
            _, i = heapq.heappop(due)
            if restart_after is not None and count == restart_after:
                # New arrivals wait and in-flight requests finish: a restart loses no request.
                if in_flight:
                    await asyncio.wait(in_flight)
                await asyncio.to_thread(stack.restart_gateway)
                run.restart_after = count
            task = asyncio.ensure_future(one(i))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            count += 1
        if in_flight:
            await asyncio.wait(in_flight)
    ends = [s.ended_at for s in run.sent]
    run.wall_s = (max(ends) - min(s.sent_at for s in run.sent)) if ends else 0.0


async def replay_closed(
    stack: Stack,
    turns: Sequence[Turn],
    run: RealRun,
    concurrency: int,
    kill_gateway_after: int | None = None,
) -> None:
    """The requests in order, `concurrency` in flight: the next is sent as one ends, to the
    next gateway in turn (several gateways: as a load balancer in front of them would). With
    `kill_gateway_after` N, the first gateway is killed (SIGKILL) as request N is sent, and
    the rest go to the others (its requests in flight fail: their clients' connections go with
    it); `run.killed_at` is the index."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=stack.config.request_timeout_s + 60)
    order = iter(range(len(turns)))
    urls = list(stack.urls)

    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def client() -> None:
            for i in order:
                if i == kill_gateway_after and len(urls) > 1:
                    process = stack.gateways[0].process
                    assert process is not None
                    process.kill()
                    urls.pop(0)
                    run.restart_after = i
                await _send(session, urls[i % len(urls)], turns[i], run)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    ends = [s.ended_at for s in run.sent]
    run.wall_s = (max(ends) - min(s.sent_at for s in run.sent)) if ends else 0.0


async def _send(session, url: str, turn: Turn, run: RealRun) -> Sent:
    import aiohttp

    sent = Sent(turn.request_id, len(turn.prompt_token_ids), time.monotonic())
    run.sent.append(sent)
    body = {
        "prompt": list(turn.prompt_token_ids), "max_tokens": turn.max_tokens,
        "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True,
    }  # fmt: skip
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                sent.error = f"{resp.status}: {(await resp.text())[:200]}"
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                choices = chunk.get("choices")
                if choices and choices[0].get("token_ids") and sent.ttft_s is None:
                    sent.ttft_s = time.monotonic() - sent.sent_at
                if usage := chunk.get("usage"):
                    sent.output_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    sent.cached_tokens = details.get("cached_tokens") or 0
    except (TimeoutError, aiohttp.ClientError) as exc:
        sent.error = f"{type(exc).__name__}: {exc}"
    sent.ended_at = time.monotonic()
    return sent


def run_policy(
    config: RealConfig,
    turns: Sequence[Turn],
    policy: str,
    repetition: int,
    *,
    restart_after: int | None = None,
    closed_loop: int | None = None,
    kill_gateway_after: int | None = None,
) -> tuple[RealRun, list[tuple[int, int, float]]]:
    with Stack(config, policy) as stack:
        run = RealRun(policy, repetition)
        before = stack.prefix_counters()
        if closed_loop is not None:
            asyncio.run(replay_closed(stack, turns, run, closed_loop, kill_gateway_after))
        else:
            asyncio.run(replay(stack, turns, run, restart_after=restart_after))
        time.sleep(1.5)  # the ledgers' counters follow their last step
        after = stack.prefix_counters()
        run.queried, run.hits, run.preemptions, run.loaded, run.shared_blocks = (
            a - b for a, b in zip(after, before, strict=True)
        )
        if config.log_dir is not None:
            path = Path(config.log_dir) / f"{policy}-{repetition}-requests.json"
            path.write_text(json.dumps([dataclasses.asdict(s) for s in run.sent]))
        return run, stack.step_samples()


def calibrate(samples: Sequence[tuple[int, int, float]]) -> dict[str, float]:
    """Least squares, no negative cost: seconds = base + prefill_token_s * prefill +
    decode_seq_s * decode. A term whose fitted cost comes out negative (noise on a loaded
    machine) is dropped and the rest refitted: a step model cannot make work free."""
    import numpy as np

    a = np.array([[1.0, p, d] for p, d, _ in samples])
    b = np.array([s for _, _, s in samples])
    keep = [0, 1, 2]
    coef = np.zeros(3)
    while keep:
        fitted, *_ = np.linalg.lstsq(a[:, keep], b, rcond=None)
        if (fitted >= 0).all():
            coef[keep] = fitted
            break
        keep.pop(int(np.argmin(fitted)))
    residual = b - a @ coef
    return {
        "steps": len(samples),
        "base_ms": round(float(coef[0]) * 1000, 4),
        "prefill_token_ms": round(float(coef[1]) * 1000, 5),
        "decode_seq_ms": round(float(coef[2]) * 1000, 4),
        "r2": round(float(1 - residual.var() / b.var()), 3) if b.var() else 0.0,
        "median_step_ms": round(float(np.median(b)) * 1000, 3),
    }
