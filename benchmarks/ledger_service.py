"""The ledger service's own cost per step: `kvledger ledger` (a real process) over a real
redis-server, stepped by a null worker that answers every step at once with token 1 for each
scheduled request, so the step period is the ledger's time plus the Redis round trips.

At 64 / 256 / 1,000 running requests (all decoding, short distinct prompts, prefix caching on,
KV events published, GC as in production) it reports per step: the wall period (median, p99)
and the ledger process's CPU (utime + stime from /proc over the window). Each size runs under
three set-ups, interleaved per repetition: the default (uvloop + hiredis), and the baseline from
before aaea583 (KVLEDGER_EVENT_LOOP=asyncio, redis-py's pure-Python parser), plus uvloop without
hiredis. Targets (issue 12): <= 1 / 2 / 5 ms per step.

`--zmq` compares the default set-up with KV events also published over ZMQ as vLLM publishes them
(`--kv-events-config` with a replay socket; one subscriber in this process reads every batch),
interleaved, at the sizes given (issue 26's target: <= +5% step time at 1,000 running).
`--tier` compares it with the CPU tier on (`--kv-offloading-size`, room for every prompt block;
the null worker reports every copy done), interleaved (issue 25's target: <= +10% at 1,000).

    python benchmarks/ledger_service.py [--repeats 3] [--json benchmarks/results/ledger_service.json]
    python benchmarks/ledger_service.py --zmq --sizes 1000 [--staggered]
    python benchmarks/ledger_service.py --tier --sizes 1000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.startup import freeze_after_startup  # noqa: E402
from services.transport import redis_streams, registry  # noqa: E402
from services.transport.keys import StreamNames  # noqa: E402
from services.transport.redis_server import RedisServer  # noqa: E402
from services.wire.codec import decode, encode  # noqa: E402
from services.wire.messages import (  # noqa: E402
    GenerateRequest,
    SamplingParams,
    StepMessage,
    StepResult,
    WorkerHello,
)

SETUPS = {  # name -> (KVLEDGER_EVENT_LOOP, hiredis importable, KV events over ZMQ too)
    "uvloop+hiredis": ("uvloop", True, False),
    "asyncio+python-parser": ("asyncio", False, False),
    "uvloop+python-parser": ("uvloop", False, False),
    "uvloop+hiredis+zmq": ("uvloop", True, True),
    "uvloop+hiredis+tier": ("uvloop", True, False),
}
ZMQ_SETUPS = ["uvloop+hiredis", "uvloop+hiredis+zmq"]  # --zmq: off (the baseline) and on
TIER_SETUPS = ["uvloop+hiredis", "uvloop+hiredis+tier"]  # --tier: off (the baseline) and on
BASELINE = "asyncio+python-parser"
TARGET_MS = {64: 1.0, 256: 2.0, 1000: 5.0}
PROMPT_LEN, MAX_MODEL_LEN, BLOCK_SIZE, VOCAB = 32, 1024, 16, 32_000
# Runs `kvledger ledger`, with hiredis hidden from redis-py when asked (its parser then falls
# back to the pure-Python one, as on an install without hiredis).
LEDGER_MAIN = (
    "import sys\n"
    "if sys.argv[1] == '0': sys.modules['hiredis'] = None\n"
    "from kvledger.cli import main\n"
    "import os, cProfile\n"
    "if not os.environ.get('BENCH_PROFILE'): sys.exit(main(['ledger', *sys.argv[2:]]))\n"
    "cProfile.run('main([\"ledger\", *sys.argv[2:]])', os.environ['BENCH_PROFILE'])\n"
)
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


async def null_worker(
    r, streams: StreamNames, hello: WorkerHello, want: int, steps: int, marks: dict
) -> list[float]:
    """Answer every step at once; from the first step where `want` requests all decode, skip
    20, then time `steps` steps: their arrival times, and the ledger's CPU at the first one."""
    stream, group = streams.steps("default"), "worker:null"
    # As the real worker does after start-up: without it this process's own full collections
    # (~30 ms over its imports) delayed its answers and made the p99 gap, not the ledger.
    freeze_after_startup()
    await r.xgroup_create(stream, group, id="$", mkstream=True)
    beat = asyncio.create_task(heartbeat(r, streams, hello))
    arrivals: list[float] = []
    decoding_since = None
    known: dict[str, int] = {}  # req_id -> tokens this worker knows (prompt + sampled)
    computed: dict[str, int] = {}
    pending: list = []
    while len(arrivals) < steps:
        if not pending:
            reply = await r.xreadgroup(group, "null", {stream: ">"}, count=4, block=1000)
            pending = [e for _, items in reply for e in items]
            continue
        entry_id, fields = pending.pop(0)
        step = decode(fields[redis_streams.FIELD])
        assert isinstance(step, StepMessage)
        n = step.num_scheduled_tokens
        if decoding_since is None and len(n) == want and sum(n.values()) == want:
            decoding_since = step.step_id
        if decoding_since is not None and step.step_id >= decoding_since + 20:
            arrivals.append(time.perf_counter())
            if len(arrivals) == 1:
                marks["cpu0"] = cpu_seconds(marks["pid"])
        transfers = step.kv_transfers
        done = None
        if transfers is not None:  # every copy of the CPU tier, done at once
            done = [job.job_id for job in (*transfers.loads, *transfers.stores)]
        result = StepResult(step_id=step.step_id, epoch=step.epoch, worker_id=hello.worker_id,
                            sampled_token_ids=null_step(step, known, computed),
                            leader_token=step.leader_token, transfers_done=done)  # fmt: skip
        async with r.pipeline(transaction=False) as pipe:
            pipe.xadd(streams.results, {redis_streams.FIELD: encode(result)}, maxlen=10_000,
                      approximate=True)  # fmt: skip
            pipe.xack(stream, group, entry_id)
            if not pending:
                pipe.xreadgroup(group, "null", {stream: ">"}, count=4)
            replies = await pipe.execute()
        if not pending and replies[-1]:
            pending = [e for _, items in replies[-1] for e in items]
    beat.cancel()
    return arrivals


def null_step(step: StepMessage, known: dict[str, int], computed: dict[str, int]) -> dict:
    """Token 1 for every request whose chunk reaches the end of its known tokens, keeping the
    counts a worker keeps (gpu_worker.runner): a prefill chunk that stops short samples none."""
    for req_id in (*step.finished_req_ids, *step.preempted_req_ids):
        known.pop(req_id, None)
        computed.pop(req_id, None)
    for new in step.new_reqs:
        known[new.req_id], computed[new.req_id] = len(new.token_ids), new.num_computed_tokens
    for cached in step.cached_reqs:
        known[cached.req_id] += len(cached.new_token_ids)
        computed[cached.req_id] = cached.num_computed_tokens
    sampled = {}
    for req_id, num_tokens in step.num_scheduled_tokens.items():
        computed[req_id] += num_tokens
        if computed[req_id] == known[req_id]:
            sampled[req_id] = 1
            known[req_id] += 1
    return sampled


async def heartbeat(r, streams: StreamNames, hello: WorkerHello) -> None:
    while True:
        await registry.register(r, streams, hello, 30.0)
        await asyncio.sleep(5)


class ZmqCounter:
    """One subscriber to the ledger's ZMQ output, counting batches and sequence gaps."""

    def __init__(self, port: int) -> None:
        import zmq

        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.batches = self.gaps = 0
        self.last: int | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sub.poll(100):
                continue
            _, seq_bytes, _ = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self.last is not None and seq != self.last + 1:
                self.gaps += 1
            self.last, self.batches = seq, self.batches + 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sub.close(linger=0)


async def one_run(
    url: str, size: int, setup: str, steps: int, staggered: bool = False, tree: Path = ROOT
) -> dict:
    """One run; `tree` is the checkout whose `kvledger ledger` runs (--baseline-tree)."""
    loop_name, hiredis, zmq_on = SETUPS[setup.removesuffix("@baseline")]
    streams = StreamNames(f"b{uuid.uuid4().hex[:8]}")
    r = redis_streams.connect(url)
    blocks = size * (MAX_MODEL_LEN // BLOCK_SIZE) + 16
    hello = WorkerHello(
        worker_id="null", group="default", num_gpu_blocks=blocks, block_size=BLOCK_SIZE,
        bytes_per_block=1, available_kv_bytes=blocks, model_name="null", max_model_len=MAX_MODEL_LEN,
        vocab_size=VOCAB, device="cpu", started_at=time.time(),
    )  # fmt: skip
    await registry.register(r, streams, hello, 60.0)
    marks: dict = {}
    worker = asyncio.create_task(null_worker(r, streams, hello, size, steps, marks))
    env = {**os.environ, "KVLEDGER_EVENT_LOOP": loop_name, "KVLEDGER_LOG_LEVEL": "warning",
           "PYTHONPATH": str(tree)}  # fmt: skip
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    args = ["--redis-url", url, "--stream-prefix", streams.prefix, "--max-num-seqs", str(size),
            "--max-num-batched-tokens", "8192", "--max-model-len", str(MAX_MODEL_LEN),
            "--block-size", str(BLOCK_SIZE), "--metrics-port", "0", "--worker-ttl-s", "60",
            "--snapshot-interval-s", "1"]  # fmt: skip
    counter = None
    if zmq_on:
        from services.transport.redis_server import free_port

        pub, replay = free_port(), free_port()
        args += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}",
            "replay_endpoint": f"tcp://*:{replay}"})]  # fmt: skip
        counter = ZmqCounter(pub)
    if setup.removesuffix("@baseline").endswith("+tier"):
        # bytes_per_block 1: a chunk is one 4 KiB page; room for every prompt block twice over.
        args += ["--kv-offloading-size", str(4 * size * PROMPT_LEN // BLOCK_SIZE * 4096 / 2**30)]
    ledger = subprocess.Popen([sys.executable, "-c", LEDGER_MAIN, "1" if hiredis else "0", *args],
                              cwd=tree, env=env)  # fmt: skip
    marks["pid"] = ledger.pid
    try:
        sampling = SamplingParams(max_tokens=MAX_MODEL_LEN - PROMPT_LEN - BLOCK_SIZE, seed=0)
        async with r.pipeline(transaction=False) as pipe:
            for i in range(size):
                # Equal prompts fill a block in the same step, every 16th step, all 1,000 of them
                # at once; staggered ones (32-47 tokens) fill 1/16 of them each step, as mixed
                # traffic does.
                length = PROMPT_LEN + (i % BLOCK_SIZE if staggered else 0)
                prompt = [(i * 7919 + j * 104729) % (VOCAB - 2) + 2 for j in range(length)]
                msg = GenerateRequest(req_id=f"r{i}", gateway_id="bench", prompt_token_ids=prompt,
                                      sampling=sampling, arrival_time=time.time())  # fmt: skip
                pipe.xadd(streams.requests, {redis_streams.FIELD: encode(msg)})
            await pipe.execute()
        while not worker.done():
            await asyncio.wait({worker}, timeout=1.0)
            if ledger.poll() is not None:
                raise RuntimeError(f"ledger exited with {ledger.returncode}")
        arrivals = worker.result()
        cpu1 = cpu_seconds(ledger.pid)
        published = await r.xlen(streams.events)
    finally:
        ledger.terminate()
        ledger.wait(10)
        await r.flushall()
        await r.aclose()
        if counter is not None:
            counter.close()
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    wall = arrivals[-1] - arrivals[0]
    return {"size": size, "setup": setup, "steps": len(gaps), "wall_ms": wall / len(gaps) * 1e3,
            "median_ms": statistics.median(gaps) * 1e3,
            "p99_ms": sorted(gaps)[int(0.99 * (len(gaps) - 1))] * 1e3,
            "cpu_ms": (cpu1 - marks["cpu0"]) / len(gaps) * 1e3, "batches": published,
            "zmq_received": None if counter is None else counter.batches,
            "zmq_gaps": None if counter is None else counter.gaps}  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1000])
    parser.add_argument("--setups", nargs="+", default=None, choices=list(SETUPS),
                        help="default: the three without ZMQ (with --zmq: "
                        f"{' and '.join(ZMQ_SETUPS)})")  # fmt: skip
    parser.add_argument("--zmq", action="store_true",
                        help="KV events over ZMQ off vs on (baseline: off)")  # fmt: skip
    parser.add_argument("--tier", action="store_true",
                        help="the CPU tier off vs on (baseline: off)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=300, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--staggered", action="store_true",
                        help="prompts of 32-47 tokens, so block fills spread over steps")  # fmt: skip
    parser.add_argument(
        "--baseline-tree", type=Path,
        help="another kvledger checkout (`git worktree add /tmp/base COMMIT`): each set-up also "
        "runs its ledger, interleaved, as SETUP@baseline",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.setups is None:
        args.setups = (
            ZMQ_SETUPS if args.zmq else TIER_SETUPS if args.tier
            else [k for k, v in SETUPS.items() if not v[2] and not k.endswith("+tier")]
        )  # fmt: skip
    baseline = ZMQ_SETUPS[0] if args.zmq or args.tier else BASELINE
    if args.baseline_tree:
        args.setups = [name for setup in args.setups for name in (setup, f"{setup}@baseline")]
    runs: list[dict] = []
    with RedisServer() as server:
        for rep in range(args.repeats):
            for size in args.sizes:
                for setup in args.setups:
                    tree = args.baseline_tree if setup.endswith("@baseline") else ROOT
                    run = asyncio.run(
                        one_run(server.url, size, setup, args.steps, args.staggered, tree)
                    )
                    runs.append({**run, "repeat": rep})
                    print(f"rep {rep} {size:>5} {setup:<22} wall {run['wall_ms']:.2f} ms/step "
                          f"(median {run['median_ms']:.2f}, p99 {run['p99_ms']:.2f}), "
                          f"ledger CPU {run['cpu_ms']:.2f} ms/step, {run['batches']} batches"
                          + ("" if run["zmq_received"] is None else
                             f", ZMQ received {run['zmq_received']} (gaps {run['zmq_gaps']})"),
                          flush=True)  # fmt: skip
    print(f"\nledger ms per step with a null worker, median of {args.repeats} interleaved "
          f"(min-max), GC on; baseline {baseline}; prompts "
          f"{'32-47 (staggered)' if args.staggered else '32'} tokens")  # fmt: skip
    print(f"{'running':>7} {'setup':<22} {'wall/step':>18} {'ledger CPU/step':>18} "
          f"{'p99 gap':>8} {'target':>7}")  # fmt: skip
    summary = []
    for size in args.sizes:
        for setup in args.setups:
            mine = [x for x in runs if x["size"] == size and x["setup"] == setup]
            cells = {}
            for key in ("wall_ms", "cpu_ms", "p99_ms"):
                vals = [x[key] for x in mine]
                cells[key] = (statistics.median(vals), min(vals), max(vals))
            summary.append({"size": size, "setup": setup, **cells})
            w, c = cells["wall_ms"], cells["cpu_ms"]
            print(f"{size:>7} {setup:<22} {w[0]:>6.2f} ({w[1]:.2f}-{w[2]:.2f}) "
                  f"{c[0]:>6.2f} ({c[1]:.2f}-{c[2]:.2f}) {cells['p99_ms'][0]:>8.2f} "
                  f"{TARGET_MS.get(size, float('nan')):>7.1f}")  # fmt: skip
    for size in args.sizes:
        base = next((x for x in summary if x["size"] == size and x["setup"] == baseline), None)
        for row in summary:
            if base is None or row["size"] != size or row is base:
                continue
            print(f"{size:>7} {row['setup']:<22} vs {baseline}: wall "
                  f"{(row['wall_ms'][0] / base['wall_ms'][0] - 1) * 100:+.1f}%, ledger CPU "
                  f"{(row['cpu_ms'][0] / base['cpu_ms'][0] - 1) * 100:+.1f}%")  # fmt: skip
    if args.json:
        machine = {"python": sys.version.split()[0], "cpus": os.cpu_count(),
                   "loadavg": os.getloadavg()}  # fmt: skip
        report = {"summary": summary, "runs": runs, "machine": machine,
                  "staggered": args.staggered}  # fmt: skip
        args.json.write_text(json.dumps(report,
                                        indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
