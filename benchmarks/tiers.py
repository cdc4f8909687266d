"""The offloaded tiers on the public trace: prefill tokens computed, TTFT and output throughput
with the CPU tier on, against no tier (the baseline) and a GPU pool holding every block (the
bound), in one run; with `--shared`, also two replicas behind a shared tier (the second replays
the window after the first: what it loads, the first computed).

The Mooncake FAST'25 synthetic trace (../shared/traces), replayed as every benchmark of this
project replays it (each hash id a fixed run of 16 token ids, at most 32 ids per prompt,
max_tokens 4, token-id prompts in arrival order, closed loop at 8 in flight), through the real
ledger and worker services in one process over a real redis-server (tests/harness/stack.py) with
the seeded tiny Llama on the CPU (token ids folded into its vocabulary). A window of the trace,
named by its first request and length; the GPU pool lends `--gpu-fraction` of the window's
distinct blocks, the tier holds all of them (or `--tier-blocks`).

    .venv/bin/python benchmarks/tiers.py                                  # requests 3000-3199
    .venv/bin/python benchmarks/tiers.py --first 0 --count 400 --policy arc
    .venv/bin/python benchmarks/tiers.py --model smollm2 --repeats 3 --shared --json benchmarks/results/tiers-smollm2.json
    .venv/bin/python benchmarks/tiers.py --model smollm2 --first 0 --count 3993 --no-bound   # ~1 h

`--sync-load-tokens N` adds the CPU tier with vLLM's sync-load budget (`sync_load_budget_bytes`
of N tokens' KV a step): a hit that fits is copied before the forward pass of the step that
admits its request, instead of in a step of its own before it (vLLM's async loads, the default).

`--repeats N` runs the settings N times, interleaved (each repetition every setting in turn, the
order rotated), and reports each figure's median with its range.

`--real` runs the fleet target with real processes (benchmarks/routing_real.py: a redis-server,
a ledger and a worker process per replica, a gateway routing `precise`): one replica whose GPU
pool holds every distinct block (the bound), then `--replicas` replicas with `--gpu-fraction`
of them each and no tier, then the same with a CPU tier (`--cpu-fraction` each) and a shared tier
(a directory) behind it; hit rate = (GPU hits + tokens loaded) / prompt tokens, from every
ledger's counters, and the blocks one replica promoted from what another wrote:

    .venv/bin/python benchmarks/tiers.py --real --first 0 --count 3993 --json benchmarks/results/tiers-real.json

Issue 25's targets, on the whole trace: prefill tokens computed with the tier within 10% of the
bound's; TTFT p50 <= 0.8x the baseline's. A window of the tiny model on 2 CPU cores says whether
the tier saves prefill; its times are the CPU's, not a GPU's (a load is a host copy there too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from gpu_worker.checkpoint import load_model
from ledger.capacity import cdiv
from observability.logging import configure_logging
from services.config import SharedTierSpec
from services.transport.redis_server import RedisServer
from services.wire.messages import RequestOutput
from tests.harness.routing_workload import TraceReplay, Turn, prefix_bound, trace_turns
from tests.harness.stack import Stack

BLOCK_SIZE = 16
MAX_MODEL_LEN = 528  # 32 blocks of prompt and the outputs


@dataclass
class Figures:
    setting: str
    repetition: int
    gpu_blocks: int
    tier_blocks: int
    requests: int
    prompt_tokens: int
    prefill_tokens_computed: int
    loaded_blocks: int
    stored_blocks: int
    loads: int  # requests that loaded blocks
    sync_loads: int  # of them, loaded within the step that admitted them (a sync-load budget)
    shared_blocks: int  # of the loaded, those promoted from the shared tier
    preemptions: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    output_tokens_per_s: float
    wall_s: float


class TimedStack(Stack):
    """The test stack, noting when each request's first token and its end arrive."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.done: dict[str, asyncio.Event] = {}

    def _apply(self, out: RequestOutput) -> None:
        super()._apply(out)
        if out.new_token_ids and out.req_id not in self.first:
            self.first[out.req_id] = time.perf_counter()
        if out.finished and out.req_id in self.done:
            self.done[out.req_id].set()

    async def one(self, turn: Turn) -> None:
        rid = turn.request_id
        self.done[rid] = asyncio.Event()
        self.sent[rid] = time.perf_counter()
        await self.submit(rid, list(turn.prompt_token_ids), turn.max_tokens)
        await asyncio.wait_for(self.done[rid].wait(), 600)


async def replay(
    url: str, model, turns: list[Turn], setting: str, gpu_blocks: int, tier_blocks: int,
    args: argparse.Namespace, repetition: int = 0, shared: SharedTierSpec | None = None,
    prefix: str | None = None, replica: str = "default", sync_load_tokens: int = 0,
) -> Figures:  # fmt: skip
    bytes_per_block = 2 * model.config.num_hidden_layers * model.num_local_kv_heads
    bytes_per_block *= BLOCK_SIZE * model.config.head_dim * 4  # float32
    tier: dict = {}
    if tier_blocks:
        tier["kv_offloading_size"] = tier_blocks * cdiv(bytes_per_block, 4096) * 4096 / 2**30
        tier["kv_transfer_config"] = {"eviction_policy": args.policy}
        if sync_load_tokens:  # vLLM's budget is KV bytes a step, on one worker
            budget = sync_load_tokens * bytes_per_block // BLOCK_SIZE
            tier["kv_transfer_config"]["sync_load_budget_bytes"] = budget
    if shared is not None:
        tier["kv_shared_tier"] = shared
        tier["kv_shared_tier_size"] = 2 * tier_blocks * bytes_per_block
    stack = TimedStack(
        url, model, num_blocks=gpu_blocks + 1, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=2048, max_num_seqs=args.concurrency, prefix=prefix,
        replica=replica, **tier,
    )  # fmt: skip
    await stack.start()
    try:
        queue = list(turns)
        started = time.perf_counter()

        async def client() -> None:
            while queue:
                await stack.one(queue.pop(0))

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        wall = time.perf_counter() - started
        ledger = stack.ledger
        scheduler = ledger.scheduler
        ttft = sorted((stack.first[r] - stack.sent[r]) * 1000 for r in stack.first)
        output = sum(len(result.tokens) for result in stack.results.values())
        return Figures(
            setting=setting, repetition=repetition, gpu_blocks=gpu_blocks, tier_blocks=tier_blocks,
            requests=len(turns), prompt_tokens=sum(len(t.prompt_token_ids) for t in turns),
            prefill_tokens_computed=ledger.scheduler.num_prompt_tokens_computed,
            loaded_blocks=scheduler.num_loaded_blocks, stored_blocks=scheduler.num_stored_blocks,
            loads=scheduler.num_loads, sync_loads=scheduler.num_sync_loads,
            shared_blocks=shared_promotions(scheduler),
            preemptions=scheduler.num_preemptions,
            ttft_p50_ms=round(statistics.median(ttft), 1),
            ttft_p99_ms=round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 1),
            output_tokens_per_s=round(output / wall, 1), wall_s=round(wall, 2),
        )  # fmt: skip
    finally:
        await stack.stop()


def shared_promotions(scheduler) -> int:
    manager = scheduler.connector.manager if scheduler.connector is not None else None
    stats = getattr(manager, "stats", None)
    return stats.promotions if stats is not None else 0


def distinct_blocks(turns: list[Turn]) -> int:
    seen = set()
    for turn in turns:
        tokens = turn.prompt_token_ids
        for end in range(BLOCK_SIZE, len(tokens) + 1, BLOCK_SIZE):
            seen.add(tokens[:end])
    return len(seen)


async def main_async(args: argparse.Namespace) -> list[Figures]:
    torch.set_num_threads(args.threads)
    model = load_model(args.model, seed=0, dtype="float32")
    replay_spec = TraceReplay(first=args.first, count=args.count, vocab=model.config.vocab_size)
    turns = trace_turns(replay_spec)
    distinct = distinct_blocks(turns)
    needed = cdiv(MAX_MODEL_LEN, BLOCK_SIZE) + 1  # one whole request must fit
    gpu = max(int(distinct * args.gpu_fraction), needed)
    tier = args.tier_blocks or distinct
    print(
        f"Mooncake FAST'25 synthetic trace, requests {args.first}-{args.first + len(turns) - 1}: "
        f"{sum(len(t.prompt_token_ids) for t in turns):,} prompt tokens, {distinct:,} distinct "
        f"blocks, bound (one infinite cache) {prefix_bound(turns, BLOCK_SIZE):.1%} of prompt "
        f"tokens; closed loop at {args.concurrency}",
        flush=True,
    )
    settings = [
        ("no tier (baseline)", gpu, 0, 0),
        (f"CPU tier, {args.policy}", gpu, tier, 0),
        ("GPU holds all (bound)", max(distinct + needed, gpu), 0, 0),
    ]
    if args.no_bound:
        settings.pop()
    if args.sync_load_tokens:
        name = f"CPU tier, {args.policy}, sync loads ({args.sync_load_tokens:,} tokens a step)"
        settings.insert(2, (name, gpu, tier, args.sync_load_tokens))
    if args.shared:
        settings.append(("shared tier, second replica", gpu, tier, 0))
    results = []
    with RedisServer() as server:
        for repetition in range(args.repeats):
            shift = repetition % len(settings)
            for name, gpu_blocks, tier_blocks, sync in settings[shift:] + settings[:shift]:
                if name.startswith("shared"):
                    figures = await second_replica(
                        server.url, model, turns, name, gpu_blocks, tier_blocks, args, repetition
                    )
                else:
                    figures = await replay(
                        server.url, model, turns, name, gpu_blocks, tier_blocks, args, repetition,
                        sync_load_tokens=sync,
                    )  # fmt: skip
                print(f"  {name} ({repetition + 1}/{args.repeats}): {figures.wall_s} s", flush=True)
                results.append(figures)
    return results


async def second_replica(
    url: str, model, turns: list[Turn], name: str, gpu_blocks: int, tier_blocks: int,
    args: argparse.Namespace, repetition: int,
) -> Figures:  # fmt: skip
    """Replica A replays the window into the shared tier (a Redis backend), then replica B,
    cold, replays it again: B's figures."""
    prefix, shared = f"tiers{repetition}{uuid.uuid4().hex[:6]}", SharedTierSpec("redis")
    await replay(url, model, turns, "first replica", gpu_blocks, tier_blocks, args, repetition,
                 shared, prefix, "ra")  # fmt: skip
    await asyncio.sleep(1.0)  # B's follower reads the catalog A wrote
    return await replay(url, model, turns, name, gpu_blocks, tier_blocks, args, repetition,
                        shared, prefix, "rb")  # fmt: skip


def table(results: list[Figures]) -> str:
    """Each setting's medians over the repetitions (range in brackets when more than one); the
    ratios are against the baseline's figure of the same repetition, then their median."""
    names = list(dict.fromkeys(f.setting for f in results))
    by = {(f.setting, f.repetition): f for f in results}
    reps = sorted({f.repetition for f in results})
    base = names[0]

    def shown(values: list[float], fmt: str) -> str:
        mid = format(statistics.median(values), fmt)
        low, high = format(min(values), fmt), format(max(values), fmt)
        return mid if low == high else f"{mid} ({low}-{high})"

    lines = [
        "| setting | GPU blocks | tier blocks | prefill computed | vs baseline | loaded (shared) | "
        "stored | loads (within their step) | preemptions | TTFT p50 ms | vs baseline | "
        "TTFT p99 ms | output tok/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in names:
        runs = [by[(name, r)] for r in reps if (name, r) in by]
        ratio = [
            by[(name, r)].prefill_tokens_computed / max(by[(base, r)].prefill_tokens_computed, 1)
            for r in reps if (name, r) in by and (base, r) in by
        ]  # fmt: skip
        ttft_ratio = [
            by[(name, r)].ttft_p50_ms / max(by[(base, r)].ttft_p50_ms, 1e-9)
            for r in reps if (name, r) in by and (base, r) in by
        ]  # fmt: skip
        first = runs[0]
        lines.append(
            f"| {name} | {first.gpu_blocks:,} | {first.tier_blocks:,} | "
            f"{shown([f.prefill_tokens_computed for f in runs], ',.0f')} | {shown(ratio, '.2f')}x | "
            f"{shown([f.loaded_blocks for f in runs], ',.0f')} "
            f"({shown([f.shared_blocks for f in runs], ',.0f')}) | "
            f"{shown([f.stored_blocks for f in runs], ',.0f')} | "
            f"{shown([f.loads for f in runs], ',.0f')} ({shown([f.sync_loads for f in runs], ',.0f')}) | "
            f"{shown([f.preemptions for f in runs], '.0f')} | "
            f"{shown([f.ttft_p50_ms for f in runs], '.1f')} | {shown(ttft_ratio, '.2f')}x | "
            f"{shown([f.ttft_p99_ms for f in runs], '.1f')} | "
            f"{shown([f.output_tokens_per_s for f in runs], '.1f')} |"
        )
    return "\n".join(lines)


def main_real(args: argparse.Namespace) -> list[dict]:
    import dataclasses
    import tempfile

    from benchmarks.routing_real import RealConfig, run_policy

    turns = trace_turns(TraceReplay(first=args.first, count=args.count, vocab=256))
    distinct = distinct_blocks(turns)
    needed = cdiv(MAX_MODEL_LEN, BLOCK_SIZE) + 1
    gpu = max(int(distinct * args.gpu_fraction), needed)
    cpu = max(int(distinct * args.cpu_fraction), needed)
    block_bytes = 32 * 1024  # the tiny Llama's (4 layers, K and V, 16 tokens, one 64-wide head)
    bound = prefix_bound(turns, BLOCK_SIZE)
    print(
        f"requests {args.first}-{args.first + len(turns) - 1}: {distinct:,} distinct blocks, "
        f"bound {bound:.1%}; {args.replicas} replicas x {gpu:,} GPU blocks, CPU tier {cpu:,}",
        flush=True,
    )
    base = RealConfig(replicas=args.replicas, num_gpu_blocks=gpu, max_model_len=MAX_MODEL_LEN,
                      max_num_seqs=args.concurrency)  # fmt: skip
    folder = tempfile.mkdtemp(prefix="kvledger-tiers-")
    tiers = {
        "KVLEDGER_KV_OFFLOADING_SIZE": str(cpu * block_bytes / 2**30),
        "KVLEDGER_KV_SHARED_TIER": f"dir:{folder}",
        "KVLEDGER_KV_SHARED_TIER_SIZE": str(2 * distinct * block_bytes),
    }
    variants = [
        ("one replica, GPU holds all (bound)", dataclasses.replace(
            base, replicas=1, num_gpu_blocks=distinct + needed)),
        (f"{args.replicas} replicas, GPU {args.gpu_fraction:g} each, no tier", base),
        (f"{args.replicas} replicas, GPU {args.gpu_fraction:g}, CPU + shared tiers",
         dataclasses.replace(base, extra_env=tiers)),
    ]  # fmt: skip
    if args.replicas == 1:
        # One replica in its own processes (the one-replica targets with a ledger and a worker
        # that do not share a process): no tier, the CPU tier holding every block (async loads,
        # then with --sync-load-tokens loads within their step), the bound.
        cpu_tier = {"KVLEDGER_KV_OFFLOADING_SIZE": str(distinct * block_bytes / 2**30)}
        variants = [
            ("no tier (baseline)", base),
            ("CPU tier", dataclasses.replace(base, extra_env=cpu_tier)),
            ("GPU holds all (bound)", dataclasses.replace(base, num_gpu_blocks=distinct + needed)),
        ]
        if args.sync_load_tokens:
            transfer = json.dumps(
                {
                    "kv_connector": "OffloadingConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "sync_load_budget_bytes": args.sync_load_tokens * block_bytes // BLOCK_SIZE
                    },
                }
            )
            sync_env = {**cpu_tier, "KVLEDGER_KV_TRANSFER_CONFIG": transfer}
            variants.insert(2, (f"CPU tier, sync loads ({args.sync_load_tokens:,} tokens a step)",
                                dataclasses.replace(base, extra_env=sync_env)))  # fmt: skip
    rows = []
    for repetition in range(args.repeats):
        shift = repetition % len(variants)
        for label, config in variants[shift:] + variants[:shift]:
            started = time.perf_counter()
            run, _ = run_policy(config, turns, "precise", repetition,
                                closed_loop=args.concurrency)  # fmt: skip
            row = {"variant": label, **run.row()}
            rows.append(row)
            print(f"{label}: {row} ({time.perf_counter() - started:.0f} s)", flush=True)
    lines = [
        f"| variant | runs | hit rate | vs {variants[0][0]} | prefill tokens | tokens loaded | "
        "blocks from another replica | TTFT p50 / p99 s | output tok/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    medians = {}
    for label, _ in variants:
        mine = [r for r in rows if r["variant"] == label]

        def mid(key: str, runs: list[dict] = mine) -> float:
            return statistics.median(float(r[key]) for r in runs)

        medians[label] = mid("hit_rate")
        if args.replicas == 1:
            base_rows = {r["repetition"]: r for r in rows if r["variant"] == variants[0][0]}
            ratio = statistics.median(
                float(r["ttft_p50_s"]) / max(float(base_rows[r["repetition"]]["ttft_p50_s"]), 1e-9)
                for r in mine if r["repetition"] in base_rows
            )  # fmt: skip
            label = f"{label} (TTFT p50 {ratio:.2f}x the baseline's)"
        lines.append(
            f"| {label} | {len(mine)} | {mid('hit_rate'):.4f} | "
            f"{mid('hit_rate') / max(medians[variants[0][0]], 1e-9):.3f} | "
            f"{mid('prefill_tokens'):,.0f} | {mid('loaded_tokens'):,.0f} | "
            f"{mid('shared_blocks'):,.0f} | {mid('ttft_p50_s'):.3f} / {mid('ttft_p99_s'):.3f} | "
            f"{mid('throughput_tok_s'):.1f} |"
        )
    print("\n".join(lines))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--first", type=int, default=3000, help="first request of the window")
    parser.add_argument("--count", type=int, default=200, help="requests in the window")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument(
        "--gpu-fraction", type=float, default=0.25,
        help="the GPU pool lends this share of the window's distinct blocks",
    )  # fmt: skip
    parser.add_argument(
        "--tier-blocks", type=int, default=0, help="CPU tier blocks (0: every distinct block)"
    )
    parser.add_argument("--policy", choices=("lru", "arc"), default="lru", help="eviction policy")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the worker")
    parser.add_argument(
        "--model", default="tiny", help="tiny (the seeded Llama) or smollm2 (SmolLM2-135M, float32)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="interleaved repetitions")
    parser.add_argument(
        "--no-bound", action="store_true", help="leave out the GPU holding every block"
    )
    parser.add_argument(
        "--shared", action="store_true",
        help="also: a second replica loading the first's blocks from a shared tier (Redis)",
    )  # fmt: skip
    parser.add_argument(
        "--sync-load-tokens", type=int, default=0,
        help="also: the CPU tier with vLLM's sync-load budget (sync_load_budget_bytes) of this "
        "many tokens' KV a step: a load that fits is done within the step that admits it",
    )  # fmt: skip
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--real", action="store_true", help="the fleet target, real processes")
    parser.add_argument("--replicas", type=int, default=4, help="with --real: replicas")
    parser.add_argument(
        "--cpu-fraction", type=float, default=0.25,
        help="with --real: each replica's CPU tier holds this share of the distinct blocks",
    )  # fmt: skip
    args = parser.parse_args()
    configure_logging("benchmark", level="warning")
    if args.real:
        rows = main_real(args)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        return
    results = asyncio.run(main_async(args))
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")


if __name__ == "__main__":
    main()
