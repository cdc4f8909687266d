"""The ledger's CPU per step with the CPU tier on vs off, in process (no Redis, no engine loop).

The set-up of `ledger_service.py --tier` at 1,000 running: 32-token distinct prompts, block size
16, max_model_len 1024, async scheduling (two steps in flight), prefix caching and KV events on,
a tier with room for every prompt block twice over; a null worker answers every step at once
with token 1 for each sampling request and every copy done. A step is `schedule()`, the step
message built and encoded, the KV events taken, and `update_from_output()` of the step before;
`time.process_time` over the timed steps (from the 20th step on which every request decodes),
off and on interleaved per repetition, GC as in production (frozen after set-up).

    python benchmarks/tier_step_probe.py [--size 1000] [--steps 300] [--repeats 5]
    python benchmarks/tier_step_probe.py --profile on   # cProfile of one timed run
    valgrind --tool=callgrind python benchmarks/tier_step_probe.py --only on --steps 100
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.tiers import build_connector  # noqa: E402
from engine.translate import build_step_message  # noqa: E402
from ledger.hashing import BlockHasher  # noqa: E402
from ledger.kv_cache_manager import KVCacheManager  # noqa: E402
from ledger.offloading.base import num_cpu_chunks  # noqa: E402
from ledger.request import Request  # noqa: E402
from ledger.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from services.config import OffloadingConfig  # noqa: E402
from services.wire.codec import encode  # noqa: E402
from services.wire.messages import GenerateRequest, SamplingParams  # noqa: E402

PROMPT_LEN, MAX_MODEL_LEN, BLOCK_SIZE, VOCAB = 32, 1024, 16, 32_000


class Payload:
    """What build_step_message reads of a request's payload (engine.translate's Tracked)."""

    __slots__ = ("msg",)

    def __init__(self, msg: GenerateRequest) -> None:
        self.msg = msg


def build(size: int, tier: bool) -> Scheduler:
    blocks = size * (MAX_MODEL_LEN // BLOCK_SIZE) + 16
    manager = KVCacheManager(
        blocks, BLOCK_SIZE, MAX_MODEL_LEN, enable_caching=True, enable_kv_cache_events=True,
        record_evictions=True,
    )  # fmt: skip
    connector = None
    if tier:
        # As ledger_service.py: bytes_per_block 1 (a chunk is one page), every prompt block twice.
        gib = 4 * size * PROMPT_LEN // BLOCK_SIZE * 4096 / 2**30
        offloading = OffloadingConfig(cpu_bytes_to_use=int(gib * 2**30))
        connector = build_connector(offloading, num_cpu_chunks(gib * 2**30, 1), BLOCK_SIZE)
    config = SchedulerConfig(
        max_model_len=MAX_MODEL_LEN, max_num_seqs=size, max_num_batched_tokens=8192,
        async_scheduling=True,
    )  # fmt: skip
    scheduler: Scheduler = Scheduler(config, manager, connector)
    gc.collect()
    gc.freeze()  # as the ledger does once its pool is built, before any request arrives
    hasher = BlockHasher("sha256")
    sampling = SamplingParams(max_tokens=MAX_MODEL_LEN - PROMPT_LEN - BLOCK_SIZE, seed=0)
    for i in range(size):
        prompt = [(i * 7919 + j * 104729) % (VOCAB - 2) + 2 for j in range(PROMPT_LEN)]
        msg = GenerateRequest(req_id=f"r{i}", gateway_id="bench", prompt_token_ids=prompt,
                              sampling=sampling, arrival_time=time.time())  # fmt: skip
        scheduler.add_request(
            Request(
                f"r{i}",
                prompt,
                sampling.max_tokens,
                block_hasher=hasher,
                block_size=BLOCK_SIZE,
                payload=Payload(msg),
            )
        )
    return scheduler


GC_MS = [0.0]


def on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        GC_MS.append(time.process_time())
    else:
        GC_MS[0] += (time.process_time() - GC_MS.pop()) * 1e3


def run(
    size: int, tier: bool, steps: int, profile: cProfile.Profile | None = None
) -> tuple[float, float]:
    """ms of CPU per step over `steps` steps once every request decodes (after 20 more), and
    of it the garbage collector's."""
    scheduler = build(size, tier)
    num_chunks = scheduler.connector.manager.num_chunks if scheduler.connector else 0
    in_flight: deque = deque()
    decoding_since = None
    timed = 0
    start = 0.0
    while timed < steps:
        if decoding_since is not None and scheduler.step_id == decoding_since + 20:
            start = time.process_time()
            GC_MS[:] = [0.0]
            gc.callbacks.append(on_gc)
            if profile is not None:
                profile.enable()
        out = scheduler.schedule()
        encode(build_step_message(out, "e", BLOCK_SIZE, num_chunks))
        scheduler.take_events()
        meta = out.kv_transfers
        done = [*meta.load_jobs, *meta.store_jobs] if meta is not None else []
        in_flight.append((out, dict.fromkeys(out.sampling_req_ids, 1), done))
        if len(in_flight) == 2:
            previous, sampled, previous_done = in_flight.popleft()
            scheduler.update_from_output(previous, sampled, previous_done)
        n = out.num_scheduled_tokens
        if decoding_since is None and len(n) == size and sum(n.values()) == size:
            decoding_since = scheduler.step_id
        if decoding_since is not None and scheduler.step_id > decoding_since + 20:
            timed += 1
    if profile is not None:
        profile.disable()
    elapsed = time.process_time() - start
    gc.callbacks.remove(on_gc)
    gc.unfreeze()
    return elapsed / steps * 1e3, GC_MS[0] / steps


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", choices=["off", "on"], help="cProfile of one run")
    parser.add_argument(
        "--only", choices=["off", "on"],
        help="one run (for `valgrind --tool=callgrind`: the instructions of 2N steps less N's)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.only:
        cpu, in_gc = run(args.size, args.only == "on", args.steps)
        print(f"tier {args.only}: {cpu:.3f} ms/step (GC {in_gc:.3f})")
        return 0
    if args.profile:
        profile = cProfile.Profile()
        run(args.size, args.profile == "on", args.steps, profile)
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)
        return 0
    results: dict[str, list[float]] = {"off": [], "on": []}
    gc_ms: dict[str, list[float]] = {"off": [], "on": []}
    for rep in range(args.repeats):
        for name in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            cpu, in_gc = run(args.size, name == "on", args.steps)
            results[name].append(cpu)
            gc_ms[name].append(in_gc)
        print(f"rep {rep}: off {results['off'][-1]:.3f} ms/step (GC {gc_ms['off'][-1]:.3f}), "
              f"on {results['on'][-1]:.3f} (GC {gc_ms['on'][-1]:.3f})", flush=True)  # fmt: skip
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    ratios = [b / a - 1 for a, b in zip(results["off"], results["on"], strict=True)]
    print(f"{args.size} running, CPU ms/step, median of {args.repeats}: off {off:.3f}, on {on:.3f}"
          f" ({(on / off - 1) * 100:+.1f}%; per-rep pairs median "
          f"{statistics.median(ratios) * 100:+.1f}%)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
