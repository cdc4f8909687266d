"""Paged-attention kernels on a GPU against the memory-bandwidth limit and two baselines.

Decode (one query per sequence) over batch x context, 32 query / 8 KV heads, head_dim 128,
bf16: GPU time (CUDA events, warmed up, L2 flushed before every call), achieved bandwidth =
KV bytes read / time, next to the device-to-device copy bandwidth measured in the same run.
Baselines on identical inputs: SDPA on K/V gathered from the pages, and FlexAttention with a
block mask built from the block tables (where it runs). Then prefill/extend through the public
API (which routes long prefills to gather + SDPA) against the CUDA kernel alone, and the cache
write. Writes kernels.json after every case (partial results survive a timeout) and kernels.png.

    python benchmarks/kernels.py [--out benchmarks/results] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import inspect
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
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder comes first on sys.path and "kernels" would be this file.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]
sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from kernels import cuda, reference  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
BATCHES, CONTEXTS = (1, 16, 64, 256), (512, 4096, 16384)
PREFIX = 4096  # cached tokens before an extend in the prefill sweep
TARGET_FRACTION = 0.85  # of copy bandwidth, at batch 64 x context 4096 and above
FLUSH_BYTES = 512 << 20  # > 60 MB L2; its memset also keeps the GPU busy while we enqueue
DEVICE = "cuda"


class PhaseTimeout(Exception):
    pass


def _alarm(seconds: int) -> None:
    def expire(*_: Any) -> None:
        raise PhaseTimeout(f"over {seconds}s")

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)


class Timer:
    """Median GPU time of fn() in ms: CUDA events around each call, L2 flushed before each."""

    def __init__(self) -> None:
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)

    def __call__(self, fn: Callable[[], Any], min_iters: int = 5, budget_s: float = 0.5) -> float:
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
        return statistics.median(times)


def copy_bandwidth(timer: Timer) -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = timer(functools.partial(dst.copy_, src))
    return 2 * src.numel() / (ms * 1e-3)


# ---- inputs ------------------------------------------------------------------------------------


def decode_inputs(batch: int, context: int, seed: int = 0) -> dict[str, Any]:
    """A decode step: `batch` sequences of `context` tokens in randomly placed pages."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    pages = context // BLOCK_SIZE
    num_blocks = batch * pages
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=gen, device=DEVICE, dtype=DTYPE)
    value_cache = torch.randn(shape, generator=gen, device=DEVICE, dtype=DTYPE)
    order = torch.randperm(num_blocks, generator=gen, device=DEVICE).to(torch.int32)
    return {
        "query": torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device=DEVICE, dtype=DTYPE),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": order.view(batch, pages),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=DEVICE),
        "query_start_loc": torch.arange(batch + 1, dtype=torch.int32, device=DEVICE),
        "scale": HEAD_DIM**-0.5,
    }


def kv_bytes(batch: int, context: int) -> int:
    return 2 * batch * context * KV_HEADS * HEAD_DIM * torch.finfo(DTYPE).bits // 8


# ---- the methods -------------------------------------------------------------------------------


@functools.cache
def backend() -> kernels.AttentionBackend:
    """What a worker serving this shape on this GPU runs (kernels.select_backend)."""
    spec = kernels.AttentionSpec(torch.device(DEVICE), DTYPE, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE)
    return kernels.select_backend(spec, "cuda")


def ours(inp: dict[str, Any], max_query_len: int, max_seq_len: int) -> torch.Tensor:
    """The worker's path: one step plan, attention through it (decodes in the kernel, long
    prefills through SDPA on gathered K/V)."""
    no_slots = torch.empty(0, dtype=torch.long, device=DEVICE)
    plan = backend().plan(
        no_slots, inp["block_tables"], inp["seq_lens"], inp["query_start_loc"],
        max_query_len, max_seq_len,
    )  # fmt: skip
    return plan.attention(inp["query"], (inp["key_cache"], inp["value_cache"]), inp["scale"])


def kernel_only(inp: dict[str, Any], max_query_len: int, max_seq_len: int) -> torch.Tensor:
    """The CUDA kernel on the whole batch, whatever the query lengths (no SDPA route)."""
    return cuda.load().paged_attention(
        inp["query"], inp["key_cache"], inp["value_cache"], inp["block_tables"],
        inp["seq_lens"], inp["query_start_loc"], inp["scale"], max_query_len, max_seq_len,
        torch.cuda.current_stream().cuda_stream,
        torch.cuda.get_device_properties(0).multi_processor_count,
    )  # fmt: skip


def sdpa_gathered_decode(inp: dict[str, Any], context: int) -> torch.Tensor:
    """Baseline: gather every sequence's pages into dense K/V, then one batched SDPA call."""
    batch = inp["query"].shape[0]
    blocks = inp["block_tables"].long()
    key = inp["key_cache"][blocks].view(batch, context, KV_HEADS, HEAD_DIM).transpose(1, 2)
    value = inp["value_cache"][blocks].view(batch, context, KV_HEADS, HEAD_DIM).transpose(1, 2)
    q = inp["query"][:, :, None]
    out = F.scaled_dot_product_attention(q, key, value, scale=inp["scale"], enable_gqa=True)
    return out[:, :, 0]


class FlexPaged:
    """Baseline: FlexAttention over the physical cache, its block mask built from the block
    tables (KV block = page), so it reads only each sequence's pages."""

    def __init__(self, compile: bool = True) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self.flex = torch.compile(flex_attention, dynamic=False) if compile else flex_attention

    def prepare(self, inp: dict[str, Any], context: int) -> Callable[[], torch.Tensor]:
        from torch.nn.attention.flex_attention import BlockMask

        batch = inp["query"].shape[0]
        pages = context // BLOCK_SIZE
        physical_len = inp["key_cache"].shape[0] * BLOCK_SIZE
        # Every page belongs to one sequence here: the mask keeps a sequence's own pages (the
        # block mask already skips the others) and, by logical position, not a partial tail.
        tables = inp["block_tables"].long()
        owner = torch.empty(inp["key_cache"].shape[0], dtype=torch.int64, device=DEVICE)
        owner[tables] = torch.arange(batch, device=DEVICE)[:, None].expand(-1, pages)
        logical_page = torch.empty_like(owner)
        logical_page[tables] = torch.arange(pages, device=DEVICE).expand(batch, -1)
        seq_lens = inp["seq_lens"]

        def mask_mod(b, h, q_idx, kv_idx):
            page = kv_idx // BLOCK_SIZE
            position = logical_page[page] * BLOCK_SIZE + kv_idx % BLOCK_SIZE
            return (owner[page] == b) & (position < seq_lens[b])

        extra = {}
        if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters:
            extra["compute_q_blocks"] = False  # the transposed view serves backward only
        mask = BlockMask.from_kv_blocks(
            torch.full((batch, 1, 1), pages, dtype=torch.int32, device=DEVICE),
            inp["block_tables"][:, None, None, :].contiguous(),
            BLOCK_SIZE=(128, BLOCK_SIZE),
            mask_mod=mask_mod,
            seq_lengths=(1, physical_len),
            **extra,
        )
        # The NHD cache seen as one long [1, kv_heads, slots, dim] sequence: a view, no copy.
        key = inp["key_cache"].view(1, physical_len, KV_HEADS, HEAD_DIM).transpose(1, 2)
        value = inp["value_cache"].view(1, physical_len, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q = inp["query"][:, :, None]

        def run() -> torch.Tensor:
            out = self.flex(q, key, value, block_mask=mask, scale=inp["scale"], enable_gqa=True)
            return out[:, :, 0]

        return run


# ---- phases ------------------------------------------------------------------------------------


class Results:
    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / "kernels.json"
        props = torch.cuda.get_device_properties(0)
        self.data: dict[str, Any] = {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(0),
            "sms": props.multi_processor_count,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nvcc": _nvcc_version(),
            "shape": {
                "heads": HEADS,
                "kv_heads": KV_HEADS,
                "head_dim": HEAD_DIM,
                "block_size": BLOCK_SIZE,
                "dtype": str(DTYPE),
            },
            "phases": {},
            "decode": [],
            "prefill": [],
            "cache_write": [],
        }
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1))


def _nvcc_version() -> str:
    nvcc = cuda.build.find_nvcc()
    if nvcc is None:
        return "none"
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1] if out else "unknown"


def run_phase(results: Results, name: str, limit_s: int | None, body: Callable[[], None]) -> None:
    """Runs one phase under a SIGALRM limit (None: the phase keeps its own), recording status."""
    started = time.perf_counter()
    status = "ok"
    if limit_s is not None:
        _alarm(limit_s)
    try:
        body()
    except PhaseTimeout as exc:
        status = f"timeout: {exc}"
    except Exception as exc:  # one broken phase must not lose the others' results
        status = f"error: {type(exc).__name__}: {exc}"
    finally:
        signal.alarm(0)
    results.data["phases"][name] = {"status": status, "seconds": time.perf_counter() - started}
    results.save()
    print(f"[phase {name}] {status} ({time.perf_counter() - started:.0f}s)", flush=True)


def decode_sweep(results: Results, timer: Timer, batches, contexts) -> None:
    copy_bw = results.data["copy_bandwidth"]
    for batch in batches:
        for context in contexts:
            inp = decode_inputs(batch, context)
            expected = reference.paged_attention(
                inp["query"][:1], inp["key_cache"], inp["value_cache"], inp["block_tables"][:1],
                inp["seq_lens"][:1], inp["query_start_loc"][:2], inp["scale"],
            )  # fmt: skip
            got = ours(inp, 1, context)
            error = (got[:1].float() - expected.float()).abs().max().item()
            row: dict[str, Any] = {"batch": batch, "context": context, "max_abs_error": error}
            ms = timer(functools.partial(ours, inp, 1, context))
            row["kvledger_ms"] = ms
            row["kvledger_tbps"] = kv_bytes(batch, context) / (ms * 1e-3) / 1e12
            row["fraction_of_copy"] = row["kvledger_tbps"] * 1e12 / copy_bw
            try:
                ms = timer(functools.partial(sdpa_gathered_decode, inp, context))
                row["sdpa_gather_ms"] = ms
            except torch.OutOfMemoryError as exc:
                row["sdpa_gather_ms"] = None
                row["sdpa_gather_error"] = f"out of memory: {exc}"[:200]
            torch.cuda.empty_cache()
            results.data["decode"].append(row)
            results.save()
            _print_decode_row(row)
            inp = None
            torch.cuda.empty_cache()


def flex_sweep(results: Results, timer: Timer, per_case_s: int, total_s: int) -> None:
    """FlexAttention where it runs, most important case first; compiling each shape is slow."""
    flex = FlexPaged()
    deadline = time.perf_counter() + total_s
    rows = sorted(results.data["decode"], key=lambda r: (r["batch"] != 64, -r["context"]))
    for row in rows:
        left = int(deadline - time.perf_counter())
        if left < 5:
            row["flex_ms"], row["flex_error"] = None, "not run: phase time budget spent"
            continue
        inp = decode_inputs(row["batch"], row["context"])
        _alarm(min(per_case_s, left))
        try:
            run = flex.prepare(inp, row["context"])
            got = run()
            row["flex_max_abs_diff"] = (
                (got.float() - ours(inp, 1, row["context"]).float()).abs().max().item()
            )
            row["flex_ms"] = timer(run)
        except PhaseTimeout:
            row["flex_ms"], row["flex_error"] = None, f"over {per_case_s}s (compile?)"
        except Exception as exc:
            row["flex_ms"], row["flex_error"] = None, f"{type(exc).__name__}: {exc}"[:300]
        finally:
            signal.alarm(0)
        results.save()
        outcome = row.get("flex_ms") or row.get("flex_error")
        print(f"  flex b={row['batch']} ctx={row['context']}: {outcome}", flush=True)
        inp = None
        torch.cuda.empty_cache()


def prefill_sweep(results: Results, timer: Timer, q_lens) -> None:
    """8 sequences each adding q_len tokens over a 4096-token prefix, and pure prefills."""
    for q_len, prefix in [(q, PREFIX) for q in q_lens] + [(q, 0) for q in q_lens]:
        batch, context = 8, prefix + q_len
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        pages = math.ceil(context / BLOCK_SIZE)
        shape = (batch * pages, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        inp = {
            "query": torch.randn(
                batch * q_len, HEADS, HEAD_DIM, generator=gen, device=DEVICE, dtype=DTYPE
            ),
            "key_cache": torch.randn(shape, generator=gen, device=DEVICE, dtype=DTYPE),
            "value_cache": torch.randn(shape, generator=gen, device=DEVICE, dtype=DTYPE),
            "block_tables": torch.randperm(batch * pages, generator=gen, device=DEVICE)
            .to(torch.int32)
            .view(batch, pages),
            "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=DEVICE),
            "query_start_loc": torch.arange(
                0, batch * q_len + 1, q_len, dtype=torch.int32, device=DEVICE
            ),
            "scale": HEAD_DIM**-0.5,
        }
        # causal FLOPs: QK^T and PV, each 2 * dim per visible (query, key) pair
        pairs = batch * HEADS * sum(prefix + i + 1 for i in range(q_len))
        flops = 4 * HEAD_DIM * pairs
        row: dict[str, Any] = {"batch": batch, "q_len": q_len, "prefix": prefix}
        row["api_ms"] = timer(functools.partial(ours, inp, q_len, context))
        row["api_route"] = (
            "gather+sdpa" if q_len >= cuda.PREFILL_SDPA_MIN_QUERY_LEN else "cuda kernel"
        )
        row["kernel_ms"] = timer(functools.partial(kernel_only, inp, q_len, context))
        row["api_tflops"] = flops / (row["api_ms"] * 1e-3) / 1e12
        row["kernel_tflops"] = flops / (row["kernel_ms"] * 1e-3) / 1e12
        results.data["prefill"].append(row)
        results.save()
        print(
            f"  prefill q_len={q_len:5d} prefix={prefix:5d}: api {row['api_ms']:.3f} ms "
            f"({row['api_route']}), kernel {row['kernel_ms']:.3f} ms",
            flush=True,
        )
        inp = None
        torch.cuda.empty_cache()


def cache_write_sweep(results: Results, timer: Timer) -> None:
    for tokens in (256, 8192, 65536):
        num_blocks = tokens // BLOCK_SIZE * 2
        shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        key_cache = torch.zeros(shape, device=DEVICE, dtype=DTYPE)
        value_cache = torch.zeros_like(key_cache)
        key = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        value = torch.randn_like(key)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:tokens]
        no_seqs = torch.empty(0, dtype=torch.int32, device=DEVICE)
        plan = backend().plan(slots, no_seqs.view(0, 1), no_seqs, no_seqs, 0, 0)
        write = functools.partial(plan.write_kv, key, value, (key_cache, value_cache))
        ms = timer(write)
        moved = 2 * 2 * key.numel() * key.element_size()  # K and V, read and written
        results.data["cache_write"].append(
            {"tokens": tokens, "ms": ms, "tbps": moved / (ms * 1e-3) / 1e12}
        )
        results.save()


# ---- report ------------------------------------------------------------------------------------


def _print_decode_row(row: dict[str, Any]) -> None:
    sdpa = row.get("sdpa_gather_ms")
    print(
        f"  decode b={row['batch']:4d} ctx={row['context']:6d}: {row['kvledger_ms']:8.3f} ms "
        f"{row['kvledger_tbps']:5.2f} TB/s ({100 * row['fraction_of_copy']:5.1f}% of copy)  "
        f"sdpa-gather {sdpa if sdpa is None else f'{sdpa:8.3f} ms'}",
        flush=True,
    )


def print_table(results: Results) -> None:
    data = results.data
    copy_tbps = data.get("copy_bandwidth", 0) / 1e12
    print(f"\n{data['device']}  copy {copy_tbps:.2f} TB/s (read+write)  torch {data['torch']}")
    head = f"{'batch':>5} {'ctx':>6} | {'ours ms':>8} {'TB/s':>5} {'%copy':>6} | "
    print(head + f"{'sdpa ms':>8} {'flex ms':>8} | {'x sdpa':>6} {'x flex':>6} | target")
    for r in data["decode"]:
        sdpa, flex = r.get("sdpa_gather_ms"), r.get("flex_ms")
        big = r["batch"] >= 64 and r["context"] >= 4096
        target = (
            "-" if not big else ("met" if r["fraction_of_copy"] >= TARGET_FRACTION else "MISSED")
        )
        faster = all(x is None or r["kvledger_ms"] < x for x in (sdpa, flex))
        print(
            f"{r['batch']:>5} {r['context']:>6} | {r['kvledger_ms']:8.3f} {r['kvledger_tbps']:5.2f} "
            f"{100 * r['fraction_of_copy']:5.1f}% | {_ms(sdpa)} {_ms(flex)} | "
            f"{_ratio(sdpa, r)} {_ratio(flex, r)} | {target}{'' if faster else ' SLOWER'}"
        )
    for r in data["prefill"]:
        print(
            f"prefill q_len={r['q_len']:5d} prefix={r['prefix']:5d}: api {r['api_ms']:.3f} ms "
            f"({r['api_route']}, {r['api_tflops']:.1f} TFLOP/s); cuda kernel "
            f"{r['kernel_ms']:.3f} ms ({r['kernel_tflops']:.1f} TFLOP/s)"
        )
    for r in data["cache_write"]:
        print(f"cache write {r['tokens']:6d} tokens: {r['ms']:.4f} ms, {r['tbps']:.2f} TB/s")
    for name, phase in data["phases"].items():
        print(f"phase {name}: {phase['status']} ({phase['seconds']:.0f}s)")


def _ms(x: float | None) -> str:
    return f"{'n/a':>8}" if x is None else f"{x:8.3f}"


def _ratio(x: float | None, row: dict[str, Any]) -> str:
    return f"{'n/a':>6}" if x is None else f"{x / row['kvledger_ms']:5.1f}x"


def plot(results: Results, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results.data["decode"]
    labels = [f"{r['batch']}x{r['context']}" for r in rows]
    fig, ax = plt.subplots(figsize=(12, 5))
    x = range(len(rows))
    methods = [("kvledger_ms", "kvledger"), ("sdpa_gather_ms", "SDPA (gather)")]
    methods.append(("flex_ms", "FlexAttention"))
    for offset, (key, name) in zip((-0.27, 0.0, 0.27), methods, strict=True):
        tbps = [
            kv_bytes(r["batch"], r["context"]) / r[key] / 1e9 if r.get(key) else 0 for r in rows
        ]
        ax.bar([i + offset for i in x], tbps, width=0.27, label=name)
    copy_tbps = results.data["copy_bandwidth"] / 1e12
    ax.axhline(copy_tbps, color="k", linestyle="--", label=f"copy {copy_tbps:.2f} TB/s")
    ax.axhline(TARGET_FRACTION * copy_tbps, color="r", linestyle=":", label="85% of copy")
    ax.set_xticks(list(x), labels, rotation=45)
    ax.set_xlabel("batch x context")
    ax.set_ylabel("KV bytes read / time (TB/s)")
    shape = f"{HEADS}q/{KV_HEADS}kv heads, d={HEAD_DIM}, bf16"
    ax.set_title(f"Paged decode, {shape} - {results.data['device']}, {results.data['date'][:10]}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "kernels.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--quick", action="store_true", help="a few small cases only")
    parser.add_argument("--no-flex", action="store_true", help="skip the FlexAttention baseline")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    batches, contexts = ((1, 64), (512, 4096)) if args.quick else (BATCHES, CONTEXTS)
    results = Results(args.out)
    timer = Timer()

    def setup() -> None:
        started = time.perf_counter()
        cuda.load()
        results.data["build_seconds"] = time.perf_counter() - started
        results.data["backend"] = backend().name
        results.data["copy_bandwidth"] = copy_bandwidth(timer)

    run_phase(results, "build_and_copy", 300, setup)
    if "copy_bandwidth" not in results.data:
        print_table(results)
        return 1
    run_phase(results, "decode", 150, lambda: decode_sweep(results, timer, batches, contexts))
    run_phase(results, "prefill", 60, lambda: prefill_sweep(results, timer, (16, 128, 1024)))
    run_phase(results, "cache_write", 20, lambda: cache_write_sweep(results, timer))
    if not args.no_flex:
        run_phase(results, "flex", None, lambda: flex_sweep(results, timer, 60, total_s=150))
    try:
        plot(results, args.out)
    except Exception as exc:  # matplotlib missing or a bad row: the JSON and table still stand
        print(f"no plot: {exc}")
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
