"""What tracing costs: throughput with tracing off, on at sampling 1.0 and on at a ratio (0.1),
real processes (`kvledger up`, the tiny model on the CPU), 48 concurrent requests, paired rounds.

    python benchmarks/tracing.py [--rounds 24] [--requests 144] [--concurrency 48] [--json FILE]

The three stacks run side by side, each idle while another is measured; every round measures
all three, in an order that goes through the six orders in turn (each stack as often first,
second and third, and before or after each other), and compares each traced run with the
untraced run of its own round. Every run is the same work (the same prompts, seed and load)
followed by the same idle time (`SETTLE_S`: past the worker's 1 s idle and the batch
processors' 5 s schedule, so that a traced run's last exports fall in its own window, never in
the next run's); throughput counts the load's wall time, CPU the whole window. The services run
as `kvledger up` runs them, garbage collectors as in production (on; every role `gc.freeze()`s
what it made starting up, `services/startup.py`; nothing frozen or tuned by the benchmark). The traced stacks export over OTLP/HTTP
(`--otlp-traces-endpoint`, `OTEL_TRACES_SAMPLER=parentbased_traceidratio` for the ratio) to
receivers in child processes that parse each export only to count spans per trace, over kept-
alive HTTP/1.1 connections: what a collector on the same host would cost.

Prints output tokens/s per round, the ratios to off, and for each the median over the rounds
with a 95% bootstrap confidence interval (the rounds resampled) and the spread; the services'
CPU seconds per run; the spans per request (median and max over the request traces of the last
sampling-1.0 run); each against its target (>= 0.95x at 1.0, >= 0.99x at the ratio, <= 20
spans per request): met when the interval's lower end clears it, not met when its upper end is
below it, else not resolved by the run. `--aa` is the control: three untraced stacks in the
same places, measured and judged the same way (what the benchmark reads when nothing differs).
`--pool A.json B.json` runs nothing: it judges the rounds of earlier runs together.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvledger.report import format_table  # noqa: E402
from services.transport.redis_server import free_port  # noqa: E402

TARGET_ON, TARGET_RATIO, TARGET_SPANS = 0.95, 0.99, 20
TARGETS = (TARGET_ON, TARGET_RATIO)  # the traced stacks' targets, in their places


# --- the receiver: a child process that counts spans per trace --------------------------------


def serve_receiver(port: int) -> None:
    """POST /v1/traces: parse, count spans per trace (and which traces hold a SERVER span);
    GET /stats: the counts as JSON; POST /reset: forget them."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    ok = ExportTraceServiceResponse().SerializeToString()
    per_trace: dict[bytes, int] = {}
    servers: set[bytes] = set()
    totals = {"spans": 0, "exports": 0, "step_spans": 0}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as collectors serve (HTTP/1.0 closes each)

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/reset":
                per_trace.clear()
                servers.clear()
                totals.update(spans=0, exports=0, step_spans=0)
                self._reply(b"{}", "application/json")
                return
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            totals["exports"] += 1
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        totals["spans"] += 1
                        per_trace[span.trace_id] = per_trace.get(span.trace_id, 0) + 1
                        if span.kind == 2:  # SERVER: the gateway's root of a request's trace
                            servers.add(span.trace_id)
                        elif span.kind == 5:  # CONSUMER: a worker's kvledger.step
                            totals["step_spans"] += 1
            self._reply(ok, "application/x-protobuf")

        def do_GET(self) -> None:
            stats = {**totals, "per_request": [per_trace[t] for t in servers if t in per_trace]}
            self._reply(json.dumps(stats).encode(), "application/json")

        def _reply(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


class Receiver:
    def __init__(self) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve-receiver", str(self.port)], cwd=ROOT
        )
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError):
                self.stats()
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the span receiver did not start")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def stats(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/stats", timeout=10) as resp:
            return json.loads(resp.read())

    def reset(self) -> None:
        urllib.request.urlopen(
            urllib.request.Request(f"http://127.0.0.1:{self.port}/reset", data=b"", method="POST"),
            timeout=10,
        ).read()

    def settle(self, quiet_s: float = 6.0, limit_s: float = 30.0) -> int:
        """Wait until no span arrived for `quiet_s` (longer than the batch processors' 5 s
        schedule: the exporters flushed); the span count."""
        deadline = time.monotonic() + limit_s
        last, since = self.stats()["spans"], time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = self.stats()["spans"]
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
        return last

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


# --- the stacks ----------------------------------------------------------------------------------


@dataclass
class Stack:
    name: str
    url: str
    process: subprocess.Popen
    receiver: Receiver | None = None
    runs: list[Run] = field(default_factory=list)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of each role under this `kvledger up` (user + system)."""
        import psutil

        totals: dict[str, float] = {}
        for child in psutil.Process(self.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                cmdline = child.cmdline()
                role = next(
                    (r for r in ("ledger", "worker", "gateway") if r in cmdline),
                    "redis" if "redis-server" in " ".join(cmdline) else None,
                )
                if role is None:
                    continue
                times = child.cpu_times()
                totals[role] = totals.get(role, 0.0) + times.user + times.system
        return totals


@dataclass
class Run:
    round: int
    wall_s: float
    output_tokens: int
    cpu_s: dict[str, float]
    spans: int = 0
    step_spans: int = 0  # of them, the workers' kvledger.step spans
    position: int = 0  # 0, 1 or 2: where in its round's order it ran
    load_average: float = 0.0  # the 1-minute load average as it started

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def cpu_ms_per_token(self) -> float:
        """The services' CPU (every role and Redis) per output token: steadier than tok/s on a
        shared machine, since other jobs take wall time, not this run's CPU seconds."""
        return 1000 * sum(self.cpu_s.values()) / self.output_tokens


def start_stack(
    name: str, args: argparse.Namespace, env_extra: dict[str, str], traced: bool | None = None
) -> Stack:
    """`kvledger up` for one stack; traced (by default: any stack but "off") exports its spans
    to a receiver of its own."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.pop("KVLEDGER_COLLECT_DETAILED_TRACES", None)
    env.update(KVLEDGER_LOG_LEVEL="warning", KVLEDGER_MAX_QUEUE="100000", **env_extra)
    receiver = Receiver() if (name != "off" if traced is None else traced) else None
    cmd = [
        sys.executable, "-m", "kvledger.cli", "up", "--model", args.model, "--port", str(port),
        "--device", "cpu",
        "--metrics-port", str(free_port()), "--num-gpu-blocks-override", str(args.num_blocks),
        "--kv-cache-memory-bytes", "256MiB", "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs),
    ]  # fmt: skip
    if receiver is not None:
        cmd += ["--otlp-traces-endpoint", receiver.url]
    process = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert process.stdout is not None
    output: list[str] = []
    for line in process.stdout:
        if "Press Ctrl-C" in line:
            break
        output = [*output[-20:], line]
    else:
        if receiver is not None:
            receiver.close()
        raise RuntimeError(f"kvledger up ({name}) exited before serving:\n{''.join(output)}")
    # Keep reading its output so that a full pipe never blocks it.
    import threading

    threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()  # type: ignore[union-attr]
    return Stack(name, f"http://127.0.0.1:{port}", process, receiver)


@contextlib.contextmanager
def stacks(args: argparse.Namespace) -> Iterator[list[Stack]]:
    started: list[Stack] = []
    try:
        started.append(start_stack("off", args, {}))
        if args.aa:  # the control: three untraced stacks, measured and compared the same way
            started.append(start_stack("off B", args, {}, traced=False))
            started.append(start_stack("off C", args, {}, traced=False))
            yield started
            return
        started.append(start_stack("on 1.0", args, {}))
        started.append(
            start_stack(
                f"on {args.ratio:g}",
                args,
                {
                    "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                    "OTEL_TRACES_SAMPLER_ARG": str(args.ratio),
                },
            )
        )
        yield started
    finally:
        for stack in started:
            stack.process.terminate()
        for stack in started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                stack.process.wait(timeout=30)
            if stack.receiver is not None:
                stack.receiver.close()


# --- the load -----------------------------------------------------------------------------------


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(32, 127) for _ in range(args.prefix_len)] for _ in range(4)]
    return [
        prefixes[i % len(prefixes)]
        + [rng.randrange(32, 127) for _ in range(args.prompt_len - args.prefix_len)]
        for i in range(args.requests)
    ]


async def drive(url: str, prompts: list[list[int]], args: argparse.Namespace) -> tuple[float, int]:
    import aiohttp

    semaphore = asyncio.Semaphore(args.concurrency)
    tokens = 0

    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> None:
        nonlocal tokens
        body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        async with semaphore, session.post(f"{url}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            tokens += (await resp.json())["usage"]["completion_tokens"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        started = time.perf_counter()
        await asyncio.gather(*(one(session, p) for p in prompts))
        return time.perf_counter() - started, tokens


def isolated_span_cost(iterations: int = 300) -> float:
    """CPU microseconds to make, end and encode the spans of one request (the shapes the
    services make: the gateway's server, GenAI and route spans, the ledger's queue and admit, the
    worker's prefill and decode, a share of a step), through an SDK provider's lean tracer and
    kvledger's encoder, measured in this process: the cost without the noise of a shared machine."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    from observability.otlp_encoding import encode_spans
    from observability.tracing import kvledger_sampler, lean_tracer

    class Encoding(SpanExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            encode_spans(spans)
            return SpanExportResult.SUCCESS

    provider = TracerProvider(sampler=kvledger_sampler())
    provider.add_span_processor(SimpleSpanProcessor(Encoding()))
    tracer = lean_tracer(provider.get_tracer("kvledger"))  # as the services make them

    def attrs(n: int, rid: str) -> dict:
        return {"kvledger.request_id": rid, **{f"kvledger.attribute_{i}": i for i in range(n - 1)}}

    def one_request(i: int) -> None:
        rid = f"cmpl-{i:032x}"
        with tracer.start_as_current_span("POST /v1/completions", attributes=attrs(4, rid)):
            genai = tracer.start_span("text_completion m", attributes=attrs(26, rid))
            for n in (11, 8, 8, 10):  # route, queue, admit, prefill
                tracer.start_span("kvledger.x", attributes=attrs(n, rid)).end()
            decode = tracer.start_span("kvledger.decode", attributes=attrs(8, rid))
            decode.add_link(decode.get_span_context())
            decode.end()
            genai.end()

    for i in range(20):
        one_request(i)
    started = time.process_time()
    for i in range(iterations):
        one_request(i)
        if i % 48 < 34:  # ~34 steps a wave of 48 requests, 32 tokens each
            tracer.start_span("kvledger.step", attributes=attrs(12, "s")).end()
    return 1e6 * (time.process_time() - started) / iterations


# Past the worker's idle (1 s without a step ends the open decode runs) and the batch
# processors' 5 s schedule: every span of a run is exported inside its own window.
SETTLE_S = 6.5


def measure(
    stack: Stack, prompts: list[list[int]], args: argparse.Namespace, n: int, position: int
) -> Run:
    """One run: the load, then SETTLE_S for every stack alike (so that the CPU seconds cover
    the traced stacks' exports and the same idle time for all), then the span count (all of
    the run's spans arrived in the settle, none of them left for the next run)."""
    if stack.receiver is not None:
        stack.receiver.reset()
    load = os.getloadavg()[0]
    cpu_before = stack.cpu_seconds()
    wall_s, tokens = asyncio.run(drive(stack.url, prompts, args))
    time.sleep(SETTLE_S)
    cpu = {k: v - cpu_before.get(k, 0.0) for k, v in stack.cpu_seconds().items()}
    stats = stack.receiver.stats() if stack.receiver is not None else {}
    run = Run(
        n, wall_s, tokens, cpu, stats.get("spans", 0), stats.get("step_spans", 0), position, load
    )
    stack.runs.append(run)
    return run


def median_ci(
    values: list[float], *, level: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """The median and a percentile-bootstrap confidence interval for it (the values resampled
    with replacement), seeded so that a report can be reproduced from its JSON."""
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - level) / 2
    low = medians[int(tail * resamples)]
    high = medians[min(resamples - 1, int((1 - tail) * resamples))]
    return statistics.median(values), low, high


def verdict(low: float, high: float, target: float, *, at_least: bool = True) -> str:
    """met / not met / not resolved, by where the target lies against the interval."""
    if not at_least:
        low, high, target = -high, -low, -target
    if low >= target:
        return "met"
    if high < target:
        return "not met"
    return "not resolved"


def judge(
    traced: list[tuple[str, list[Run], float]], off: list[Run]
) -> tuple[list[list[str]], dict[str, dict[str, float | str]]]:
    """Each traced stack's rounds against the untraced run of the same round, by throughput and
    by CPU per token: the median ratio, its bootstrap interval, the range and the verdict
    against the stack's target. Returns the table's rows and the same figures by measure."""
    rows: list[list[str]] = []
    results: dict[str, dict[str, float | str]] = {}
    measures = (
        ("throughput", lambda run, base: run.tok_s / base.tok_s),
        # as a throughput would be, were CPU all it took
        ("CPU per token, inverted", lambda run, base: base.cpu_ms_per_token / run.cpu_ms_per_token),
    )
    for name, runs, target in traced:
        for label, how in measures:
            values = [how(run, base) for run, base in zip(runs, off, strict=True)]
            median, low, high = median_ci(values)
            met = verdict(low, high, target)
            results[f"{name} / off, {label}"] = {
                "median": median, "ci95_low": low, "ci95_high": high, "min": min(values),
                "max": max(values), "target": target, "verdict": met,
            }  # fmt: skip
            rows.append(
                [f"{name} / off, {label}", f"{median:.3f}x", f"{low:.3f}-{high:.3f}",
                 f"{min(values):.3f}-{max(values):.3f}", f">= {target}x", met]
            )  # fmt: skip
    return rows, results


def pooled(files: list[Path]) -> str:
    """Earlier runs' rounds (their --json files) judged together, as one run judges its own:
    the traced stacks in their places (1.0's target, then the ratio's)."""
    runs: dict[str, list[Run]] = {}
    for path in files:
        for name, saved in json.loads(path.read_text())["runs"].items():
            runs.setdefault(name, []).extend(Run(**run) for run in saved)
    off = runs.pop("off")
    traced = [
        (name, stack, target) for (name, stack), target in zip(runs.items(), TARGETS, strict=True)
    ]
    rows, _ = judge(traced, off)
    return format_table(
        ["measure", "median", "95% CI", "range", "target", "verdict"], rows,
        title=f"{len(off)} rounds pooled from {', '.join(p.name for p in files)}",
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=24, help="a multiple of 6 balances orders")
    parser.add_argument("--requests", type=int, default=144)
    parser.add_argument("--warmup-runs", type=int, default=2, help="per stack, before round 1")
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=32, help="shared by a quarter each")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ratio", type=float, default=0.1, help="the sampled stack's ratio")
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument(
        "--model",
        default="tiny",
        help="the model every stack serves (tiny: the issue's; smollm2: a real one)",
    )
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--aa",
        action="store_true",
        help="the control: three untraced stacks in the traced stacks' places (the noise floor, "
        "and any bias of a stack's place), judged against the same targets",
    )
    parser.add_argument("--json", type=Path, help="write every run here")
    parser.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="run nothing: the rounds of these earlier runs' --json files judged together",
    )
    parser.add_argument("--serve-receiver", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_receiver:
        serve_receiver(args.serve_receiver)
        return 0
    if args.pool:
        print(pooled(args.pool))
        return 0

    prompts = workload(args)
    load = os.getloadavg()[0]
    started_at = time.time()
    with stacks(args) as started:
        for stack in started:  # warm up: the first requests pay for imports and allocations
            for _ in range(args.warmup_runs):
                asyncio.run(drive(stack.url, prompts, args))
        time.sleep(SETTLE_S)  # the warm-ups' spans exported before the first round
        orders = list(itertools.permutations(range(3)))  # each stack in each place alike
        for n in range(args.rounds):
            for position, index in enumerate(orders[n % len(orders)]):
                stack = started[index]
                run = measure(stack, prompts, args, n + 1, position)
                print(
                    f"round {n + 1} {stack.name:>8}: {run.tok_s:8.1f} tok/s "
                    f"(load {run.load_average:.2f})",
                    flush=True,
                )
        per_request = started[1].receiver.stats()["per_request"] if started[1].receiver else []
    off, on, ratio = started
    name = ratio.name
    loads = [run.load_average for stack in started for run in stack.runs]
    rows = []
    for n in range(args.rounds):
        runs = (off.runs[n], on.runs[n], ratio.runs[n])
        rows.append(
            [n + 1, *(r.tok_s for r in runs),
             f"{runs[1].tok_s / runs[0].tok_s:.3f}", f"{runs[2].tok_s / runs[0].tok_s:.3f}",
             *(f"{r.cpu_ms_per_token:.3f}" for r in runs),
             *(f"{r.spans} ({r.step_spans})" for r in runs[1:]), f"{runs[0].load_average:.2f}"]
        )  # fmt: skip
    print()
    table = format_table(
            ["round", "off tok/s", f"{on.name} tok/s", f"{name} tok/s", f"{on.name} / off",
             f"{name} / off", "off CPU ms/tok", f"{on.name} CPU ms/tok", f"{name} CPU ms/tok",
             f"spans {on.name} (steps)", f"spans {name} (steps)", "load"],
            rows,
            title=f"tracing cost: {args.requests} requests, {args.concurrency} concurrent, "
            f"{args.prompt_len}-token prompts, {args.max_tokens} tokens each, model {args.model}, CPU "
            f"(load average {load:.2f} at start, {os.getloadavg()[0]:.2f} at the end, "
            f"{min(loads):.2f}-{max(loads):.2f} as the runs started, "
            f"{(time.time() - started_at) / 60:.1f} min)",
    )  # fmt: skip
    print(table)
    roles = sorted({r for stack in started for run in stack.runs for r in run.cpu_s})
    cpu_rows = [
        [stack.name]
        + [statistics.median(run.cpu_s.get(r, 0.0) for run in stack.runs) for r in roles]
        for stack in started
    ]
    print()
    table = format_table(
        ["stack", *[f"{r} CPU s" for r in roles]], cpu_rows,
        title="median CPU seconds per run, by process",
    )  # fmt: skip
    print(table)

    summary, results = judge(
        [
            (stack.name, stack.runs, target)
            for stack, target in zip((on, ratio), TARGETS, strict=True)
        ],
        off.runs,
    )
    spans_median = statistics.median(per_request) if per_request else 0
    isolated_us = isolated_span_cost()
    off_cpu_per_request_ms = statistics.median(
        1000 * sum(run.cpu_s.values()) / args.requests for run in off.runs
    )
    estimate = 1 / (1 + isolated_us / 1000 / off_cpu_per_request_ms)
    if not args.aa:  # the control traces nothing: no spans to count or estimate
        summary.append(
            ["on 1.0 / off, CPU estimate from the spans' cost in isolation", f"{estimate:.3f}x",
             "", f"{isolated_us:.0f} us a request / {off_cpu_per_request_ms:.1f} ms",
             f">= {TARGET_ON}x", "met" if estimate >= TARGET_ON else "not met"]
        )  # fmt: skip
        summary.append(
            ["spans per request", spans_median, "",
             f"{min(per_request, default=0)}-{max(per_request, default=0)}",
             f"<= {TARGET_SPANS}", "met" if spans_median <= TARGET_SPANS else "not met"]
        )  # fmt: skip
    print()
    table = format_table(
        ["measure", "median", "95% CI", "range", "target", "verdict"], summary,
        title=f"{args.rounds} rounds; {len(per_request)} request traces in the last sampling-1.0 "
        "run; met: the interval clears the target, not met: it lies below, else not resolved",
    )  # fmt: skip
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "load_average": load,
                    "load_average_end": os.getloadavg()[0],
                    "load_average_runs": [min(loads), max(loads)],
                    "minutes": (time.time() - started_at) / 60,
                    "settle_s": SETTLE_S,
                    "summary": results,
                    "isolated_span_cost_us": isolated_us,
                    "runs": {s.name: [vars(r) for r in s.runs] for s in started},
                    "spans_per_request": per_request,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
