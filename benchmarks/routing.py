"""Cache-aware routing at scale, by simulation: every policy on the same multi-tenant trace.

The real ledger core of each replica (KVCacheManager + Scheduler) runs in one process under a
step-time model (tests/harness/routing_sim.py); the router is services/routing/policy.py, the same code the
gateway uses. For 8, 16 and 64 replicas and round_robin, least_loaded, approx, precise and the
oracle: prefill tokens computed, prefix hit rate, TTFT p50/p99 and output throughput, both over
the makespan (first arrival to last finish: the trace's head and tail included) and over the
saturated window (the longest stretch with every replica busy: `saturated_window` in
tests/harness/routing_sim.py; `saturated_from_s`/`saturated_s` say where and how long). Then the
router restart at 8 replicas: the hit rate of the 200 requests routed after a mid-run restart,
against the same 200 requests in the run without a restart.

The simulation is deterministic (the trace is replayed from its seed and nothing is timed on the
wall clock), so one run per cell is the figure: repetitions would give identical numbers.

    .venv/bin/python benchmarks/routing.py            # writes benchmarks/results/routing.{json,md,png}
    .venv/bin/python benchmarks/routing.py --replicas 8 --policies round_robin,precise
    .venv/bin/python benchmarks/routing.py --replicas 8 --rate-per-replica 1000 --no-restart \
        --no-real-settings --out benchmarks/results/routing-h100  # H100-class constants
    .venv/bin/python benchmarks/routing.py --real     # 4 real replicas: results/routing-real.*
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ledger.hashing import BlockHasher
from tests.harness.routing_sim import (
    SIM_POLICIES,
    HashedWorkload,
    ReplicaConfig,
    RoutingSimulation,
    SimResult,
    StepModel,
)
from tests.harness.routing_workload import WorkloadConfig, multi_tenant_workload

RESULTS = Path(__file__).resolve().parent / "results"

# At 8 replicas, beside the default: the system settings of the real run the step model was
# fitted on (400 KV blocks per replica; a ledger status written once a second, so the router's
# load figures are up to a second old and what it sent since counts on top). Same workload.
REAL_SETTINGS = {
    "status 1 s": {"status_interval_s": 1.0},
    "400 blocks": {"num_blocks": 400},
    "400 blocks, status 1 s": {"num_blocks": 400, "status_interval_s": 1.0},
}


def simulate(
    work: HashedWorkload, policy: str, replicas: int, args: argparse.Namespace, **setting: float
) -> SimResult:
    return RoutingSimulation(
        work,
        policy,
        replicas,
        replica=ReplicaConfig(num_blocks=int(setting.get("num_blocks", 1600))),
        steps=args.step_model,
        status_interval_s=setting.get("status_interval_s", 0.0),
    ).run()


def workload_for(replicas: int, args: argparse.Namespace) -> HashedWorkload:
    config = WorkloadConfig(
        num_conversations=args.conversations_per_replica * replicas,
        rate=args.rate_per_replica * replicas,
        seed=args.seed,
    )
    turns = multi_tenant_workload(config)
    return HashedWorkload(turns, BlockHasher("sha256", seed="kvledger-routing"), 16)


def work_bound(work: HashedWorkload, replicas: int, steps: StepModel) -> dict[str, object]:
    """The most output tokens/s any routing can reach on this trace. Every output token after the
    first is one decoding sequence in some step, wherever it runs; every distinct block must be
    prefilled somewhere at least once (block hashes chain, so the least prefill is each prompt
    less its longest routable prefix seen in an earlier prompt or answer), and the last token
    always. Spread perfectly over the replicas, that work is the shortest makespan (a step's base
    time left out, so a bound for any base)."""
    seen: set = set()
    least_prefill = decode_seqs = 0
    for turn, full, routable in zip(work.turns, work.full, work.routable, strict=True):
        hit = 0
        for block_hash in full[: len(routable)]:
            if block_hash not in seen:
                break
            hit += 1
        least_prefill += len(turn.prompt_token_ids) - hit * work.block_size
        seen.update(full)
        decode_seqs += turn.max_tokens - 1
    decode_s = decode_seqs * steps.decode_seq_s / replicas
    prefill_s = least_prefill * steps.prefill_token_s / replicas
    outputs = sum(t.max_tokens for t in work.turns)
    return {
        "replicas": replicas,
        "least_prefill_tokens": least_prefill,
        "best_hit_rate": round(
            1 - least_prefill / sum(len(t.prompt_token_ids) for t in work.turns), 4
        ),
        "decode_s_per_replica": round(decode_s, 1),
        "least_prefill_s_per_replica": round(prefill_s, 1),
        "max_throughput_tok_s": round(outputs / (decode_s + prefill_s), 1),
        "max_throughput_no_prefill_tok_s": round(outputs / decode_s, 1) if decode_s else None,
    }


def restart_rows(work: HashedWorkload, args: argparse.Namespace) -> list[dict[str, object]]:
    rows = []
    middle = len(work.turns) // 2
    for policy in ("precise", "approx"):
        steady = RoutingSimulation(work, policy, 8, steps=args.step_model).run()
        restarted = RoutingSimulation(
            work, policy, 8, steps=args.step_model, restart_at=middle, restart_window=200
        ).run()
        window = restarted.restart_window
        prompt = {t.request_id: len(t.prompt_token_ids) for t in work.turns}
        steady_hits = sum(steady.hit_by_request[r] * prompt[r] for r in window)
        steady_rate = steady_hits / sum(prompt[r] for r in window)
        after = restarted.restart_window_hit_rate or 0.0
        rows.append(
            {
                "policy": policy,
                "restart_after_requests": middle,
                "window": len(window),
                "steady_hit_rate": round(steady_rate, 4),
                "after_restart_hit_rate": round(after, 4),
                "relative_change_pct": round(100 * (after - steady_rate) / steady_rate, 2),
            }
        )
    return rows


def table(rows: list[dict[str, object]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def plot(results: list[SimResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r.replicas for r in results})
    policies = [p for p in SIM_POLICIES if any(r.policy == p for r in results)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    metrics = [
        ("prefill_tokens", "prefill tokens computed"),
        ("hit_rate", "prefix hit rate"),
        ("throughput_tok_s", "output tokens / s"),
    ]
    width = 0.8 / len(policies)
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for k, policy in enumerate(policies):
            values = [
                next(r.row()[key] for r in results if r.policy == policy and r.replicas == n)
                for n in sizes
            ]
            ax.bar([i + k * width for i in range(len(sizes))], values, width, label=policy)  # type: ignore[arg-type]
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))])
        ax.set_xticklabels([f"{n} replicas" for n in sizes])
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main_real(args: argparse.Namespace) -> None:
    """Every policy on the same trace with real processes, policies interleaved per repetition."""
    from benchmarks.routing_real import RealConfig, calibrate, run_policy

    if args.real_log_dir:
        Path(args.real_log_dir).mkdir(parents=True, exist_ok=True)
    config = RealConfig(
        replicas=args.real_replicas,
        num_gpu_blocks=args.real_blocks,
        log_dir=args.real_log_dir,
        stale_after_s=args.real_stale_after_s,
    )
    low, high = (int(n) for n in args.real_system_len.split(","))
    turns = multi_tenant_workload(
        WorkloadConfig(
            num_conversations=args.real_conversations, rate=args.real_rate, seed=args.seed,
            vocab=256, system_len=(low, high),
        )
    )  # fmt: skip
    policies = [p for p in args.policies.split(",") if p != "oracle"]
    runs, samples = [], []
    for repetition in range(args.repetitions):
        # Rotate the order so that no policy always runs first (or last) on a shared machine.
        shift = repetition % len(policies)
        for policy in policies[shift:] + policies[:shift]:
            started = time.perf_counter()
            run, steps = run_policy(config, turns, policy, repetition)
            runs.append(run)
            samples += steps
            print(f"{policy:>12} rep {repetition}: {run.row()}  ({time.perf_counter() - started:.0f} s)",
                  flush=True)  # fmt: skip
    rows = [r.row() for r in runs]
    summary = []
    for policy in policies:
        mine = [r for r in rows if r["policy"] == policy]
        row: dict[str, object] = {"policy": policy, "runs": len(mine)}
        for key in ("prefill_tokens", "hit_rate", "ttft_p50_s", "ttft_p99_s", "throughput_tok_s"):
            values = sorted(float(r[key]) for r in mine)  # type: ignore[arg-type]
            row[key] = round(statistics.median(values), 4)
            row[f"{key}_spread"] = round(values[-1] - values[0], 4)
        summary.append(row)
    base = next(r for r in summary if r["policy"] == policies[0])
    for row in summary:
        row["prefill_vs_rr"] = round(
            float(row["prefill_tokens"]) / float(base["prefill_tokens"]), 3
        )  # type: ignore[arg-type]
        row["throughput_vs_rr"] = round(
            float(row["throughput_tok_s"]) / float(base["throughput_tok_s"]), 3
        )  # type: ignore[arg-type]
    restart = []
    if not args.no_restart:
        # Restart the gateway halfway; the next requests' hit rate against the same requests in
        # the policy's steady run (the first repetition above).
        middle = len(turns) // 2
        for policy in [p for p in ("precise", "approx") if p in policies]:
            run, _ = run_policy(config, turns, policy, 0, restart_after=middle)
            window = sorted(run.sent, key=lambda s: s.sent_at)[middle : middle + 200]
            ids = {s.request_id for s in window}
            steady = next(r for r in runs if r.policy == policy)
            rate = [
                sum(s.cached_tokens for s in sent if s.request_id in ids)
                / sum(s.prompt_tokens for s in sent if s.request_id in ids)
                for sent in (steady.sent, run.sent)
            ]
            restart.append({
                "policy": policy, "restart_after_requests": middle, "window": len(ids),
                "steady_hit_rate": round(rate[0], 4), "after_restart_hit_rate": round(rate[1], 4),
                "relative_change_pct": round(100 * (rate[1] - rate[0]) / rate[0], 2),
            })  # fmt: skip
            print(restart[-1], flush=True)
    step_model = calibrate(samples) if samples else {}
    columns = ["policy", "runs", "prefill_tokens", "prefill_vs_rr", "hit_rate", "ttft_p50_s",
               "ttft_p99_s", "throughput_tok_s", "throughput_vs_rr"]  # fmt: skip
    text = (
        f"{len(turns)} requests, {config.replicas} replicas, {config.num_gpu_blocks} blocks each; "
    )
    text += (
        f"medians over {args.repetitions} interleaved repetitions ({policies[0]} = baseline)\n\n"
    )
    text += table(summary, columns) + "\n\nEvery run:\n\n" + table(rows, list(rows[0]))
    if restart:
        text += "\n\nGateway restarted after half the requests (the next ones vs the same "
        text += "requests in the steady run):\n\n" + table(restart, list(restart[0]))
    text += f"\n\nWorker step time fitted on every step of every run: {step_model}"
    print(text)
    out = Path(args.out + "-real")
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "step_model"}
    out.with_suffix(".json").write_text(json.dumps(
        {"settings": settings, "config": dataclasses.asdict(config),
         "summary": summary, "runs": rows, "restart": restart, "step_model": step_model}, indent=2))  # fmt: skip
    out.with_suffix(".md").write_text(
        f"`.venv/bin/python benchmarks/routing.py {' '.join(sys.argv[1:])}`\n\n{text}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="8,16,64")
    parser.add_argument("--policies", default=",".join(SIM_POLICIES))
    parser.add_argument("--conversations-per-replica", type=int, default=60)
    parser.add_argument("--rate-per-replica", type=float, default=100.0,
                        help="conversations per second per replica (saturating by default)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=20261013)
    parser.add_argument("--prefill-token-ms", type=float, default=0.05)
    parser.add_argument("--decode-step-ms", type=float, default=8.0)
    parser.add_argument("--decode-seq-ms", type=float, default=0.1)
    parser.add_argument("--step-model-from", default=None,
                        help="a routing-real.json: its fitted step model replaces the three above")  # fmt: skip
    parser.add_argument("--no-restart", action="store_true")
    parser.add_argument("--no-real-settings", action="store_true",
                        help="skip the 8-replica rows with the real run's blocks and status age")  # fmt: skip
    parser.add_argument("--out", default=str(RESULTS / "routing"))
    parser.add_argument("--real", action="store_true", help="real processes, not the simulation")
    parser.add_argument("--real-replicas", type=int, default=4)
    parser.add_argument("--real-blocks", type=int, default=400, help="KV blocks per replica")
    parser.add_argument("--real-conversations", type=int, default=130)
    parser.add_argument("--real-rate", type=float, default=4.0, help="conversations per second")
    parser.add_argument("--real-system-len", default="768,1280")
    parser.add_argument("--repetitions", type=int, default=1)
    parser.add_argument("--real-stale-after-s", type=float, default=None,
                        help="the gateways' stale limit (default 2 s): smaller emulates more load")  # fmt: skip
    parser.add_argument("--real-log-dir", default=None,
                        help="gateways' debug logs (routed records) and each run's requests here")  # fmt: skip
    args = parser.parse_args()
    if args.real:
        main_real(args)
        return
    if args.step_model_from:
        fitted = json.loads(Path(args.step_model_from).read_text())["step_model"]
        args.decode_step_ms = fitted["base_ms"]
        args.prefill_token_ms = fitted["prefill_token_ms"]
        args.decode_seq_ms = fitted["decode_seq_ms"]
    args.step_model = StepModel(
        args.decode_step_ms / 1000, args.prefill_token_ms / 1000, args.decode_seq_ms / 1000
    )
    results: list[SimResult] = []
    settings_of: list[str] = []
    restart: list[dict[str, object]] = []
    bounds: list[dict[str, object]] = []
    for replicas in [int(n) for n in args.replicas.split(",")]:
        work = workload_for(replicas, args)
        bounds.append(work_bound(work, replicas, args.step_model))
        variants = {"default": {}}
        if replicas == 8 and not args.no_real_settings:
            variants.update(REAL_SETTINGS)
        for label, setting in variants.items():
            for policy in args.policies.split(","):
                started = time.perf_counter()
                result = simulate(work, policy, replicas, args, **setting)
                results.append(result)
                settings_of.append(label)
                print(f"{policy:>12} x {replicas:>2} ({label}): {result.row()}  "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
        if replicas == 8 and not args.no_restart:
            restart = restart_rows(work, args)
    rows = [{"setting": label, **r.row()} for label, r in zip(settings_of, results, strict=True)]
    for row, result in zip(rows, results, strict=True):
        base = next(
            r
            for r, other in zip(results, rows, strict=True)
            if r.replicas == result.replicas
            and r.policy == "round_robin"
            and other["setting"] == row["setting"]
        )
        row["prefill_vs_rr"] = round(result.prefill_tokens / base.prefill_tokens, 3)
        row["throughput_vs_rr"] = round(result.throughput_tok_s / base.throughput_tok_s, 3)
        row["saturated_vs_rr"] = (
            round(result.saturated_tok_s / base.saturated_tok_s, 3)
            if base.saturated_tok_s
            else None
        )
    for bound in bounds:
        base = next(
            r for r, row in zip(results, rows, strict=True)
            if r.replicas == bound["replicas"] and r.policy == "round_robin"
            and row["setting"] == "default"
        )  # fmt: skip
        for key in ("max_throughput_tok_s", "max_throughput_no_prefill_tok_s"):
            value = bound[key]
            bound[key.replace("_tok_s", "_vs_rr")] = (
                round(float(value) / base.throughput_tok_s, 3) if value else None  # type: ignore[arg-type]
            )
    columns = ["replicas", "setting", "policy", "requests", "prefill_tokens", "prefill_vs_rr",
               "hit_rate", "ttft_p50_s", "ttft_p99_s", "throughput_tok_s", "throughput_vs_rr",
               "makespan_s", "saturated_from_s", "saturated_s", "saturated_tok_s",
               "saturated_vs_rr", "preemptions"]  # fmt: skip
    text = table([r for r in rows if r["setting"] == "default"], columns)
    if any(r["setting"] != "default" for r in rows):
        text += "\n\nAt 8 replicas with the real run's system settings (same workload):\n\n"
        text += table([r for r in rows if r["replicas"] == 8], columns)
    text += "\n\nWhat any routing could reach (the work bound: decode and the least prefill "
    text += "spread perfectly; default settings):\n\n" + table(bounds, list(bounds[0]))
    if restart:
        text += "\n\nRouter restart at 8 replicas (next 200 requests vs the same requests, no restart):\n\n"
        text += table(restart, list(restart[0]))
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "step_model"}
    out.with_suffix(".json").write_text(
        json.dumps(
            {"settings": settings, "results": rows, "bounds": bounds, "restart": restart}, indent=2
        )
    )
    out.with_suffix(".md").write_text(
        f"`.venv/bin/python benchmarks/routing.py {' '.join(sys.argv[1:])}`\n\n{text}\n"
    )
    plot([r for r, label in zip(results, settings_of, strict=True) if label == "default"],
         out.with_suffix(".png"))  # fmt: skip


if __name__ == "__main__":
    main()
