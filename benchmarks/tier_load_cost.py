"""What a router trades: loading a block from the CPU tier, or the shared tier, against
computing it again.

For each model, a worker's runner (its KV cache, its device) measures what the worker reports
at start-up (`gpu_worker.offload.measure_load_cost`: 8 blocks host buffer -> cache and back,
median of 7, per block), then prefills a prompt of `--blocks` blocks from nothing `--repeats`
times (a fresh request each time, all its blocks computed) and takes the median per block. The
ratio is what `precise` weighs: a block found in the tier costs load/recompute of its prefill.
With `--shared`, the shared tier's backends too (what the worker measures at start-up,
`gpu_worker.shared_tier.WorkerSharedTier.measure_promotion`: 8 probe blocks written, read back
into a host buffer 5 times, the median per block; a load from the shared tier is that
promotion plus the CPU tier's load): a directory (`--shared-dir`, default a temporary one) and
a private redis-server.

    .venv/bin/python benchmarks/tier_load_cost.py                      # tiny and smollm2, CPU
    .venv/bin/python benchmarks/tier_load_cost.py --models tiny --device cuda --json out.json
    .venv/bin/python benchmarks/tier_load_cost.py --shared --json benchmarks/results/tier_load_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from gpu_worker.offload import measure_load_cost
from gpu_worker.profile import ProfileSettings
from gpu_worker.runner import ModelRunner, RunnerConfig
from services.wire.messages import NewRequestData, SamplingParams, StepMessage

BLOCK_SIZE = 16


def prefill_s_per_block(runner: ModelRunner, blocks: int, repeats: int) -> float:
    times = []
    vocab = runner.config.vocab_size
    for i in range(repeats + 1):  # the first warms up
        tokens = [(7 * i + j) % vocab for j in range(blocks * BLOCK_SIZE)]
        new = NewRequestData(
            req_id=f"r{i}", token_ids=tokens, num_prompt_tokens=len(tokens),
            block_ids=list(range(1, blocks + 1)), num_computed_tokens=0,
            sampling=SamplingParams(max_tokens=1),
        )  # fmt: skip
        step = StepMessage(
            step_id=2 * i, epoch="bench", new_reqs=[new], cached_reqs=[],
            num_scheduled_tokens={new.req_id: len(tokens)}, finished_req_ids=[],
            preempted_req_ids=[], block_size=BLOCK_SIZE,
        )  # fmt: skip
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        runner.execute(step)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - started)
        done = StepMessage(
            step_id=2 * i + 1, epoch="bench", new_reqs=[], cached_reqs=[],
            num_scheduled_tokens={}, finished_req_ids=[new.req_id], preempted_req_ids=[],
            block_size=BLOCK_SIZE,
        )  # fmt: skip
        runner.execute(done)
    return statistics.median(times) / blocks


async def shared_promotions(runner: ModelRunner, folder: str | None) -> list[tuple[str, float]]:
    """Seconds per block a promotion takes through each backend, as a worker measures it."""
    import tempfile

    from gpu_worker.shared_tier import DirectoryBackend, RedisBackend, WorkerSharedTier
    from services.transport import redis_streams
    from services.transport.redis_server import RedisServer

    found = []
    with tempfile.TemporaryDirectory(dir=folder) as root:
        tier = WorkerSharedTier(DirectoryBackend(root))
        found.append(("dir", await tier.measure_promotion(runner.kv_caches, "bench")))
    with RedisServer() as server:
        r = redis_streams.connect(server.url)
        try:
            tier = WorkerSharedTier(RedisBackend(r, "bench"))
            found.append(("redis", await tier.measure_promotion(runner.kv_caches, "bench")))
        finally:
            await r.aclose()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--blocks", type=int, default=8, help="blocks per prefill")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--shared", action="store_true", help="also the shared tier's backends")
    parser.add_argument("--shared-dir", help="where the directory backend's probe goes")
    args = parser.parse_args()
    rows = []
    for model in args.models.split(","):
        runner = ModelRunner.create(
            RunnerConfig(
                model=model, device=args.device, block_size=BLOCK_SIZE, max_model_len=1024,
                profile=ProfileSettings(block_size=BLOCK_SIZE, kv_cache_memory_bytes=64 << 20),
            )
        )  # fmt: skip
        load_s, store_s = measure_load_cost(runner.kv_caches)
        prefill_s = prefill_s_per_block(runner, args.blocks, args.repeats)
        bytes_per_block = sum(k[0].nbytes + v[0].nbytes for k, v in runner.kv_caches)
        row = {
            "model": runner.name, "device": str(runner.device), "bytes_per_block": bytes_per_block,
            "load_s_per_block": load_s, "store_s_per_block": store_s,
            "prefill_s_per_block": prefill_s, "load_over_prefill": load_s / prefill_s,
            "threads": torch.get_num_threads(),
        }  # fmt: skip
        rows.append(row)
        print(
            f"{row['model']:>32} {row['device']:>6} {bytes_per_block:>9,} B/block  "
            f"load {load_s * 1e6:8.1f} us  store {store_s * 1e6:8.1f} us  "
            f"prefill {prefill_s * 1e3:8.3f} ms/block  load/prefill {load_s / prefill_s:.4f}",
            flush=True,
        )
        if args.shared:
            for backend, promotion in asyncio.run(shared_promotions(runner, args.shared_dir)):
                total = promotion + load_s
                row[f"shared_{backend}_load_s_per_block"] = total
                row[f"shared_{backend}_load_over_prefill"] = total / prefill_s
                print(
                    f"{'':>32} shared tier, {backend:>5}: promotion {promotion * 1e6:8.1f} us + "
                    f"load = {total * 1e6:8.1f} us/block  load/prefill {total / prefill_s:.4f}",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
