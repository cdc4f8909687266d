"""`kvledger simulate`: run the ledger on the blog's workload and print its tables.

With `--policy blog` the figures must equal the blog's (`../shared/seeds/004_*.txt`); the
`match` column says so row by row. With `--policy vllm` our scheduler runs the same workload,
and a shared-prefix workload shows what prefix caching saves.
"""

from __future__ import annotations

import argparse
import sys
import time

from kvledger.report import format_table, now_stamp, write_json
from kvledger.simulate import prefix_granularity, run_blog_paged, run_contiguous, run_vllm
from kvledger.workloads import blog_lengths, blog_workload, shared_prefix_workload

# The blog's published figures (peak, steps, avg wait, waste %, preemptions) to check against.
BLOG_HEADLINE = {"contiguous": (24, 3524, 178.9), "paged-b16": (157, 1264, 180.3, 1.02, 4)}
BLOG_BLOCK_SWEEP = {
    8: (158, 0.50, 6),
    16: (157, 1.02, 4),
    32: (155, 2.18, 2),
    64: (153, 4.58, 7),
    128: (147, 9.08, 8),
}
BLOG_WATERMARK_SWEEP = {
    0.0: (157, 4, 1264),
    0.01: (156, 0, 1264),
    0.02: (154, 0, 1264),
    0.05: (152, 0, 1265),
    0.10: (145, 0, 1279),
}
BLOCK_SIZES = (8, 16, 32, 64, 128)
WATERMARKS = (0.0, 0.01, 0.02, 0.05, 0.10)


def _mark(ok: bool) -> str:
    return "yes" if ok else "NO"


def run_and_report(args: argparse.Namespace) -> int:
    started = time.monotonic()
    progress = None if args.quiet else _progress
    results: dict[str, object] = {"generated_at": now_stamp(), "requests": args.requests}
    lengths = blog_lengths(args.requests)
    all_match = True
    if args.policy in ("blog", "all"):
        all_match = _blog_tables(lengths, results, args.requests == 400)
    if args.policy in ("vllm", "all"):
        _vllm_tables(args.requests, results, progress)
    if args.json:
        write_json(args.json, results)
        print(f"\nwrote {args.json}")
    if args.plot:
        _plot(results, args.plot)
        print(f"wrote {args.plot}")
    print(f"\n({time.monotonic() - started:.1f} s)")
    return 0 if all_match else 1


def _blog_tables(lengths, results: dict, check: bool) -> bool:
    total = sum(p + o for p, o in lengths)
    print(
        f"Workload (blog, seed 20261013): {len(lengths)} requests, {total:,} tokens, "
        f"max {max(p + o for p, o in lengths):,}; pool 100,000 token slots, max_model_len 4,096\n"
    )
    contiguous, paged = run_contiguous(lengths), run_blog_paged(lengths)
    ok = [
        not check
        or (contiguous.peak_concurrency, contiguous.steps, contiguous.avg_wait_steps)
        == BLOG_HEADLINE["contiguous"],
        not check
        or (
            paged.peak_concurrency,
            paged.steps,
            paged.avg_wait_steps,
            paged.internal_waste_pct,
            paged.preemptions,
        )
        == BLOG_HEADLINE["paged-b16"],
    ]
    print(
        format_table(
            [
                "allocator",
                "peak concurrency",
                "steps",
                "avg wait (steps)*",
                "internal waste",
                "preemptions",
                "matches blog",
            ],
            [
                [
                    "contiguous (4,096 per request)",
                    contiguous.peak_concurrency,
                    contiguous.steps,
                    contiguous.avg_wait_steps,
                    "-",
                    "-",
                    _mark(ok[0]),
                ],
                [
                    "paged on demand (block 16)",
                    paged.peak_concurrency,
                    paged.steps,
                    paged.avg_wait_steps,
                    f"{paged.internal_waste_pct:.2f}%",
                    paged.preemptions,
                    _mark(ok[1]),
                ],
            ],
            title="A. Contiguous vs paged, the blog's rules over our BlockPool",
        )
    )
    print(
        f"   peak blocks used {paged.peak_blocks_used:,} of {paged.total_blocks:,}. *The blog's script counts "
        "a request's wait in steps after its admission; reproduced as defined.\n"
    )
    rows, sweep = [], []
    for b in BLOCK_SIZES:
        r = run_blog_paged(lengths, b)
        match = (
            not check
            or (r.peak_concurrency, r.internal_waste_pct, r.preemptions) == BLOG_BLOCK_SWEEP[b]
        )
        ok.append(match)
        rows.append(
            [
                b,
                r.peak_concurrency,
                f"{r.internal_waste_pct:.2f}%",
                r.preemptions,
                r.steps,
                _mark(match),
            ]
        )
        sweep.append(r.as_dict())
    print(
        format_table(
            [
                "block size",
                "peak concurrency",
                "internal waste",
                "preemptions",
                "steps",
                "matches blog",
            ],
            rows,
            title="B. Block size (blog rules)",
        )
        + "\n"
    )
    rows, wm_sweep = [], []
    for wm in WATERMARKS:
        r = run_blog_paged(lengths, 16, wm)
        match = (
            not check or (r.peak_concurrency, r.preemptions, r.steps) == BLOG_WATERMARK_SWEEP[wm]
        )
        ok.append(match)
        rows.append([f"{wm:.2f}", r.peak_concurrency, r.preemptions, r.steps, _mark(match)])
        wm_sweep.append(r.as_dict())
    print(
        format_table(
            ["watermark", "peak concurrency", "preemptions", "steps", "matches blog"],
            rows,
            title="C. Watermark (blog rules, block 16)",
        )
        + "\n"
    )
    rows = []
    for p in (777, 1000, 1500, 3000):
        rows.append(
            [p]
            + [
                f"{c:,} (lose {pct:.2f}%)"
                for c, _, pct in (prefix_granularity(p, b) for b in (8, 16, 32, 64))
            ]
        )
    print(
        format_table(
            ["shared prefix", "block 8", "block 16", "block 32", "block 64"],
            rows,
            title="D. Prefix caching only counts whole blocks",
        )
        + "\n"
    )
    results["blog"] = {
        "contiguous": contiguous.as_dict(),
        "paged": paged.as_dict(),
        "block_sweep": sweep,
        "watermark_sweep": wm_sweep,
    }
    if check and not all(ok):
        print(
            "Some figures differ from the blog's: see the 'matches blog' columns.", file=sys.stderr
        )
    return all(ok)


def _vllm_tables(n: int, results: dict, progress) -> None:
    workload = blog_workload(n)
    rows, sweep = [], []
    for b in BLOCK_SIZES:
        r = run_vllm(workload, block_size=b, progress=progress, label=f"vllm b{b}")
        sweep.append(r.as_dict())
        rows.append(
            [
                b,
                r.peak_concurrency,
                r.steps,
                r.preemptions,
                f"{r.internal_waste_pct:.2f}%",
                r.avg_wait_steps,
            ]
        )
    print(
        format_table(
            [
                "block size",
                "peak concurrency",
                "steps",
                "preemptions",
                "internal waste",
                "avg queue wait (steps)",
            ],
            rows,
            title="E. Our scheduler on the same workload (token budget 8,192, max_num_seqs 256, chunked prefill)",
        )
    )
    print(
        "   Steps differ from the blog's: prefill costs token budget here, and admissions are not capped at one per step.\n"
    )
    rows, wm_sweep = [], []
    for wm in WATERMARKS:
        r = run_vllm(workload, watermark=wm, progress=progress, label=f"vllm wm{wm}")
        wm_sweep.append(r.as_dict())
        rows.append([f"{wm:.2f}", r.peak_concurrency, r.preemptions, r.steps])
    print(
        format_table(
            ["watermark", "peak concurrency", "preemptions", "steps"],
            rows,
            title="F. Our scheduler, watermark sweep (block 16)",
        )
        + "\n"
    )
    shared = shared_prefix_workload(n)
    on = run_vllm(shared, enable_caching=True, progress=progress, label="shared, caching on")
    off = run_vllm(shared, enable_caching=False, progress=progress, label="shared, caching off")
    rows = [
        [
            label,
            r.prefill_tokens_computed,
            r.prefix_hit_tokens,
            r.blocks_allocated,
            r.blocks_evicted,
            r.steps,
            r.preemptions,
        ]
        for label, r in (("prefix caching on", on), ("prefix caching off", off))
    ]
    print(
        format_table(
            [
                "",
                "prefill tokens computed",
                "prefix-cache hit tokens",
                "blocks allocated",
                "blocks evicted",
                "steps",
                "preemptions",
            ],
            rows,
            title="G. Shared prefixes (8 system prompts of 1,000 tokens before each prompt)",
        )
    )
    saved = 1 - on.prefill_tokens_computed / max(off.prefill_tokens_computed, 1)
    print(
        f"   prefix caching saves {saved:.1%} of prefill tokens and {off.blocks_allocated - on.blocks_allocated:,} block allocations\n"
    )
    results["vllm"] = {
        "block_sweep": sweep,
        "watermark_sweep": wm_sweep,
        "shared_prefix": {"on": on.as_dict(), "off": off.as_dict()},
    }


def _progress(label: str, done: int, total: int) -> None:
    print(
        f"\r  {label}: {done}/{total} requests finished",
        end="" if done < total else "\n",
        file=sys.stderr,
        flush=True,
    )


def _plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    blog = results.get("blog")
    ours = results.get("vllm")
    ax = axes[0]
    for label, data in (("blog rules", blog), ("our scheduler", ours)):
        if data:
            sweep = data["block_sweep"]
            ax.plot(
                [r["block_size"] for r in sweep],
                [r["peak_concurrency"] for r in sweep],
                marker="o",
                label=label,
            )
    ax.set_xscale("log", base=2)
    ax.set(title="Peak concurrency by block size", xlabel="block size (tokens)", ylabel="requests")
    ax.legend()
    ax = axes[1]
    for label, data in (("blog rules", blog), ("our scheduler", ours)):
        if data:
            sweep = data["watermark_sweep"]
            ax.plot(
                [r["watermark"] for r in sweep],
                [r["preemptions"] for r in sweep],
                marker="o",
                label=label,
            )
    ax.set(title="Preemptions by watermark", xlabel="watermark", ylabel="preemptions")
    ax.legend()
    ax = axes[2]
    if ours:
        on, off = ours["shared_prefix"]["on"], ours["shared_prefix"]["off"]
        ax.bar(
            ["caching off", "caching on"],
            [off["prefill_tokens_computed"], on["prefill_tokens_computed"]],
        )
        ax.set(title="Prefill tokens, shared-prefix workload", ylabel="tokens")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
