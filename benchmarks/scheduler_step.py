"""One scheduler step at 1,000 running requests / 100k blocks: the ledger's Scheduler vs vLLM 0.33's.

Both sides run the same loop (this file; vLLM's side in its own venv, a subprocess per
repetition, sides and GC modes interleaved): two steps in flight as the service schedules
(vLLM's AsyncScheduler), every sampled token returned at once, each finished request replaced
by a new one so that the load stays put. A step is `schedule()` plus `update_from_output()` of
the step before; building the worker's reply and new requests is not timed. GC runs as in
production; `gc.callbacks` count the ms it takes inside the timed calls. The `freeze` mode calls
`gc.freeze()` once the scheduler is built, as the services do after start-up.

Scenarios: `plain` (1,000 requests of 512-token prompts: no preemption) and `pressure` (1,100
requests of 1,600-token prompts in 100k blocks: preemptions every few steps).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS: dict[str, dict[str, int]] = {
    "plain": {"num_requests": 1000, "prompt_len": 512, "max_num_seqs": 1000},
    "pressure": {"num_requests": 1100, "prompt_len": 1600, "max_num_seqs": 1000},
}
NUM_BLOCKS = 100_000
TOKEN = 1  # every sampled token: never EOS (7), never a stop token


def config(scenario: str) -> dict[str, Any]:
    s = SCENARIOS[scenario]
    return {
        "seed": 0,
        "hash_algo": "sha256",
        "none_hash_seed": None,
        "block_size": 16,
        "num_blocks": NUM_BLOCKS,
        "max_model_len": 4096,
        "max_num_seqs": s["max_num_seqs"],
        "max_num_batched_tokens": 8192,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
        "async_scheduling": True,
        "watermark": 0.0,
        "long_prefill_token_threshold": 0,
        "policy": "fcfs",
    }


def request_specs(scenario: str, count: int) -> list[dict[str, Any]]:
    """Distinct prompts (a shared 64-token system prefix), output lengths spread over 64-448."""
    rng = random.Random(12)
    prefix = [rng.randrange(100, 30000) for _ in range(64)]
    length = SCENARIOS[scenario]["prompt_len"] - len(prefix)
    return [
        {
            "rid": f"r{i}",
            "prompt": prefix + [rng.randrange(100, 30000) for _ in range(length)],
            "max_tokens": rng.randrange(64, 448),
            "min_tokens": 0,
            "stop_token_ids": [],
            "priority": 0,
            "salt": None,
        }
        for i in range(count)
    ]


# ---------------------------------------------------------------- the two sides (child process)


class Ours:
    def __init__(self, cfg: dict[str, Any]) -> None:
        sys.path.insert(0, str(ROOT))
        from tests.oracle.sched_trace import LedgerScheduler

        self.backend = LedgerScheduler(cfg)
        self.scheduler = self.backend.scheduler

    def add(self, spec: dict[str, Any], index: int) -> None:
        self.backend.add(spec, index)

    def schedule(self) -> Any:
        return self.scheduler.schedule()

    def sampling(self, out: Any) -> list[str]:
        return list(out.sampling_req_ids)

    def reply(self, out: Any, sampling: list[str]) -> Any:
        return dict.fromkeys(sampling, TOKEN)

    def update(self, out: Any, reply: Any) -> int:
        return sum(u.finished for u in self.scheduler.update_from_output(out, reply))

    def counts(self) -> tuple[int, int]:
        return len(self.scheduler.running), self.scheduler.num_preemptions


class Theirs:
    def __init__(self, cfg: dict[str, Any], model_dir: str) -> None:
        sys.path.insert(0, str(ROOT / "tests" / "oracle"))
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm_sched_driver import VllmScheduler

        self.output_type = ModelRunnerOutput
        self.backend = VllmScheduler(cfg, model_dir)
        self.scheduler = self.backend.scheduler
        self.num_preemptions = 0

    def add(self, spec: dict[str, Any], index: int) -> None:
        self.backend.add(spec, index)

    def schedule(self) -> Any:
        return self.scheduler.schedule()

    def sampling(self, out: Any) -> list[str]:
        self.num_preemptions += len(out.preempted_req_ids or ())
        requests = self.scheduler.requests
        return [r for r in out.num_scheduled_tokens if not requests[r].is_prefill_chunk]

    def reply(self, out: Any, sampling: list[str]) -> Any:
        req_ids = list(out.num_scheduled_tokens)
        chosen = set(sampling)
        return self.output_type(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[[TOKEN] if rid in chosen else [] for rid in req_ids],
        )

    def update(self, out: Any, reply: Any) -> int:
        outputs = self.scheduler.update_from_output(out, reply)
        return sum(o.finish_reason is not None for c in outputs.values() for o in c.outputs)

    def counts(self) -> tuple[int, int]:
        return len(self.scheduler.running), self.num_preemptions


def run_side(side: str, scenario: str, gc_mode: str, steps: int) -> dict[str, Any]:
    cfg = config(scenario)
    num_requests = SCENARIOS[scenario]["num_requests"]
    specs = request_specs(scenario, num_requests + 40 * steps)
    model_dir = tempfile.mkdtemp()
    if side == "vllm":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        from vllm_sched_driver import TINY_LLAMA  # type: ignore[import-not-found]

        Path(model_dir, "config.json").write_text(json.dumps(TINY_LLAMA))
        sched: Any = Theirs(cfg, model_dir)
    else:
        sched = Ours(cfg)
    if gc_mode == "freeze":
        gc.collect()
        gc.freeze()

    gc_ms = 0.0
    gc_full = 0
    timing = False
    started = 0.0

    def on_gc(phase: str, info: dict[str, int]) -> None:
        nonlocal gc_ms, gc_full, started
        if not timing:
            return
        if phase == "start":
            started = time.perf_counter()
        else:
            gc_ms += (time.perf_counter() - started) * 1e3
            gc_full += info["generation"] == 2

    gc.callbacks.append(on_gc)
    next_spec = 0
    for _ in range(num_requests):
        sched.add(specs[next_spec], next_spec)
        next_spec += 1
    in_flight: deque[tuple[Any, list[str]]] = deque()
    step_ms: list[float] = []
    gc_per_step: list[float] = []
    running: list[int] = []
    warmup = True
    while len(step_ms) < steps:
        gc_before = gc_ms
        timing = True
        t0 = time.perf_counter()
        out = sched.schedule()
        elapsed = time.perf_counter() - t0
        timing = False
        in_flight.append((out, sched.sampling(out)))
        finished = 0
        if len(in_flight) == 2:
            done, sampling = in_flight.popleft()
            reply = sched.reply(done, sampling)
            timing = True
            t0 = time.perf_counter()
            finished = sched.update(done, reply)
            elapsed += time.perf_counter() - t0
            timing = False
        for _ in range(finished):
            sched.add(specs[next_spec], next_spec)
            next_spec += 1
        num_running, _ = sched.counts()
        if warmup:
            # Timing starts once the first wave is admitted and decoding.
            warmup = num_running < min(num_requests, cfg["max_num_seqs"]) * 0.95
            gc_ms = 0.0
            gc_full = 0
            preempted_at_start = sched.counts()[1]
            continue
        step_ms.append(elapsed * 1e3)
        gc_per_step.append(gc_ms - gc_before)
        running.append(num_running)
    gc.callbacks.remove(on_gc)
    return {
        "step_ms": step_ms,
        "gc_ms": gc_per_step,
        "gc_full": gc_full,
        "mean_running": statistics.fmean(running),
        "preemptions": sched.counts()[1] - preempted_at_start,
    }


# ---------------------------------------------------------------- the parent


def child(
    python: str, side: str, scenario: str, gc_mode: str, steps: int, script: str = __file__
) -> dict[str, Any]:
    """One repetition in a fresh process; `script` is this file of the tree to time (another
    checkout's with --baseline-tree: its ROOT is then that checkout)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        tree = Path(script).resolve().parent.parent
        env = dict(os.environ, PYTHONPATH=str(tree / "tests" / "oracle"))
        command = [python, "-P", script, "--child", side, scenario, gc_mode, str(steps), f.name]
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise SystemExit(f"{side} {scenario} {gc_mode} failed:\n{done.stderr[-3000:]}")
        return json.loads(Path(f.name).read_text())


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [ms for r in runs for ms in r["step_ms"]]
    gcs = [ms for r in runs for ms in r["gc_ms"]]
    medians = [statistics.median(r["step_ms"]) for r in runs]
    return {
        "median_ms": statistics.median(medians),
        "median_spread_ms": [min(medians), max(medians)],
        "mean_ms": statistics.fmean(steps),
        "p99_ms": p99(steps),
        "max_ms": max(steps),
        "gc_ms_per_step": statistics.fmean(gcs),
        "gc_full_per_1k_steps": 1000 * sum(r["gc_full"] for r in runs) / len(steps),
        "mean_running": statistics.fmean(r["mean_running"] for r in runs),
        "preemptions_per_step": sum(r["preemptions"] for r in runs) / len(steps),
        "steps": len(steps),
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        side, scenario, gc_mode, steps, target = sys.argv[2:7]
        Path(target).write_text(json.dumps(run_side(side, scenario, gc_mode, int(steps))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-venv", default=os.environ.get("KVLEDGER_VLLM_ORACLE"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--scenarios", default="plain,pressure")
    parser.add_argument("--gc-modes", default="on,freeze")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/scheduler_step.json"))
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="another kvledger checkout (e.g. `git worktree add /tmp/base <commit>`) timed as a "
        "third side, interleaved: kvledger / baseline is printed beside kvledger / vLLM",
    )
    args = parser.parse_args()
    sides = {"kvledger": (sys.executable, __file__)}
    if args.vllm_venv:
        sides["vllm"] = (str(Path(args.vllm_venv) / "bin" / "python"), __file__)
    if args.baseline_tree:
        sides["baseline"] = (
            sys.executable,
            str(args.baseline_tree / "benchmarks" / Path(__file__).name),
        )
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for rep in range(args.reps):
        for scenario in args.scenarios.split(","):
            order = list(sides)[rep % len(sides) :] + list(sides)[: rep % len(sides)]
            for gc_mode in args.gc_modes.split(","):
                for side in order:
                    which = "vllm" if side == "vllm" else "ours"
                    python, script = sides[side]
                    result = child(python, which, scenario, gc_mode, args.steps, script)
                    runs.setdefault((scenario, gc_mode, side), []).append(result)
                    print(f"rep {rep} {scenario} gc={gc_mode} {side}: "
                          f"median {statistics.median(result['step_ms']):.2f} ms", flush=True)  # fmt: skip
    table = {f"{s}/{g}/{side}": summarize(r) for (s, g, side), r in runs.items()}
    print(f"\n{'scenario/gc/side':<28} {'median':>8} {'mean':>8} {'p99':>8} {'max':>8} "
          f"{'gc/step':>8} {'full/1k':>8} {'preempt':>8} {'running':>8}")  # fmt: skip
    for key, s in table.items():
        print(f"{key:<28} {s['median_ms']:8.2f} {s['mean_ms']:8.2f} {s['p99_ms']:8.2f} "
              f"{s['max_ms']:8.2f} {s['gc_ms_per_step']:8.3f} {s['gc_full_per_1k_steps']:8.1f} "
              f"{s['preemptions_per_step']:8.2f} {s['mean_running']:8.0f}")  # fmt: skip
    ratios = {}
    for scenario in args.scenarios.split(","):
        for gc_mode in args.gc_modes.split(","):
            ours, theirs = (
                table.get(f"{scenario}/{gc_mode}/kvledger"),
                table.get(f"{scenario}/{gc_mode}/vllm"),
            )
            if ours and theirs:
                ratio = {k: ours[k] / theirs[k] for k in ("median_ms", "mean_ms", "p99_ms")}
                ratios[f"{scenario}/{gc_mode}"] = ratio
                print(f"{scenario}/{gc_mode}: kvledger / vLLM  median {ratio['median_ms']:.2f}x  "
                      f"mean {ratio['mean_ms']:.2f}x  p99 {ratio['p99_ms']:.2f}x")  # fmt: skip
            base = table.get(f"{scenario}/{gc_mode}/baseline")
            if ours and base:
                ratio = {k: ours[k] / base[k] for k in ("median_ms", "mean_ms", "p99_ms")}
                ratios[f"{scenario}/{gc_mode}/vs_baseline"] = ratio
                print(f"{scenario}/{gc_mode}: kvledger / baseline  median "
                      f"{ratio['median_ms']:.3f}x  mean {ratio['mean_ms']:.3f}x  "
                      f"p99 {ratio['p99_ms']:.3f}x")  # fmt: skip
    meta = {"reps": args.reps, "steps": args.steps, "num_blocks": NUM_BLOCKS}
    meta["gc_modes"] = {"on": "GC as in production", "freeze": "gc.freeze() after start-up"}
    Path(args.out).write_text(json.dumps({**meta, "results": table, "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
