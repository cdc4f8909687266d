"""End-to-end load: the service split (HTTP -> gateway -> Redis -> ledger -> worker) against the
same engine in one process without Redis, on the same workload.

    python benchmarks/e2e.py [--requests 48] [--concurrency 8] [--json benchmarks/results/e2e.json]

Reports requests/s, output tokens/s, time to first token and inter-token latency (p50/p99), the
prefix-cache hit rate and preemptions for both, and the split's share of the in-process
throughput (target: at least 85%). The split is started with `kvledger up` in a subprocess and
driven over streaming HTTP; the baseline drives Scheduler + ModelRunner directly. Both run the
same scheduling mode (`--scheduling`: async, the service's default, or lockstep), the rounds
alternate which side goes first, every figure is the round's own (prefix-cache counters are
read from the ledger before and after each round), and the rows printed are those of the round
whose ratio is the median.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvledger.report import format_table  # noqa: E402
from services.transport.redis_server import free_port  # noqa: E402


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]


@dataclass
class Report:
    mode: str
    scheduling: str
    wall_s: float
    requests: int
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    def row(self) -> list:
        return [
            f"{self.mode}, {self.scheduling}",
            self.requests / self.wall_s,
            self.tok_s,
            _ms(self.ttft_s, 50),
            _ms(self.ttft_s, 99),
            _ms(self.itl_s, 50),
            _ms(self.itl_s, 99),
            f"{self.prefix_hits / max(self.prefix_queries, 1):.1%}",
            self.preemptions,
        ]


def _ms(values: list[float], pct: int) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{1000 * ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))]:.1f}"


def make_workload(
    n: int, seed: int, prompt_mean: int, output_mean: int, prefixes: int, prefix_len: int
) -> Workload:
    rng = random.Random(seed)
    shared = [[rng.randrange(32, 127) for _ in range(prefix_len)] for _ in range(prefixes)]
    prompts, outputs = [], []
    for _ in range(n):
        body = [
            rng.randrange(32, 127)
            for _ in range(max(4, int(rng.lognormvariate(0, 0.5) * prompt_mean)))
        ]
        prompts.append((shared[rng.randrange(prefixes)] if prefixes else []) + body)
        outputs.append(max(2, int(rng.lognormvariate(0, 0.5) * output_mean)))
    return Workload(prompts, outputs)


# ---------------------------------------------------------------- in process, no Redis


def run_in_process(work: Workload, args: argparse.Namespace) -> Report:
    import torch

    from engine.translate import Tracked, build_step_message
    from gpu_worker.checkpoint import load_model
    from gpu_worker.runner import ModelRunner
    from ledger.hashing import BlockHasher
    from ledger.kv_cache_manager import KVCacheManager
    from ledger.request import Request
    from ledger.scheduler import Scheduler, SchedulerConfig
    from services.wire.messages import GenerateRequest, SamplingParams

    torch.set_num_threads(1)
    model = load_model(args.model, seed=0)
    runner = ModelRunner(model, args.num_blocks, args.block_size, name="bench")
    manager = KVCacheManager(
        args.num_blocks, args.block_size, args.max_model_len, enable_caching=True
    )
    scheduler = Scheduler(
        SchedulerConfig(
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            async_scheduling=args.scheduling == "async",
        ),
        manager,
    )
    hasher = BlockHasher("sha256")
    pending = deque(enumerate(zip(work.prompts, work.max_tokens, strict=True)))
    sent: dict[str, float] = {}
    last_token: dict[str, float] = {}
    report = Report("in-process (no Redis)", args.scheduling, 0.0, len(work.prompts), 0)
    # The ledger service's loop: with async scheduling step N+1 is scheduled (and, here, run)
    # before step N's tokens are applied; the runner keeps what it sampled, as a worker does.
    depth = 2 if args.scheduling == "async" else 1
    in_flight: deque = deque()
    started = time.perf_counter()
    while pending or in_flight or scheduler.has_unfinished_requests():
        while pending and scheduler.num_running + scheduler.num_waiting < args.concurrency:
            i, (prompt, max_tokens) = pending.popleft()
            rid = f"r{i}"
            msg = GenerateRequest(
                req_id=rid,
                gateway_id="-",
                prompt_token_ids=prompt,
                sampling=SamplingParams(max_tokens=max_tokens),
                arrival_time=time.time(),
            )
            scheduler.add_request(
                Request(
                    rid,
                    prompt,
                    max_tokens,
                    block_hasher=hasher,
                    block_size=args.block_size,
                    payload=Tracked(None, msg),
                )
            )
            sent[rid] = time.perf_counter()
        if len(in_flight) < depth and scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            if not out.is_empty:
                step = build_step_message(out, "bench", args.block_size)
                in_flight.append((out, runner.execute(step)))
                if len(in_flight) < depth:
                    continue
        if not in_flight:
            continue
        out, sampled = in_flight.popleft()
        now = time.perf_counter()
        for update in scheduler.update_from_output(out, sampled):
            rid = update.request.request_id
            report.output_tokens += len(update.new_token_ids)
            if rid in last_token:
                report.itl_s.append(now - last_token[rid])
            else:
                report.ttft_s.append(now - sent[rid])
            last_token[rid] = now
    report.wall_s = time.perf_counter() - started
    stats = manager.prefix_cache_stats
    report.prefix_queries, report.prefix_hits, report.preemptions = (
        stats.queries,
        stats.hits,
        scheduler.num_preemptions,
    )
    return report


# ---------------------------------------------------------------- the service split, over HTTP


@dataclass
class Split:
    url: str  # the gateway
    ledger_metrics: str  # the ledger's own /metrics: counters current to the step


@contextlib.contextmanager
def split_stack(args: argparse.Namespace):
    """`kvledger up` in a subprocess, serving until the block ends."""
    port, metrics_port = free_port(), free_port()
    env = dict(os.environ, KVLEDGER_LOG_LEVEL="warning", KVLEDGER_MAX_QUEUE="100000",
               KVLEDGER_ASYNC_SCHEDULING="1" if args.scheduling == "async" else "0")  # fmt: skip
    cmd = [sys.executable, "-m", "kvledger.cli", "up", "--port", str(port), "--device", "cpu", "--model", str(args.model),
           "--metrics-port", str(metrics_port),
           "--num-gpu-blocks-override", str(args.num_blocks), "--kv-cache-memory-bytes", "512MiB",
           "--block-size", str(args.block_size), "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if "Press Ctrl-C" in line:
                break
        else:
            raise RuntimeError("kvledger up exited before serving")
        yield Split(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def run_split(split: Split, work: Workload, args: argparse.Namespace) -> Report:
    import aiohttp

    mode = f"service split (HTTP{' SSE' if args.stream else ''} + Redis)"
    report = Report(mode, args.scheduling, 0.0, len(work.prompts), 0)
    semaphore = asyncio.Semaphore(args.concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:

        async def one(prompt: list[int], max_tokens: int) -> None:
            async with semaphore:
                body = {
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "stream": args.stream,
                    "ignore_eos": True,
                    "temperature": 0,
                    "return_token_ids": True,  # count tokens, not text (a byte may print nothing)
                }
                start = last = time.perf_counter()
                first = True
                async with session.post(f"{split.url}/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    if not args.stream:
                        data = await resp.json()
                        report.ttft_s.append(
                            time.perf_counter() - start
                        )  # whole request, unstreamed
                        report.output_tokens += data["usage"]["completion_tokens"]
                        return
                    async for raw in resp.content:
                        line = raw.decode().strip()
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        new = (
                            len(chunk["choices"][0].get("token_ids") or [])
                            if chunk["choices"]
                            else 0
                        )
                        if not new:
                            continue
                        now = time.perf_counter()
                        (report.ttft_s if first else report.itl_s).append(
                            now - (start if first else last)
                        )
                        first, last = False, now
                        report.output_tokens += new

        before = await _counters(session, split.ledger_metrics)
        started = time.perf_counter()
        await asyncio.gather(
            *(one(p, m) for p, m in zip(work.prompts, work.max_tokens, strict=True))
        )
        report.wall_s = time.perf_counter() - started
        after = await _counters(session, split.ledger_metrics)
    # The ledger runs for every round: its counters are cumulative, this round is the difference.
    report.prefix_queries, report.prefix_hits, report.preemptions = (
        int(a - b) for a, b in zip(after, before, strict=True)
    )
    return report


COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
)


async def _counters(session, url: str) -> list[float]:
    text = await (await session.get(url)).text()
    return [_metric(text, name) for name in COUNTERS]


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise ValueError(f"the ledger's /metrics has no {name}")


def make_small_checkpoint() -> str:
    """A random Llama big enough that a step is not all Python overhead (needs transformers)."""
    import tempfile

    from tests.gpu_worker.checkpoints import make_tiny_checkpoint

    folder = make_tiny_checkpoint(
        Path(tempfile.mkdtemp(prefix="kvledger-bench-")), hidden_size=512, intermediate_size=1376,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
    )  # fmt: skip
    return str(folder)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-mean", type=int, default=96)
    parser.add_argument("--output-mean", type=int, default=48)
    parser.add_argument("--prefixes", type=int, default=4, help="shared system prompts (0: none)")
    parser.add_argument("--prefix-len", type=int, default=128)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scheduling",
        choices=("async", "lockstep"),
        default="async",
        help="for both sides: async (two steps in flight, the service's default) or lockstep",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds; the median ratio is reported"
    )
    parser.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="non-streaming requests: measures throughput without per-token SSE work",
    )
    parser.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (the tiny seeded Llama), a checkpoint folder, or 'small': a random "
        "8-layer, 512-wide Llama built with transformers (a step costs about 4x the tiny one's)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.model == "small":
        args.model = make_small_checkpoint()
    work = make_workload(
        args.requests, args.seed, args.prompt_mean, args.output_mean, args.prefixes, args.prefix_len
    )
    print(
        f"workload: {args.requests} requests, concurrency {args.concurrency}, "
        f"{sum(map(len, work.prompts)):,} prompt tokens, {sum(work.max_tokens):,} output tokens",
        flush=True,
    )
    print(f"scheduling: {args.scheduling} on both sides", flush=True)
    rounds: list[tuple[Report, Report]] = []
    with split_stack(args) as split:
        for i in range(args.repeats):
            # Each round a fresh workload (its own prefixes): both modes start with a cold cache.
            work = make_workload(args.requests, args.seed + i, args.prompt_mean, args.output_mean,
                                 args.prefixes, args.prefix_len)  # fmt: skip
            # Alternate which side runs first, so neither always gets the warmer machine.
            if i % 2 == 0:
                baseline = run_in_process(work, args)
                split_report = asyncio.run(run_split(split, work, args))
            else:
                split_report = asyncio.run(run_split(split, work, args))
                baseline = run_in_process(work, args)
            rounds.append((baseline, split_report))
            print(
                f"  round {i + 1}: split/in-process = {split_report.tok_s / baseline.tok_s:.1%}",
                flush=True,
            )
    ratios = [sp.tok_s / b.tok_s for b, sp in rounds]
    # The median round: its ratio is the one reported, and its rows are the ones printed.
    median = sorted(range(len(rounds)), key=ratios.__getitem__)[len(rounds) // 2]
    baseline, split_report = rounds[median]
    ratio = ratios[median]
    header = ["mode, scheduling", "req/s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
              "ITL p50 ms", "ITL p99 ms", "prefix hit rate", "preemptions"]  # fmt: skip
    print(f"\nround {median + 1} of {len(rounds)} (the median ratio):")
    print(format_table(header, [baseline.row(), split_report.row()]))
    print(
        f"\nthe split keeps {ratio:.1%} of the in-process output throughput, median of "
        f"{len(ratios)} rounds {[f'{r:.1%}' for r in ratios]} (target: >= 85%)"
    )
    if args.json:
        keys = ["mode", "req_s", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                "itl_p99_ms", "hit_rate", "preemptions"]  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"json": str(args.json)},
                    "ratio": ratio,
                    "round": median + 1,
                    "ratios": ratios,
                    "in_process": asdict(baseline) | {"ttft_s": None, "itl_s": None},
                    "split": asdict(split_report) | {"ttft_s": None, "itl_s": None},
                    "summary": {
                        r.mode: dict(zip(keys, r.row(), strict=True))
                        for r in (baseline, split_report)
                    },
                    "rounds": [
                        {r.mode: dict(zip(keys, r.row(), strict=True)) for r in pair}
                        for pair in rounds
                    ],
                    "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                },
                indent=2,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
