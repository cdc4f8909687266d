"""TP=1 against TP=2 over NCCL on CUDA: forward latency of one prompt and the logits' agreement.

    python benchmarks/tp_nccl.py [--hidden 2048] [--layers 6] [--tokens 512] [--reps 10] \
        [--json benchmarks/results/tp_nccl.json]

Writes a random Llama checkpoint (benchmarks/tp_memory.py's) once, then per size runs one
process per rank (rank r on cuda:r, bfloat16, process group over a TCPStore as the worker forms
it), each timing `dense_logits` of the same prompt (CUDA-synchronised, after a warm-up). A group
lives as long as its processes, so each size's repetitions run back to back (not interleaved);
the table shows median and spread, TP=1 the baseline, and the largest difference of the last
position's logits between the sizes. NCCL refuses two ranks on one GPU: with fewer than 2 GPUs
the results file says so and nothing runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def child(folder: str, rank: int, size: int, port: int, tokens: int, reps: int, out: str) -> None:
    import torch

    from gpu_worker.checkpoint import load_checkpoint
    from gpu_worker.parallel import TensorParallel, connect_store, form_group, host_store

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    tp = TensorParallel(rank, size)
    model = load_checkpoint(folder, dtype="bfloat16", device=device, tp=tp)
    if size > 1:
        store = (host_store if rank == 0 else connect_store)("127.0.0.1", port, size, 120.0)
        form_group(tp, store, "bench", device, 120.0)
    prompt = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=prompt).tolist()
    logits = model.dense_logits(ids)  # warm-up (and NCCL's own set-up)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        logits = model.dense_logits(ids)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1000)
    if rank == 0:
        last = logits[-1].float().cpu().tolist()
        Path(out + ".json").write_text(json.dumps({"ms": times, "last_logits": last}))


def run_size(folder: Path, size: int, args: argparse.Namespace, tmp: Path) -> dict:
    out = str(tmp / f"tp{size}")
    port = 29500 + size
    common = [str(port), str(args.tokens), str(args.reps), out]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", str(folder), str(rank), str(size), *common],
            cwd=ROOT,
        )
        for rank in range(size)
    ]
    codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        raise SystemExit(f"TP={size}: ranks exited {codes}")
    return json.loads(Path(out + ".json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", nargs=7, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        folder, rank, size, port, tokens, reps, out = args.child
        child(folder, int(rank), int(size), int(port), int(tokens), int(reps), out)
        return
    import torch

    from benchmarks.tp_memory import write_checkpoint
    from kvledger.report import format_table

    result: dict = {"args": {k: v for k, v in vars(args).items() if k not in ("json", "child")}}
    gpus = torch.cuda.device_count()
    if gpus < 2:
        result["skipped"] = f"TP=2 over NCCL needs 2 GPUs (one per rank); found {gpus}"
        print(result["skipped"])
    else:
        with tempfile.TemporaryDirectory() as name:
            tmp = Path(name)
            write_checkpoint(tmp / "ckpt", args.hidden, args.layers, args.vocab)
            runs = {size: run_size(tmp / "ckpt", size, args, tmp) for size in (1, 2)}
        tp1, tp2 = (torch.tensor(runs[n].pop("last_logits")) for n in (1, 2))
        diff = (tp2 - tp1).abs().max().item()
        rows = []
        for size, run in runs.items():
            ms = run["ms"]
            result[f"tp{size}"] = {
                "median_ms": statistics.median(ms), "spread_ms": max(ms) - min(ms), "ms": ms,
            }  # fmt: skip
            rows.append([f"TP={size}", f"{statistics.median(ms):.2f}", f"{max(ms) - min(ms):.2f}"])
        result["max_abs_logit_diff_tp2_vs_tp1_bf16"] = diff
        print(f"{args.tokens}-token prompt, {args.reps} reps, bfloat16; TP=1 is the baseline")
        print(format_table(["size", "median ms", "spread ms"], rows))
        print(f"largest |logit TP=2 - TP=1| (bfloat16): {diff:.4f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
