"""Cache-aware routing at scale, by simulation: every policy on a public trace and on the
project's own multi-tenant workload.

The public trace (`--workload trace`): the Mooncake FAST'25 synthetic trace (../shared/traces,
README there), replayed as every benchmark of this project replays it: each hash id a fixed run
of 16 token ids, at most 32 ids per prompt, max_tokens 4, token-id prompts in arrival order,
closed loop at 8 in flight. The whole trace at 8, 16 and 64 replicas, every policy (and precise
under the old hand-set default weights), ledger status and eviction heads published as the
ledgers do (1 s, 0.2 s); each row's hit rate against one replica's single cache (the same trace
through one replica) and the trace's bound (one infinite cache), prefill tokens against round
robin's. Then, at 8 replicas with the caches together holding 1/4 of the working set, the
admissions that found fewer cached tokens than routed for, with and without eviction awareness;
and 3 gateways against 1 (sharing what they sent, and not).

The project's own workload (`--workload tenants`):
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

    .venv/bin/python benchmarks/routing.py --workload trace   # results/routing-trace.{json,md}
    .venv/bin/python benchmarks/routing.py --workload trace --replicas 8 --trace-count 1000
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
from ledger.step_costs import EVICTION_INTERVAL_S
from services.routing.costs import RoutingWeights
from tests.harness.routing_sim import (
    SIM_POLICIES,
    HashedWorkload,
    ReplicaConfig,
    RoutingSimulation,
    SimResult,
    StepModel,
)
from tests.harness.routing_workload import (
    MOONCAKE_TRACE,
    TraceReplay,
    WorkloadConfig,
    multi_tenant_workload,
    prefix_bound,
    trace_turns,
)

RESULTS = Path(__file__).resolve().parent / "results"
TRACE_MODEL_LEN = 1024

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
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
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


def main_real_trace(args: argparse.Namespace) -> None:
    """The public trace with real processes: one replica's single cache, then every policy
    with one gateway and precise with three, repetitions interleaved, medians."""
    from benchmarks.routing_real import RealConfig, run_policy

    count = args.trace_count if args.trace_count is not None else 600
    replay = TraceReplay(first=args.trace_first, count=count, vocab=256, path=Path(args.trace))
    turns = trace_turns(replay)
    bound = prefix_bound(turns, 16)
    blocks = args.real_blocks if args.real_blocks > 0 else None
    config = RealConfig(
        replicas=args.real_replicas, num_gpu_blocks=blocks, log_dir=args.real_log_dir,
        stale_after_s=args.real_stale_after_s,
    )  # fmt: skip
    variants: list[tuple[str, str, RealConfig]] = [
        ("single cache", "round_robin", dataclasses.replace(config, replicas=1))
    ]
    variants += [(p, p, config) for p in args.policies.split(",") if p != "oracle"]
    if "precise" in args.policies.split(",") and args.real_gateways > 1:
        variants.append((f"precise, {args.real_gateways} gateways", "precise",
                         dataclasses.replace(config, gateways=args.real_gateways)))  # fmt: skip
    kill_at = args.real_kill_gateway_after
    killed_label = f"precise, {args.real_gateways} gateways, one killed at {kill_at}"
    if kill_at is not None:
        variants.append((killed_label, "precise",
                         dataclasses.replace(config, gateways=args.real_gateways)))  # fmt: skip
    runs: dict[str, list[dict[str, object]]] = {label: [] for label, _, _ in variants}
    for repetition in range(args.repetitions):
        shift = repetition % len(variants)
        for label, policy, cfg in variants[shift:] + variants[:shift]:
            started = time.perf_counter()
            run, _ = run_policy(
                cfg, turns, policy, repetition, closed_loop=args.trace_concurrency,
                kill_gateway_after=kill_at if label == killed_label else None,
            )  # fmt: skip
            row = run.row()
            if kill_at is not None and label.startswith(f"precise, {args.real_gateways} gateways"):
                # The requests sent once the kill's in-flight ones were out: their hit rate,
                # the same window in the run without a kill beside it.
                after = {t.request_id for t in turns[kill_at + args.trace_concurrency :]}
                sent = [s for s in run.sent if s.request_id in after and s.error is None]
                row["after_kill_hit_rate"] = round(
                    sum(s.cached_tokens for s in sent) / max(sum(s.prompt_tokens for s in sent), 1),
                    4,
                )
                row["after_kill_requests"] = len(sent)
            runs[label].append(row)
            print(f"{label:>22} rep {repetition}: {row}  ({time.perf_counter() - started:.0f} s)",
                  flush=True)  # fmt: skip
    summary = []
    for label, rows in runs.items():
        row: dict[str, object] = {"variant": label, "runs": len(rows)}
        for key in ("hit_rate", "prefill_tokens", "ttft_p50_s", "ttft_p99_s", "throughput_tok_s",
                    "errors", "after_kill_hit_rate"):  # fmt: skip
            if any(key not in r for r in rows):
                continue
            values = sorted(float(r[key]) for r in rows)  # type: ignore[arg-type]
            row[key] = round(statistics.median(values), 4)
            if key == "hit_rate":
                row["hit_rate_range"] = f"{values[0]:.4f}-{values[-1]:.4f}"
        summary.append(row)
    single = summary[0]
    rr = next((r for r in summary if r["variant"] == "round_robin"), None)
    for row in summary:
        row["vs_single"] = round(float(row["hit_rate"]) / float(single["hit_rate"]), 3)  # type: ignore[arg-type]
        row["vs_bound"] = round(float(row["hit_rate"]) / bound, 3)  # type: ignore[arg-type]
        if rr is not None:
            row["prefill_vs_rr"] = round(
                float(row["prefill_tokens"]) / float(rr["prefill_tokens"]), 3
            )  # type: ignore[arg-type]
            row["ttft_p99_vs_rr"] = round(float(row["ttft_p99_s"]) / float(rr["ttft_p99_s"]), 3)  # type: ignore[arg-type]
    text = (
        f"Mooncake FAST'25 synthetic trace, requests {replay.first}-{replay.first + len(turns) - 1}"
        f", 16 token ids per hash id (ids < 256), <= 32 ids, max_tokens 4, closed loop at "
        f"{args.trace_concurrency}; {config.replicas} replicas of the tiny model, "
        f"{'the default cache' if blocks is None else f'{blocks} blocks'} each; medians of "
        f"{args.repetitions} interleaved run(s); bound (one infinite cache) {bound:.4f}.\n\n"
    )
    text += table(summary, list(summary[0]))
    print(text)
    out = Path(args.out + "-trace-real")
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "step_model"}
    out.with_suffix(".json").write_text(json.dumps(
        {"settings": settings, "bound": bound, "summary": summary, "runs": runs}, indent=2))  # fmt: skip
    out.with_suffix(".md").write_text(
        f"`.venv/bin/python benchmarks/routing.py {' '.join(sys.argv[1:])}`\n\n{text}\n"
    )


def main_real(args: argparse.Namespace) -> None:
    """Every policy on the same trace with real processes, policies interleaved per repetition."""
    from benchmarks.routing_real import RealConfig, calibrate, run_policy

    if args.real_log_dir:
        Path(args.real_log_dir).mkdir(parents=True, exist_ok=True)
    config = RealConfig(
        replicas=args.real_replicas,
        num_gpu_blocks=args.real_blocks if args.real_blocks > 0 else None,  # 0: the default cache
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
    singles = []  # one replica's single cache, the same trace: the prefill a router should reach
    for repetition in range(args.repetitions):
        started = time.perf_counter()
        single, _ = run_policy(dataclasses.replace(config, replicas=1), turns, "round_robin",
                               repetition)  # fmt: skip
        singles.append(single.row())
        print(f"single cache rep {repetition}: {singles[-1]}  ({time.perf_counter() - started:.0f} s)",
              flush=True)  # fmt: skip
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
    single_prefill = statistics.median(float(r["prefill_tokens"]) for r in singles)  # type: ignore[arg-type]
    summary.insert(0, {"policy": "single cache", "runs": len(singles),
                       "prefill_tokens": single_prefill,
                       "hit_rate": statistics.median(float(r["hit_rate"]) for r in singles)})  # type: ignore[arg-type]  # fmt: skip
    for row in summary:
        row["prefill_vs_single"] = round(float(row["prefill_tokens"]) / single_prefill, 3)  # type: ignore[arg-type]
    for row in summary[1:]:
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
    columns = ["policy", "runs", "prefill_tokens", "prefill_vs_single", "prefill_vs_rr",
               "hit_rate", "ttft_p50_s", "ttft_p99_s", "throughput_tok_s", "throughput_vs_rr"]  # fmt: skip
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


def trace_main(args: argparse.Namespace) -> None:
    """The public trace: every policy at each size, eviction awareness, several gateways."""
    replay = TraceReplay(first=args.trace_first, count=args.trace_count, path=Path(args.trace))
    turns = trace_turns(replay)
    work = HashedWorkload(turns, BlockHasher("sha256", seed="kvledger-routing"), 16)
    bound = prefix_bound(turns, 16)
    steps = args.step_model
    # Prompts are at most 32 blocks: a model length of 1,024 leaves small caches usable.
    cache = ReplicaConfig(num_blocks=args.trace_blocks, max_model_len=TRACE_MODEL_LEN)
    closed = {"concurrency": args.trace_concurrency, "steps": steps}
    published = {**closed, "status_interval_s": args.trace_status_s}
    print(f"{len(turns)} requests from {replay.first}, {sum(len(t.prompt_token_ids) for t in turns)} "
          f"prompt tokens in {work.distinct_blocks} distinct blocks; bound {bound:.4f}", flush=True)  # fmt: skip
    started = time.perf_counter()
    single = RoutingSimulation(work, "round_robin", 1, replica=cache, **closed).run()
    print(f"single cache: hit {single.hit_rate:.4f} ({time.perf_counter() - started:.0f} s)",
          flush=True)  # fmt: skip
    variants = [(p, p, None) for p in args.policies.split(",")]
    if "precise" in args.policies.split(","):
        variants.append(("precise (weights)", "precise", RoutingWeights()))
    rows: list[dict[str, object]] = []
    for replicas in [int(n) for n in args.replicas.split(",")]:
        runs = {}
        for label, policy, costs in variants:
            started = time.perf_counter()
            runs[label] = RoutingSimulation(
                work, policy, replicas, replica=cache, costs=costs, **published
            ).run()
            print(f"{label:>18} x {replicas:>2}: hit {runs[label].hit_rate:.4f} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
        rr = runs.get("round_robin")
        for label, result in runs.items():
            rows.append({
                "replicas": replicas, "policy": label, "hit_rate": round(result.hit_rate, 4),
                "vs_single": round(result.hit_rate / single.hit_rate, 3),
                "vs_bound": round(result.hit_rate / bound, 3),
                "prefill_tokens": result.prefill_tokens,
                "prefill_vs_rr": round(result.prefill_tokens / rr.prefill_tokens, 3) if rr else None,
                "ttft_p50_s": round(result.ttft_p50_s, 4), "ttft_p99_s": round(result.ttft_p99_s, 4),
                "throughput_tok_s": round(result.throughput_tok_s, 1),
            })  # fmt: skip
    evictions = [] if args.no_trace_evictions else trace_evictions(work, args, closed)
    gateways = [] if args.no_gateways else gateway_rows(work, cache, published)
    columns = ["replicas", "policy", "hit_rate", "vs_single", "vs_bound", "prefill_tokens",
               "prefill_vs_rr", "ttft_p50_s", "ttft_p99_s", "throughput_tok_s"]  # fmt: skip
    text = (
        f"Mooncake FAST'25 synthetic trace, requests {replay.first}-{replay.first + len(turns) - 1}"
        f" ({len(turns)}), 16 tokens per hash id, <= 32 ids, max_tokens 4, closed loop at "
        f"{args.trace_concurrency}; {args.trace_blocks} KV blocks per replica; status every "
        f"{args.trace_status_s:g} s. One replica's single cache hits {single.hit_rate:.4f}; "
        f"the bound (one infinite cache) is {bound:.4f}.\n\n" + table(rows, columns)
    )
    if evictions:
        text += (
            "\n\nAdmitted with fewer cached tokens than routed for (precise, 8 replicas, the "
            "caches together 1/4 of the working set), with and without eviction awareness:\n\n"
            + table(evictions, list(evictions[0]))
        )
    if gateways:
        text += "\n\nSeveral gateways (precise, 8 replicas):\n\n" + table(
            gateways, list(gateways[0])
        )
    print(text)
    out = Path(args.out + "-trace")
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "step_model"}
    out.with_suffix(".json").write_text(json.dumps(
        {"settings": settings, "single_hit_rate": single.hit_rate, "bound": bound,
         "results": rows, "evictions": evictions, "gateways": gateways}, indent=2))  # fmt: skip
    out.with_suffix(".md").write_text(
        f"`.venv/bin/python benchmarks/routing.py {' '.join(sys.argv[1:])}`\n\n{text}\n"
    )


def trace_evictions(
    work: HashedWorkload, args: argparse.Namespace, closed: dict
) -> list[dict[str, object]]:
    """8 replicas whose caches together hold 1/4 of the trace's working set: how many routed hit
    blocks were not there at admission, with and without eviction awareness; at the trace's
    closed loop, and at 64 in flight (queues at every replica)."""
    blocks = max(work.distinct_blocks // 4 // 8, TRACE_MODEL_LEN // 16 + 1)
    rows = []
    for concurrency in sorted({args.trace_concurrency, 64}):
        for status in (0.0, args.trace_status_s):
            for aware in (True, False):
                result = RoutingSimulation(
                    work, "precise", 8,
                    replica=ReplicaConfig(num_blocks=blocks, max_model_len=TRACE_MODEL_LEN),
                    steps=closed["steps"], concurrency=concurrency, status_interval_s=status,
                    eviction_aware=aware,
                ).run()  # fmt: skip
                rows.append({
                    "blocks_per_replica": blocks, "in_flight": concurrency,
                    "status": "current" if status == 0
                    else f"{status:g} s (head {EVICTION_INTERVAL_S:g} s)",
                    "eviction_aware": aware, "hit_rate": round(result.hit_rate, 4),
                    "routed_hit_blocks": result.routed_hit_blocks,
                    "short_requests": result.shortfall_requests,
                    "short_blocks": result.shortfall_blocks,
                    "short_pct": round(100 * result.shortfall_share, 3),
                    "set_aside_blocks": result.evicted_blocks,
                })  # fmt: skip
                print(rows[-1], flush=True)
    return rows


def gateway_rows(
    work: HashedWorkload, cache: ReplicaConfig, published: dict
) -> list[dict[str, object]]:
    """3 gateways (requests dealt in turn) against 1: each its own router; sharing what it sent
    and is not finished through Redis (1 ms), or not."""
    rows = []
    base = None
    for gateways, share in ((1, True), (3, True), (3, False)):
        result = RoutingSimulation(
            work, "precise", 8, replica=cache, gateways=gateways, share_pending=share, **published
        ).run()
        base = base or result
        rows.append({
            "gateways": gateways, "shared": share if gateways > 1 else "-",
            "hit_rate": round(result.hit_rate, 4),
            "vs_one_gateway": round(result.hit_rate / base.hit_rate, 4),
            "prefill_tokens": result.prefill_tokens, "ttft_p99_s": round(result.ttft_p99_s, 4),
        })  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="trace,tenants",
                        help="trace (the public trace), tenants (the project's own), or both")  # fmt: skip
    parser.add_argument("--trace", default=str(MOONCAKE_TRACE))
    parser.add_argument("--trace-first", type=int, default=0, help="a window: its first request")
    parser.add_argument("--trace-count", type=int, default=None, help="and length (default: all)")
    parser.add_argument("--trace-blocks", type=int, default=32768,
                        help="KV blocks per replica (default: holds the trace's working set)")  # fmt: skip
    parser.add_argument("--trace-concurrency", type=int, default=8)
    parser.add_argument("--trace-status-s", type=float, default=1.0,
                        help="how often each ledger publishes its status (0: current)")  # fmt: skip
    parser.add_argument("--no-trace-evictions", action="store_true")
    parser.add_argument("--no-gateways", action="store_true",
                        help="skip the 3-gateway rows (at 8 replicas)")  # fmt: skip
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
    parser.add_argument("--real-blocks", type=int, default=400,
                        help="KV blocks per replica (0: the default cache, as `kvledger up`)")  # fmt: skip
    parser.add_argument("--real-kill-gateway-after", type=int, default=None,
                        help="with --workload trace --real: also run the several gateways with "
                             "the first killed (SIGKILL) as this request is sent")  # fmt: skip
    parser.add_argument("--real-gateways", type=int, default=3,
                        help="the trace's several-gateway run (precise)")  # fmt: skip
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
        if "trace" in args.workload.split(","):
            main_real_trace(args)
        if "tenants" in args.workload.split(","):
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
    workloads = args.workload.split(",")
    if "trace" in workloads:
        trace_main(args)
    if "tenants" not in workloads:
        return
    results: list[SimResult] = []
    settings_of: list[str] = []
    restart: list[dict[str, object]] = []
    gateways: list[dict[str, object]] = []
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
        if replicas == 8 and not args.no_gateways:
            gateways = gateway_rows(
                work, ReplicaConfig(), {"steps": args.step_model, "status_interval_s": 1.0}
            )
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
    if gateways:
        text += "\n\nSeveral gateways at 8 replicas (precise, status every 1 s):\n\n"
        text += table(gateways, list(gateways[0]))
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "step_model"}
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "settings": settings,
                "results": rows,
                "bounds": bounds,
                "restart": restart,
                "gateways": gateways,
            },
            indent=2,
        )
    )
    out.with_suffix(".md").write_text(
        f"`.venv/bin/python benchmarks/routing.py {' '.join(sys.argv[1:])}`\n\n{text}\n"
    )
    plot([r for r, label in zip(results, settings_of, strict=True) if label == "default"],
         out.with_suffix(".png"))  # fmt: skip


if __name__ == "__main__":
    main()
