"""Fan-out at the limits beside 16 normal requests: does a large n, best_of or batch of prompts
starve the requests sent after it?

    python benchmarks/fanout.py [--fan-out 496] [--normal 16] [--json benchmarks/results/fanout.json]

Starts the same services as benchmarks/burst.py (private redis-server, a ledger and a worker
with the tiny seeded Llama on the CPU, a real gateway with max_queue 512), then, for each kind
of fan-out (`n`, `best_of`, a batch of prompts) at --fan-out sequences (max_queue less the
normal requests: the most that can be admitted beside them), sends it, waits until the gateway
holds it, and sends --normal ordinary completions at once, timing each.

The named baseline, in the same run: the same --normal requests with nothing else running.
Target (issue 22): the normal requests' p99 beside any fan-out within 2x of the baseline's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.burst import Services, ms, pct  # noqa: E402
from kvledger.report import format_table, now_stamp, write_json  # noqa: E402

MAX_TOKENS = 16


async def normals(session, url: str, count: int, tag: str) -> list[float]:
    async def one(i: int) -> float:
        body = {"prompt": f"{tag} {i}: a normal request", "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        started = time.perf_counter()
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            await resp.read()
            assert resp.status == 200, resp.status
        return time.perf_counter() - started

    return list(await asyncio.gather(*(one(i) for i in range(count))))


def fan_out_body(kind: str, size: int) -> dict:
    common = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 1.0, "seed": 1}
    if kind == "n":
        return {"prompt": "fan out with n", "n": size, **common}
    if kind == "best_of":
        return {"prompt": "fan out with best_of", "best_of": size, **common}
    return {"prompt": [f"batch prompt {i}" for i in range(size)], **common}


async def scenario(
    url: str, kind: str, size: int, count: int, cut: bool = False
) -> tuple[list[float], float]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.perf_counter()
        fan = asyncio.create_task(
            session.post(f"{url}/v1/completions", json=fan_out_body(kind, size))
        )
        while True:  # until the gateway holds the whole fan-out
            async with session.get(f"{url}/health") as resp:
                if (await resp.json())["in_flight"] >= size:
                    break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # its first sequences run
        latencies = await normals(session, url, count, kind)
        if cut:  # the fan-out's client leaves: its sequences are aborted
            fan.cancel()
            await asyncio.gather(fan, return_exceptions=True)
            await asyncio.sleep(2.0)  # the aborts reach the ledger before the next baseline
            return latencies, float("nan")
        resp = await fan
        await resp.read()
        assert resp.status == 200, resp.status
        return latencies, time.perf_counter() - started


async def baseline(url: str, count: int) -> list[float]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        return await normals(session, url, count, "baseline")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fan-out", type=int, default=496, help="sequences per fan-out")
    parser.add_argument("--normal", type=int, default=16)
    parser.add_argument("--max-queue", type=int, default=512)
    parser.add_argument("--control", type=int, default=64, help="a full batch of normal requests")
    parser.add_argument(
        "--kinds", default="n,best_of,batch", help="the fan-outs to run beside (a shorter run: n)"
    )
    parser.add_argument(
        "--cut-fan-out", action="store_true",
        help="a shorter run: the fan-out's client leaves once the normal requests are answered",
    )  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    services = Services(args.max_queue, Path(tempfile.mkdtemp(prefix="kvledger-fanout-")))
    rows, results = [], {}
    try:
        asyncio.run(baseline(services.url, 4))  # warm up
        base = asyncio.run(baseline(services.url, args.normal))
        results["baseline"] = base
        for kind in args.kinds.split(","):
            latencies, fan_s = asyncio.run(
                scenario(services.url, kind, args.fan_out, args.normal, args.cut_fan_out)
            )
            results[kind] = latencies
            rows.append([f"beside {kind}={args.fan_out}" if kind != "batch" else
                         f"beside a batch of {args.fan_out} prompts", ms(pct(latencies, 50)),
                         ms(pct(latencies, 99)), f"{pct(latencies, 99) / pct(base, 99):.2f}x",
                         f"{fan_s:.1f}"])  # fmt: skip
            base = asyncio.run(baseline(services.url, args.normal))  # interleaved
            results[f"baseline after {kind}"] = base
        # The control: a full batch (the ledger's max_num_seqs, 64) of normal requests alone.
        # On the CPU a step costs more the more sequences it holds; requests beside a fan-out
        # share a full batch, so this row is what sharing it costs without any queueing.
        control = asyncio.run(baseline(services.url, args.control)) if args.control else [0.0]
        load = os.getloadavg()[0]
    finally:
        services.stop()
    all_base = results["baseline"] + [
        v for k, vs in results.items() if k.startswith("baseline after") for v in vs
    ]
    rows.insert(0, [f"baseline: {args.normal} alone (all rounds)", ms(pct(all_base, 50)),
                    ms(pct(all_base, 99)), "1.00x", "-"])  # fmt: skip
    rows.append([f"control: {args.control} alone (a full batch)", ms(pct(control, 50)),
                 ms(pct(control, 99)), "-", "-"])  # fmt: skip
    results["control"] = control
    for row in rows[1:-1]:
        row[3] = f"{float(row[2].replace(',', '')) / pct(all_base, 99):.2f}x"
    title = (
        f"{args.normal} normal requests (max_tokens {MAX_TOKENS}) beside a fan-out of "
        f"{args.fan_out} sequences, max_queue {args.max_queue}; load average {load:.1f} "
        f"({now_stamp()})"
    )
    print(format_table(["scenario", "normal p50 ms", "normal p99 ms", "p99 / baseline",
                        "fan-out s"], rows, title))  # fmt: skip
    if args.json:
        write_json(args.json, {"title": title, "rows": rows, "latencies_s": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
