"""Load on the default stack: N requests at C concurrent, every one accounted for.

    python benchmarks/load.py [--requests 1024] [--concurrency 512] [--json benchmarks/results/load.json]

Starts `kvledger up --model tiny` (private redis-server, the tiny seeded Llama, max_queue
512), sends a seeded workload (prompts sharing a few long prefixes, streaming and non-streaming
mixed) closed-loop at C concurrent, and counts every outcome: a 200 with a whole answer (a
stream must end in [DONE] without an error event), every other status by status and message,
errors inside a stream, dropped connections, and hangs (a request still open after
--deadline-s). It reports p50/p99 latency (all answered requests) and time to first token (the
streaming ones), and the resident memory (/proc/<pid>/status) of the gateway, the ledger and the
worker before the load, at its peak (VmHWM) and after it, and the ledger's blocks in use after.

The named baseline, interleaved in the same run on the same stack, is the same workload at
`--baseline-concurrency` (default 64: the scheduler's max_num_seqs, and under redis-py's
default pool of 100 connections), so that what only high concurrency causes stands out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvledger.report import format_table, now_stamp, write_json  # noqa: E402
from services.transport.redis_server import free_port  # noqa: E402

WORDS = ["cache", "block", "page", "token", "prefix", "ledger", "worker", "stream",
         "scheduler", "request", "gateway", "attention", "decode", "prefill", "hash", "evict",
         "free", "queue", "step", "epoch", "replica"]  # fmt: skip
ROLES = ("gateway", "ledger", "worker")


@dataclass
class Item:
    prompt: str
    max_tokens: int
    stream: bool


@dataclass
class Outcome:
    ok: bool
    stream: bool
    latency_s: float
    ttft_s: float | None = None
    tokens: int = 0
    error: str = ""  # what went wrong, grouped by this text


def make_workload(args: argparse.Namespace, seed: int) -> list[Item]:
    rng = random.Random(seed)
    prefixes = [
        " ".join(rng.choice(WORDS) for _ in range(args.prefix_words)) for _ in range(args.prefixes)
    ]
    items = []
    for i in range(args.requests):
        body = " ".join(rng.choice(WORDS) for _ in range(max(2, int(rng.expovariate(1 / 12)))))
        prefix = rng.choice(prefixes) if prefixes else ""
        max_tokens = max(1, min(4 * args.output_mean, int(rng.expovariate(1 / args.output_mean))))
        items.append(Item(f"{prefix} #{i}: {body}", max_tokens, rng.random() < args.stream_share))
    return items


# ---------------------------------------------------------------- the stack and its memory


class Stack:
    """`kvledger up` with its defaults, on free ports; what it prints is kept for the report."""

    def __init__(self, up_args: list[str]) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        env = dict(os.environ, KVLEDGER_LOG_LEVEL="warning", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "kvledger.cli", "up", "--model", "tiny", "--port", str(self.port),
               "--metrics-port", str(self.metrics_port), *up_args]  # fmt: skip
        self.command = " ".join(["kvledger", *cmd[3:]])
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
        self.lines: list[str] = []
        self.serving = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + 300
        while not self.serving.wait(0.2) and self.proc.poll() is None:
            if time.monotonic() > deadline:
                break
        if not self.serving.is_set():
            self.stop()
            raise RuntimeError("kvledger up did not serve:\n" + "".join(self.lines[-30:]))
        self.url = f"http://127.0.0.1:{self.port}"
        self.ledger_metrics = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.pids = self._children()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "Press Ctrl-C" in line:
                self.serving.set()

    def _children(self) -> dict[str, int]:
        out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(self.proc.pid)],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        pids = {}
        for line in out.splitlines():
            pid, _, argv = line.strip().partition(" ")
            parts = argv.split()
            if "kvledger.cli" in parts:
                pids[parts[parts.index("kvledger.cli") + 1]] = int(pid)
        return pids

    def memory(self) -> dict[str, dict[str, float]]:
        """MiB resident now (VmRSS) and at the process's peak so far (VmHWM), per role."""
        out = {}
        for role in ROLES:
            fields = {}
            with open(f"/proc/{self.pids[role]}/status") as status:
                for line in status:
                    key, _, value = line.partition(":")
                    if key in ("VmRSS", "VmHWM"):
                        fields[key] = int(value.split()[0]) / 1024
            out[role] = {"rss_mib": fields["VmRSS"], "peak_mib": fields["VmHWM"]}
        return out

    def restarts(self) -> list[str]:
        return [line.strip() for line in self.lines if "restarting it" in line]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


def ledger_gauges(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    wanted = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


# ---------------------------------------------------------------- the load


async def one(session, url: str, item: Item, deadline_s: float) -> Outcome:
    import aiohttp

    body = {"prompt": item.prompt, "max_tokens": item.max_tokens, "stream": item.stream,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    start = time.perf_counter()
    out = Outcome(False, item.stream, 0.0)

    async def run() -> None:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                text = await resp.text()
                try:
                    message = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = text
                out.error = f"HTTP {resp.status}: {_short(message)}"
                return
            if not item.stream:
                data = await resp.json()
                out.tokens = data["usage"]["completion_tokens"]
                out.ok = True
                return
            done = False
            async for raw in resp.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done = True
                    continue
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = f"stream error: {_short(str(chunk['error'].get('message')))}"
                    return
                new = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
                if new and out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - start
                out.tokens += new
            out.ok = done
            if not done:
                out.error = "stream ended without [DONE]"

    try:
        await asyncio.wait_for(run(), deadline_s)
    except TimeoutError:
        out.ok, out.error = False, f"hang: no end within {deadline_s:.0f}s"
    except (aiohttp.ClientError, OSError) as exc:
        out.ok, out.error = False, f"{type(exc).__name__}: {_short(str(exc))}"
    out.latency_s = time.perf_counter() - start
    if out.ok and not item.stream:
        out.ttft_s = None  # a non-streamed answer has no first token to time
    return out


def _short(text: str) -> str:
    # Request ids and counts differ per request: keep the text short enough to group by.
    return " ".join(text.split())[:90]


async def drive(url: str, items: list[Item], concurrency: int, deadline_s: float):
    import aiohttp

    semaphore = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def bounded(item: Item) -> Outcome:
            async with semaphore:
                return await one(session, url, item, deadline_s)

        started = time.perf_counter()
        outcomes = await asyncio.gather(*(bounded(i) for i in items))
        return list(outcomes), time.perf_counter() - started


@dataclass
class Run:
    name: str
    concurrency: int
    requests: int
    wall_s: float
    ok: int
    errors: dict[str, int]
    hangs: int
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    output_tok_s: float
    memory_before: dict = field(default_factory=dict)
    memory_after: dict = field(default_factory=dict)
    ledger_after: dict = field(default_factory=dict)

    def row(self) -> list:
        return [self.name, self.concurrency, self.requests, self.ok,
                sum(self.errors.values()) - self.hangs, self.hangs,
                _f(self.latency_p50_ms), _f(self.latency_p99_ms), _f(self.ttft_p50_ms),
                _f(self.ttft_p99_ms), round(self.output_tok_s, 1), round(self.wall_s, 1)]  # fmt: skip


def _f(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:,.0f}"


def pct(values: list[float], p: int) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))]


def measure(stack: Stack, name: str, items: list[Item], concurrency: int, deadline_s: float):
    before = stack.memory()
    outcomes, wall = asyncio.run(drive(stack.url, items, concurrency, deadline_s))
    time.sleep(2.0)  # the ledger frees the last requests' blocks after their final output
    errors = Counter(o.error for o in outcomes if not o.ok)
    ok = [o for o in outcomes if o.ok]
    return Run(
        name, concurrency, len(items), wall, len(ok), dict(errors.most_common()),
        sum(1 for o in outcomes if o.error.startswith("hang")),
        pct([o.latency_s for o in ok], 50), pct([o.latency_s for o in ok], 99),
        pct([o.ttft_s for o in ok if o.ttft_s is not None], 50),
        pct([o.ttft_s for o in ok if o.ttft_s is not None], 99),
        sum(o.tokens for o in ok) / wall, before, stack.memory(), ledger_gauges(stack.ledger_metrics),
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=512)
    parser.add_argument("--baseline-concurrency", type=int, default=64, help="0: no baseline")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of (load, baseline)")
    parser.add_argument("--stream-share", type=float, default=0.5)
    parser.add_argument("--prefixes", type=int, default=8, help="shared prompt prefixes")
    parser.add_argument("--prefix-words", type=int, default=64)
    parser.add_argument("--output-mean", type=int, default=16)
    parser.add_argument("--deadline-s", type=float, default=300.0, help="past this: a hang")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--up-arg", action="append", default=[], help="extra `kvledger up` flag")
    args = parser.parse_args()

    stack = Stack(args.up_arg)
    runs: list[Run] = []
    try:
        print(f"stack: {stack.command} (pids {stack.pids})", flush=True)
        warm = make_workload(argparse.Namespace(**{**vars(args), "requests": 8}), args.seed + 999)
        asyncio.run(drive(stack.url, warm, 8, args.deadline_s))  # imports, first allocations
        start_memory = stack.memory()
        for r in range(args.repeats):
            items = make_workload(args, args.seed + r)
            plan = [(f"load C={args.concurrency}", args.concurrency)]
            if args.baseline_concurrency:
                plan.append((f"baseline C={args.baseline_concurrency}", args.baseline_concurrency))
            for name, concurrency in plan if r % 2 == 0 else plan[::-1]:
                run = measure(stack, name, items, concurrency, args.deadline_s)
                runs.append(run)
                print(f"  round {r + 1}, {name}: {run.ok}/{run.requests} ok, errors "
                      f"{run.errors or 0}, {run.wall_s:.1f}s", flush=True)  # fmt: skip
        end_memory = stack.memory()
        restarts = stack.restarts()
    finally:
        stack.stop()

    header = ["run", "C", "requests", "ok", "errors", "hangs", "latency p50 ms",
              "latency p99 ms", "TTFT p50 ms", "TTFT p99 ms", "output tok/s", "wall s"]  # fmt: skip
    print()
    print(format_table(header, [run.row() for run in runs]))
    print()
    mem_rows = [[role, round(start_memory[role]["rss_mib"], 1),
                 round(end_memory[role]["peak_mib"], 1), round(end_memory[role]["rss_mib"], 1),
                 round(end_memory[role]["rss_mib"] - start_memory[role]["rss_mib"], 1)]
                for role in ROLES]  # fmt: skip
    print(format_table(["process", "RSS before MiB", "peak MiB", "RSS after MiB", "growth MiB"],
                       mem_rows))  # fmt: skip
    for run in runs:
        for error, count in run.errors.items():
            print(f"  {run.name}: {count} x {error}")
    print(f"ledger after the last run: {runs[-1].ledger_after}")
    print(f"service restarts during the run: {restarts or 'none'}")
    if args.json:
        write_json(args.json, {
            "when": now_stamp(), "command": "python benchmarks/load.py " + " ".join(sys.argv[1:]),
            "stack": stack.command, "args": vars(args), "memory_before": start_memory,
            "memory_after": end_memory, "restarts": restarts, "runs": [asdict(r) for r in runs],
        })  # fmt: skip
    failed = sum(sum(run.errors.values()) for run in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
