"""Paged-attention kernels on a GPU against the memory-bandwidth limit and named baselines.

Decode (one query per sequence) over batch x context, head_dim 128, block 16, bf16, GQA 4
(32 query / 8 KV heads; a few GQA 8 and MHA rows): GPU time (CUDA events, warmed up, L2
flushed before every call) and achieved bandwidth = KV bytes read / time, next to the
device-to-device copy bandwidth of the same run. Side by side on identical HND pages (see
kernel_baselines.py): FlashInfer's batch decode with and without tensor cores (when
`flashinfer-python` is installed), SDPA on gathered K/V, SDPA on dense K/V (gather-free). Then
prefill/extend against gather-free SDPA, a small model's decode step eager vs CUDA graph, and
the cache write. Writes kernels.json after every case (partial results survive a timeout).

    python benchmarks/kernels.py [--out benchmarks/results] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import math
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder comes first on sys.path and "kernels" would be this file.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import kernel_baselines as methods  # noqa: E402

import kernels  # noqa: E402
from kernels import build, cuda, reference  # noqa: E402

HEAD_DIM, BLOCK_SIZE, DTYPE, DEVICE = 128, 16, torch.bfloat16, "cuda"
GQA4 = (32, 8)  # query heads, KV heads
DECODE_CASES = [(GQA4, b, c) for b in (1, 16, 64, 256) for c in (512, 4096, 16384)] + [
    ((64, 8), 64, 4096), ((64, 8), 64, 16384), ((32, 32), 16, 4096)  # GQA 8; MHA (CUDA cores)
]  # fmt: skip
QUICK_CASES = [(GQA4, 1, 4096), (GQA4, 64, 4096), ((64, 8), 64, 4096)]
TARGET_FRACTION = 0.85  # of copy bandwidth, at batch 64 x context 4096 and above
FLUSH_BYTES = 512 << 20  # > 60 MB L2; its memset also keeps the GPU busy while we enqueue


class PhaseTimeout(Exception):
    pass


def _alarm(seconds: int) -> None:
    def expire(*_: Any) -> None:
        raise PhaseTimeout(f"over {seconds}s")

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)


class Timer:
    """Median and spread of fn()'s GPU time in ms: CUDA events around each call, L2 flushed
    before each (GC as in production: left on)."""

    def __init__(self) -> None:
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)

    def __call__(self, fn: Callable[[], Any], min_iters: int = 5, budget_s: float = 0.5) -> dict:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times: list[float] = []
        started = time.perf_counter()
        while len(times) < min_iters or (
            time.perf_counter() - started < budget_s and len(times) < 100
        ):
            self.flush.zero_()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        quartiles = statistics.quantiles(times, n=4)
        return {"ms": statistics.median(times), "iqr_ms": quartiles[2] - quartiles[0]}


def copy_bandwidth(timer: Timer) -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = timer(functools.partial(dst.copy_, src))["ms"]
    return 2 * src.numel() / (ms * 1e-3)


def paged_inputs(heads: tuple[int, int], batch: int, context: int, q_len: int = 1) -> dict:
    """`batch` sequences of `context` tokens in randomly placed HND pages, q_len new each."""
    gen = torch.Generator(device=DEVICE).manual_seed(batch * 7 + context)
    pages = math.ceil(context / BLOCK_SIZE)
    shape = kernels.kv_cache_shape(batch * pages, BLOCK_SIZE, heads[1], HEAD_DIM)
    rand = functools.partial(torch.randn, generator=gen, device=DEVICE, dtype=DTYPE)
    order = torch.randperm(batch * pages, generator=gen, device=DEVICE).to(torch.int32)
    return {
        "query": rand(batch * q_len, heads[0], HEAD_DIM),
        "key_cache": rand(shape),
        "value_cache": rand(shape),
        "block_tables": order.view(batch, pages),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=DEVICE),
        "query_start_loc": torch.arange(0, batch * q_len + 1, q_len, device=DEVICE).int(),
        "scale": HEAD_DIM**-0.5,
    }


def kv_bytes(heads: tuple[int, int], batch: int, context: int) -> int:
    return 2 * batch * context * heads[1] * HEAD_DIM * torch.finfo(DTYPE).bits // 8


@functools.cache
def backend(heads: tuple[int, int]) -> kernels.AttentionBackend:
    """What a worker serving this shape on this GPU runs (kernels.select_backend)."""
    spec = kernels.AttentionSpec(torch.device(DEVICE), DTYPE, *heads, HEAD_DIM, BLOCK_SIZE)
    return kernels.select_backend(spec, "cuda")


class Results:
    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / "kernels.json"
        props = torch.cuda.get_device_properties(0)
        self.data: dict[str, Any] = {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
            "torch": torch.__version__, "cuda": torch.version.cuda, "nvcc": _nvcc_version(),
            "shape": {"head_dim": HEAD_DIM, "block_size": BLOCK_SIZE, "dtype": str(DTYPE),
                      "cache_layout": "HND"},
            "phases": {}, "decode": [], "prefill": [], "graphs": [], "cache_write": [],
        }  # fmt: skip
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1))


def _nvcc_version() -> str:
    nvcc = build.find_nvcc()
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout if nvcc else ""
    return out.strip().splitlines()[-1] if out else "none"


def run_phase(results: Results, name: str, limit_s: int, body: Callable[[], None]) -> None:
    """Runs one phase under a SIGALRM limit, recording its status; a failure loses no other."""
    started = time.perf_counter()
    status = "ok"
    _alarm(limit_s)
    try:
        body()
    except PhaseTimeout as exc:
        status = f"timeout: {exc}"
    except Exception as exc:
        status = f"error: {type(exc).__name__}: {exc}"[:400]
    finally:
        signal.alarm(0)
    results.data["phases"][name] = {"status": status, "seconds": time.perf_counter() - started}
    results.save()
    print(f"[phase {name}] {status} ({time.perf_counter() - started:.0f}s)", flush=True)


def decode_sweep(results: Results, timer: Timer, cases: list) -> None:
    copy_bw = results.data["copy_bandwidth"]
    for heads, batch, context in cases:
        inp = paged_inputs(heads, batch, context)
        row: dict[str, Any] = {"heads": heads[0], "kv_heads": heads[1], "batch": batch,
                               "context": context}  # fmt: skip
        ours = methods.kvledger(backend(heads), inp, 1)
        got = ours()
        expected = reference.paged_attention(
            inp["query"][:1], inp["key_cache"], inp["value_cache"], inp["block_tables"][:1],
            inp["seq_lens"][:1], inp["query_start_loc"][:2], inp["scale"],
        )  # fmt: skip
        row["max_abs_error"] = (got[:1].float() - expected.float()).abs().max().item()
        timed = {
            "kvledger": ours,
            "kvledger_step": methods.kvledger_step(backend(heads), inp, 1),
            "sdpa_gather": methods.sdpa_gathered(inp),
        }
        for name, method in timed.items():
            try:
                row[name] = timer(method)
            except torch.OutOfMemoryError as exc:
                row[name] = {"error": f"out of memory: {exc}"[:200]}
            torch.cuda.empty_cache()
        try:
            key, value = methods.dense_kv(inp)
            dense = methods.sdpa_dense_decode(inp, key, value)
            row["sdpa_dense_max_abs_diff"] = (dense().float() - got.float()).abs().max().item()
            row["sdpa_dense"] = timer(dense)
            key = value = None
        except torch.OutOfMemoryError as exc:
            row["sdpa_dense"] = {"error": f"out of memory: {exc}"[:200]}
        ms = row["kvledger"]["ms"]
        row["kvledger_tbps"] = kv_bytes(heads, batch, context) / (ms * 1e-3) / 1e12
        row["fraction_of_copy"] = row["kvledger_tbps"] * 1e12 / copy_bw
        results.data["decode"].append(row)
        results.save()
        print(f"  decode {heads[0]}/{heads[1]} b={batch:4d} ctx={context:6d}: {_ms(row, 'kvledger')}"
              f" ({100 * row['fraction_of_copy']:5.1f}% of copy), step {_ms(row, 'kvledger_step')},"
              f" sdpa-gather {_ms(row, 'sdpa_gather')}, sdpa-dense {_ms(row, 'sdpa_dense')}",
              flush=True)  # fmt: skip
        inp = None
        torch.cuda.empty_cache()


def flashinfer_sweep(results: Results, timer: Timer) -> None:
    """FlashInfer on every decode row measured above (its JIT builds the first time)."""
    for use_tensor_cores in (True, False):
        name = "flashinfer_tc" if use_tensor_cores else "flashinfer"
        fi = methods.FlashInferDecode(torch.device(DEVICE), use_tensor_cores)
        results.data["flashinfer_version"] = fi.version
        for row in results.data["decode"]:
            heads = (row["heads"], row["kv_heads"])
            inp = paged_inputs(heads, row["batch"], row["context"])
            try:
                run = fi.prepare(inp)
                ours = methods.kvledger(backend(heads), inp, 1)()
                row[f"{name}_max_abs_diff"] = (run().float() - ours.float()).abs().max().item()
                row[name] = timer(run)
            except (RuntimeError, ValueError) as exc:  # a shape it does not take: next row
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            results.save()
            print(f"  {name} {heads[0]}/{heads[1]} b={row['batch']} ctx={row['context']}: "
                  f"{_ms(row, name)}", flush=True)  # fmt: skip
            inp = None
            torch.cuda.empty_cache()


def prefill_sweep(results: Results, timer: Timer, q_lens: tuple[int, ...]) -> None:
    """8 sequences each adding q_len tokens over a 4096-token prefix, and pure prefills."""
    for q_len, prefix in [(q, 4096) for q in q_lens] + [(q, 0) for q in q_lens]:
        batch, context = 8, prefix + q_len
        inp = paged_inputs(GQA4, batch, context, q_len)
        row: dict[str, Any] = {"batch": batch, "q_len": q_len, "prefix": prefix}
        row["kvledger"] = timer(methods.kvledger(backend(GQA4), inp, q_len))
        try:
            key, value = methods.dense_kv(inp)
            row["sdpa_dense"] = timer(methods.sdpa_dense_prefill(inp, key, value, q_len))
        except Exception as exc:  # the baseline failing must not lose our row
            row["sdpa_dense"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        key = value = None
        pairs = batch * GQA4[0] * sum(prefix + i + 1 for i in range(q_len))
        for name in ("kvledger", "sdpa_dense"):  # causal FLOPs: QK^T and PV, 2 * dim per pair
            ms = row[name].get("ms")
            row[f"{name}_tflops"] = 4 * HEAD_DIM * pairs / (ms * 1e-3) / 1e12 if ms else 0.0
        results.data["prefill"].append(row)
        results.save()
        print(f"  prefill q_len={q_len:5d} prefix={prefix:5d}: kvledger {_ms(row, 'kvledger')} "
              f"({row['kvledger_tflops']:.0f} TFLOP/s), sdpa-dense {_ms(row, 'sdpa_dense')} "
              f"({row['sdpa_dense_tflops']:.0f} TFLOP/s)", flush=True)  # fmt: skip
        inp = None
        torch.cuda.empty_cache()


def graphs_sweep(results: Results) -> None:
    """A decode step of a small random Llama (8 layers, 32/8 heads of 128), eager vs replayed
    from the CUDA graph of its batch bucket: the launch overhead a graph removes."""
    from kernel_graph_step import decode_step_times

    for batch in (1, 16, 64):
        row = decode_step_times(backend(GQA4), batch, context=1024)
        results.data["graphs"].append(row)
        results.save()
        print(f"  decode step b={batch}: eager {row['eager_ms']:.3f} ms, graph "
              f"{row['graph_ms']:.3f} ms", flush=True)  # fmt: skip


def cache_write_sweep(results: Results, timer: Timer) -> None:
    for tokens in (256, 8192, 65536):
        num_blocks = tokens // BLOCK_SIZE * 2
        key_cache = torch.zeros(kernels.kv_cache_shape(num_blocks, BLOCK_SIZE, 8, HEAD_DIM),
                                device=DEVICE, dtype=DTYPE)  # fmt: skip
        value_cache = torch.zeros_like(key_cache)
        key = torch.randn(tokens, 8, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        value = torch.randn_like(key)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:tokens]
        no_seqs = torch.empty(0, dtype=torch.int32, device=DEVICE)
        plan = backend(GQA4).plan(slots, no_seqs.view(0, 1), no_seqs, no_seqs, 0, 0)
        timed = timer(functools.partial(plan.write_kv, key, value, (key_cache, value_cache)))
        moved = 2 * 2 * key.numel() * key.element_size()  # K and V, read and written
        results.data["cache_write"].append(
            {"tokens": tokens, **timed, "tbps": moved / (timed["ms"] * 1e-3) / 1e12}
        )
        results.save()


def _ms(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if not isinstance(value, dict) or "ms" not in value:
        return f"{'n/a':>8}"
    return f"{value['ms']:8.3f} ms"


def print_table(results: Results) -> None:
    data = results.data
    print(
        f"\n{data['device']}  copy {data.get('copy_bandwidth', 0) / 1e12:.2f} TB/s (read+write)"
        f"  torch {data['torch']}  flashinfer {data.get('flashinfer_version', 'not installed')}"
    )
    names = ("kvledger", "flashinfer_tc", "flashinfer", "sdpa_dense", "sdpa_gather")
    print(f"{'heads':>5} {'batch':>5} {'ctx':>6} | " + " ".join(f"{n:>13}" for n in names)
          + " | TB/s %copy target (median ms; x = time / kvledger)")  # fmt: skip
    for r in data["decode"]:
        ours = r["kvledger"]["ms"]
        cells = []
        for name in names:
            ms = r.get(name, {}).get("ms") if isinstance(r.get(name), dict) else None
            cells.append(f"{'n/a':>13}" if ms is None else f"{ms:7.3f} {ms / ours:4.1f}x")
        big = r["batch"] >= 64 and r["context"] >= 4096
        met = r["fraction_of_copy"] >= TARGET_FRACTION
        target = "met" if met else "MISSED" if big else "-"
        print(f"{r['heads']:>2}/{r['kv_heads']:<2} {r['batch']:>5} {r['context']:>6} | "
              + " ".join(cells) + f" | {r['kvledger_tbps']:4.2f} "
              f"{100 * r['fraction_of_copy']:5.1f}% {target}")  # fmt: skip
    for r in data["prefill"]:
        print(
            f"prefill q_len={r['q_len']:5d} prefix={r['prefix']:5d}: kvledger "
            f"{_ms(r, 'kvledger')} ({r['kvledger_tflops']:.0f} TFLOP/s), sdpa-dense "
            f"{_ms(r, 'sdpa_dense')} ({r['sdpa_dense_tflops']:.0f} TFLOP/s)"
        )
    for r in data["graphs"]:
        print(
            f"decode step b={r['batch']}: eager {r['eager_ms']:.3f} ms, CUDA graph "
            f"{r['graph_ms']:.3f} ms (max |diff| {r['max_abs_diff']:.3g})"
        )
    for r in data["cache_write"]:
        print(f"cache write {r['tokens']:6d} tokens: {r['ms']:.4f} ms, {r['tbps']:.2f} TB/s")
    for name, phase in data["phases"].items():
        print(f"phase {name}: {phase['status']} ({phase['seconds']:.0f}s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--quick", action="store_true", help="a few decode cases only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results = Results(args.out)
    timer = Timer()

    def setup() -> None:
        started = time.perf_counter()
        cuda.load()
        results.data["build_seconds"] = time.perf_counter() - started
        results.data["backend"] = backend(GQA4).name
        results.data["copy_bandwidth"] = copy_bandwidth(timer)

    run_phase(results, "build_and_copy", 300, setup)
    if "copy_bandwidth" not in results.data:
        print_table(results)
        return 1
    cases = QUICK_CASES if args.quick else DECODE_CASES
    run_phase(results, "decode", 150, lambda: decode_sweep(results, timer, cases))
    run_phase(results, "prefill", 45, lambda: prefill_sweep(results, timer, (16, 512, 4096)))
    run_phase(results, "graphs", 45, lambda: graphs_sweep(results))
    run_phase(results, "cache_write", 15, lambda: cache_write_sweep(results, timer))
    if methods.flashinfer_available():
        run_phase(results, "flashinfer", 240, lambda: flashinfer_sweep(results, timer))
    else:
        results.data["phases"]["flashinfer"] = {"status": "not installed", "seconds": 0}
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
