"""Allocate/free/cache throughput and memory per block: the ledger's KVCacheManager vs vLLM 0.33's.

A trace of manager calls is recorded once by running our scheduler on the blog workloads; both
managers replay it with the same loop (vLLM's in its own venv, a subprocess running this file),
and memory per block is measured with tracemalloc the same way on both sides.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Trace ops: LOOKUP/ADMIT/GROW/FREE are one manager call each (the counted "ops"); NEW and
# APPEND rebuild the requests the scheduler had (timed, not counted).
NEW, APPEND, LOOKUP, ADMIT, GROW, FREE = range(6)
BLOCK_SIZE = 16
MODES = ("manager", "end-to-end")
MODE_NOTES = {
    "manager": "requests made before timing; block hashes precomputed (a list lookup)",
    "end-to-end": "request creation and real block hashing inside the timed loop",
}


# ---------------------------------------------------------------- the trace (our side only)


def record_trace(workload: str, num_requests: int, hash_algo: str) -> dict[str, Any]:
    """Run our scheduler on the workload and log every manager call with its arguments."""
    from kvledger.simulate import BLOG_MAX_MODEL_LEN, BLOG_POOL_TOKENS
    from kvledger.workloads import blog_workload, shared_prefix_workload, synthetic_token
    from ledger.hashing import BlockHasher
    from ledger.kv_cache_manager import KVCacheManager
    from ledger.request import Request
    from ledger.scheduler import Scheduler, SchedulerConfig

    sims = (shared_prefix_workload if workload == "shared-prefix" else blog_workload)(num_requests)
    index = {sim.request_id: i for i, sim in enumerate(sims)}
    ops: list[list] = []
    seen: dict[int, int] = {}

    def sync(request: Request) -> int:
        i = index[request.request_id]
        if i not in seen:
            ops.append([NEW, i])
            seen[i] = request.num_prompt_tokens
        if request.num_tokens > seen[i]:
            ops.append([APPEND, i, request.all_token_ids[seen[i] :]])
            seen[i] = request.num_tokens
        return i

    class Recorder(KVCacheManager):
        def get_computed_blocks(self, request):
            op = [LOOKUP, sync(request)]
            hits, num_hit = super().get_computed_blocks(request)
            ops.append([*op, num_hit])  # the expected outcome rides last
            return hits, num_hit

        def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                           new_computed_blocks=(), num_lookahead_tokens=0, *,
                           full_sequence_must_fit=False, has_scheduled_reqs=True):  # fmt: skip
            i = sync(request)
            if full_sequence_must_fit:
                op = [ADMIT, i, request.num_computed_tokens, num_new_tokens, has_scheduled_reqs]
            else:
                op = [GROW, i, request.num_computed_tokens, num_new_tokens]
            blocks = super().allocate_slots(
                request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                num_lookahead_tokens, full_sequence_must_fit=full_sequence_must_fit,
                has_scheduled_reqs=has_scheduled_reqs,
            )  # fmt: skip
            ops.append([*op, -1 if blocks is None else len(blocks)])
            return blocks

        def free(self, request):
            ops.append([FREE, index[request.request_id]])
            return super().free(request)

    num_blocks = BLOG_POOL_TOKENS // BLOCK_SIZE + 1  # +1: block 0 is the null block
    manager = Recorder(num_blocks, BLOCK_SIZE, BLOG_MAX_MODEL_LEN)
    config = SchedulerConfig(max_model_len=BLOG_MAX_MODEL_LEN)
    scheduler = Scheduler(config, manager)
    hasher = BlockHasher(hash_algo, seed="vllm-none-hash")
    requests = [
        Request(sim.request_id, sim.prompt_token_ids, sim.max_tokens, arrival_time=float(i),
                block_hasher=hasher, block_size=BLOCK_SIZE)
        for i, sim in enumerate(sims)
    ]  # fmt: skip
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        sampled = {
            rid: synthetic_token(index[rid], scheduler.requests[rid].num_tokens)
            for rid in out.num_scheduled_tokens
        }
        scheduler.update_from_output(out, sampled)
    return {
        "workload": workload,
        "hash_algo": hash_algo,
        "num_blocks": num_blocks,
        "max_model_len": BLOG_MAX_MODEL_LEN,
        "prompt_lens": [sim.prompt_len for sim in sims],
        "tokens": [r.all_token_ids for r in requests],
        "ops": ops,
        "num_calls": sum(1 for op in ops if op[0] >= LOOKUP),
    }


# ---------------------------------------------------------------- the replay (both sides)


def replay(ops: list[list], requests: dict, make_request: Callable, manager: Any) -> None:
    """The timed loop, the same on both sides: only the manager behind it differs."""
    lookup, allocate, free = manager.get_computed_blocks, manager.allocate_slots, manager.free
    hits = num_hit = None
    for op in ops:
        code = op[0]
        if code == GROW:
            request = requests[op[1]]
            request.num_computed_tokens = op[2]
            allocate(request, op[3])
        elif code == APPEND:
            requests[op[1]].append_output_token_ids(op[2])
        elif code == LOOKUP:
            hits, num_hit = lookup(requests[op[1]])[:2]
        elif code == ADMIT:
            request = requests[op[1]]
            request.num_computed_tokens = op[2]
            allocate(request, op[3], num_hit, hits,
                     full_sequence_must_fit=True, has_scheduled_reqs=op[4])  # fmt: skip
        elif code == FREE:
            free(requests[op[1]])
        else:
            requests[op[1]] = make_request(op[1])


class Outcomes:
    """Wraps a manager to log what each call returned (an untimed check that both did the same)."""

    def __init__(self, manager: Any, count: Callable[[Any], int]) -> None:
        self.manager, self.count, self.log = manager, count, []

    def get_computed_blocks(self, request):
        result = self.manager.get_computed_blocks(request)
        self.log.append(result[1])
        return result

    def allocate_slots(self, *args, **kwargs):
        result = self.manager.allocate_slots(*args, **kwargs)
        self.log.append(-1 if result is None else self.count(result))
        return result

    def free(self, request):
        return self.manager.free(request)


# ---------------------------------------------------------------- the two sides


class LedgerSide:
    name = "kvledger"

    def __init__(self, hash_algo: str) -> None:
        from ledger.hashing import BlockHasher
        from ledger.kv_cache_manager import KVCacheManager
        from ledger.request import Request

        self.Manager, self.Request = KVCacheManager, Request
        self.hasher = BlockHasher(hash_algo, seed="vllm-none-hash")
        self.version = importlib.metadata.version("kvledger")

    def manager(self, num_blocks: int, max_model_len: int) -> Any:
        return self.Manager(num_blocks, BLOCK_SIZE, max_model_len)

    def request(self, i: int, tokens: list[int], hasher: Any = None) -> Any:
        return self.Request(str(i), tokens, 1 << 20, block_hasher=hasher or self.hasher,
                            block_size=BLOCK_SIZE)  # fmt: skip

    def precomputed_hasher(self, tokens: list[int]) -> Any:
        return _PrecomputedHashes(self.request(-1, tokens).block_hashes)

    @staticmethod
    def count(blocks: list) -> int:
        return len(blocks)


class _PrecomputedHashes:
    """Our BlockHasher's interface over hashes computed before timing."""

    def __init__(self, hashes: list[bytes]) -> None:
        self.hashes = hashes

    def hash_blocks(self, token_ids, block_size, *, start_block=0, **_) -> list[bytes]:
        return self.hashes[start_block : len(token_ids) // block_size]


class VllmSide:
    name = "vLLM"

    def __init__(self, hash_algo: str) -> None:
        import torch
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

        os.environ.pop("PYTHONHASHSEED", None)  # NONE_HASH from "vllm-none-hash", as ours
        kv_cache_utils.init_none_hash(get_hash_fn_by_name(hash_algo))
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1,
                                 dtype=torch.float32)  # fmt: skip
        groups = [KVCacheGroupSpec(["layer"], spec)]
        self.config = lambda n: KVCacheConfig(
            num_blocks=n, kv_cache_tensors=[], kv_cache_groups=groups
        )
        self.Manager, self.Request = KVCacheManager, Request
        self.hasher = kv_cache_utils.get_request_block_hasher(
            BLOCK_SIZE, get_hash_fn_by_name(hash_algo)
        )
        self.params = SamplingParams(max_tokens=1 << 20)
        self.version = vllm.__version__

    def manager(self, num_blocks: int, max_model_len: int) -> Any:
        return self.Manager(self.config(num_blocks), max_model_len=max_model_len,
                            scheduler_block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE)  # fmt: skip

    def request(self, i: int, tokens: list[int], hasher: Any = None) -> Any:
        return self.Request(str(i), tokens, self.params, None, block_hasher=hasher or self.hasher)

    def precomputed_hasher(self, tokens: list[int]) -> Any:
        hashes = self.request(-1, tokens).block_hashes
        return lambda request: hashes[len(request.block_hashes) : request.num_tokens // BLOCK_SIZE]

    @staticmethod
    def count(blocks: Any) -> int:
        return len(blocks.blocks[0])


# ---------------------------------------------------------------- measuring one side


def request_factory(side: Any, trace: dict, mode: str) -> Callable[[int], Any]:
    prompts = [t[:n] for t, n in zip(trace["tokens"], trace["prompt_lens"], strict=True)]
    if mode == "end-to-end":
        return lambda i: side.request(i, prompts[i])
    hashers = [side.precomputed_hasher(tokens) for tokens in trace["tokens"]]
    return lambda i: side.request(i, prompts[i], hashers[i])


def time_replay(side: Any, trace: dict, mode: str, repeats: int) -> dict[str, Any]:
    make_request = request_factory(side, trace, mode)
    ops = trace["ops"]
    if mode == "manager":  # requests made up front, untimed
        ops = [op for op in ops if op[0] != NEW]
    seconds = []
    for _ in range(repeats):
        manager = side.manager(trace["num_blocks"], trace["max_model_len"])
        requests = (
            {}
            if mode == "end-to-end"
            else {i: make_request(i) for i in range(len(trace["tokens"]))}
        )
        gc.collect()
        gc.freeze()  # long-lived objects (the trace, vLLM's modules) out of the collector's way
        start = time.perf_counter()
        replay(ops, requests, make_request, manager)
        seconds.append(time.perf_counter() - start)
        gc.unfreeze()
    outcomes = Outcomes(side.manager(trace["num_blocks"], trace["max_model_len"]), side.count)
    replay(trace["ops"], {}, request_factory(side, trace, "end-to-end"), outcomes)
    return {"seconds": seconds, "outcomes": outcomes.log}


def _fill(side: Any, manager: Any, num_blocks: int) -> None:
    """Cache every block: one request of num_blocks - 1 full blocks, allocated then freed."""
    request = side.request(0, list(range(1000, 1000 + (num_blocks - 1) * BLOCK_SIZE)))
    hits, num_hit = manager.get_computed_blocks(request)[:2]
    assert manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits) is not None
    manager.free(request)


def measure_memory(side: Any, num_blocks: int) -> dict[str, float]:
    """tracemalloc bytes per block: a fresh pool, then with every block cached and free."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    manager = side.manager(num_blocks, (num_blocks + 1) * BLOCK_SIZE)
    gc.collect()
    empty = tracemalloc.get_traced_memory()[0] - base
    _fill(side, manager, num_blocks)
    gc.collect()
    cached = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return {
        "empty_pool": empty / num_blocks,
        "all_cached": cached / num_blocks,
        "block_object": sys.getsizeof(manager.block_pool.blocks[1]),
    }


def measure_side(side: Any, traces: list[dict], repeats: int, memory_blocks: int) -> dict:
    runs = {
        f"{trace['workload']}/{mode}": time_replay(side, trace, mode, repeats)
        for trace in traces
        for mode in MODES
    }
    return {"version": side.version, "runs": runs, "memory": measure_memory(side, memory_blocks)}


def side_main(args: argparse.Namespace) -> int:
    """Inside vLLM's venv: measure vLLM's side of the traces and write the numbers as JSON."""
    with open(args.trace) as f:
        traces = json.load(f)["traces"]
    result = measure_side(VllmSide(args.hash_algo), traces, args.repeats, args.memory_blocks)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


# ---------------------------------------------------------------- the report


def run_vllm_side(venv: str, traces: list[dict], args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        trace_path, out_path = Path(tmp) / "traces.json", Path(tmp) / "vllm.json"
        trace_path.write_text(json.dumps({"traces": traces}))
        # -P: benchmarks/ must not shadow vLLM's imports (benchmarks/kernels.py vs `kernels`).
        command = [
            str(Path(venv) / "bin" / "python"), "-P", __file__, "--side", "vllm",
            "--trace", str(trace_path), "--out", str(out_path), "--repeats", str(args.repeats),
            "--hash-algo", args.hash_algo, "--memory-blocks", str(args.memory_blocks),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"vLLM side failed:\n{done.stderr[-3000:]}")
        return json.loads(out_path.read_text())


def expected_outcomes(trace: dict) -> list[int]:
    return [op[-1] for op in trace["ops"] if op[0] in (LOOKUP, ADMIT, GROW)]


def report(traces: list[dict], ours: dict, theirs: dict | None, args: argparse.Namespace) -> dict:
    rows = []
    for trace in traces:
        for mode in MODES:
            key = f"{trace['workload']}/{mode}"
            row = {"workload": trace["workload"], "mode": mode, "calls": trace["num_calls"]}
            for label, side in (("kvledger", ours), ("vllm", theirs)):
                if side is None:
                    continue
                run = side["runs"][key]
                if run["outcomes"] != expected_outcomes(trace):
                    sys.exit(f"{label} did not reproduce the recorded outcomes of {key}")
                row[f"{label}_ops_per_s"] = trace["num_calls"] / statistics.median(run["seconds"])
                row[f"{label}_best_ops_per_s"] = trace["num_calls"] / min(run["seconds"])
            if theirs is not None:
                row["ratio"] = row["kvledger_ops_per_s"] / row["vllm_ops_per_s"]
            rows.append(row)
    print_table(rows, traces, ours, theirs, args)
    return {"rows": rows, "memory": {"kvledger": ours["memory"],
            "vllm": theirs["memory"] if theirs else None}}  # fmt: skip


def trace_summary(trace: dict) -> str:
    ops = trace["ops"]
    admits = [op for op in ops if op[0] == ADMIT]
    grows = [op for op in ops if op[0] == GROW]
    return (
        f"{trace['workload']}: {len(admits)} admissions ({sum(op[-1] < 0 for op in admits)} refused), "
        f"{len(grows)} grows ({sum(op[-1] < 0 for op in grows)} refused), "
        f"{sum(op[0] == FREE for op in ops)} frees, "
        f"{sum(op[-1] for op in ops if op[0] == LOOKUP)} prefix-hit tokens, "
        f"{trace['num_blocks'] - 1} blocks of {BLOCK_SIZE}"
    )


def print_table(
    rows: list[dict], traces: list[dict], ours: dict, theirs: dict | None, args: argparse.Namespace
) -> None:
    vs = f" vs vLLM {theirs['version']}" if theirs else " (no --vllm-venv: kvledger only)"
    print(f"\nKVCacheManager replay, kvledger{vs}: ops/s, median of {args.repeats} (best)")
    print(f"{'workload':<14} {'mode':<11} {'calls':>7} {'kvledger':>20} {'vLLM':>20} {'ratio':>6}")
    for r in rows:
        ours_s = f"{r['kvledger_ops_per_s']:,.0f} ({r['kvledger_best_ops_per_s']:,.0f})"
        theirs_s = (
            f"{r['vllm_ops_per_s']:,.0f} ({r['vllm_best_ops_per_s']:,.0f})" if theirs else "-"
        )
        ratio = f"{r['ratio']:.2f}x" if theirs else "-"
        print(
            f"{r['workload']:<14} {r['mode']:<11} {r['calls']:>7} {ours_s:>20} {theirs_s:>20} {ratio:>6}"
        )
    for mode, note in MODE_NOTES.items():
        print(f"  {mode}: {note}")
    for trace in traces:
        print(f"  {trace_summary(trace)}")
    print(f"\nmemory per block (tracemalloc, {args.memory_blocks}-block pool)")
    print(f"{'state':<34} {'kvledger':>9} {'vLLM':>9} {'ratio':>6}")
    labels = {"empty_pool": "fresh pool (B/block)", "all_cached": "every block cached, free (B/block)",
              "block_object": "KVCacheBlock (sys.getsizeof, B)"}  # fmt: skip
    for key, label in labels.items():
        a = ours["memory"][key]
        b = theirs["memory"][key] if theirs else None
        ratio = f"{a / b:.2f}x" if b else "-"
        print(f"{label:<34} {a:>9.1f} {(f'{b:.1f}' if b else '-'):>9} {ratio:>6}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=("shared-prefix", "blog", "both"), default="both")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hash-algo", choices=("sha256", "sha256_cbor"), default="sha256")
    parser.add_argument("--memory-blocks", type=int, default=20_000)
    parser.add_argument("--vllm-venv", default=os.environ.get("KVLEDGER_VLLM_ORACLE"),
                        help="vLLM 0.33's venv (default: $KVLEDGER_VLLM_ORACLE)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--side", choices=("vllm",), help=argparse.SUPPRESS)
    parser.add_argument("--trace", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.side == "vllm":
        return side_main(args)
    names = ("shared-prefix", "blog") if args.workload == "both" else (args.workload,)
    traces = [record_trace(name, args.requests, args.hash_algo) for name in names]
    theirs = run_vllm_side(args.vllm_venv, traces, args) if args.vllm_venv else None
    ours = measure_side(LedgerSide(args.hash_algo), traces, args.repeats, args.memory_blocks)
    result = report(traces, ours, theirs, args)
    if args.json:
        result["machine"] = {"python": sys.version.split()[0], "cpus": os.cpu_count()}
        skip = ("side", "trace", "out")
        result["args"] = {k: str(v) for k, v in vars(args).items() if k not in skip}
        result["traces"] = [trace_summary(trace) for trace in traces]
        args.json.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
