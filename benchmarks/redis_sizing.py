"""What kvledger's streams take in Redis per entry, measured under load, and what that makes at
their caps: the figures behind docs/operations.md's Redis sizing table.

The real ledger and worker (in process, tests/harness/stack.py) on a private redis-server serve
96 requests queued at once (64 running, `--max-num-seqs`'s default; ids as the gateway makes
them), prompts of 32 to 1,024 random tokens and 16 to 128 output tokens, on a random tiny Llama
whose vocabulary is
either the default model's 258 byte tokens or Llama 3's 128,256 (token ids of 5 bytes in msgpack
where the byte tokenizer's take 1 or 2: the largest entries a real model makes). Per stream it
reports the entries written, their payload (the bytes of their fields: mean and max) and what
Redis holds per entry (`MEMORY USAGE ... SAMPLES 0` over `XLEN`, listpack and stream overhead
included); dead letters are measured on their own (one of a 10 MB single-field entry, one of an
entry of 16 fields of 64 KB: the most a dead letter keeps). Then the table: each stream's cap
(services/transport/keys.py) times the larger vocabulary's bytes per entry. The baseline is what
the docs said before issue 22: ~300 MB per replica (the 256 MB KV-events budget plus ~50 MB).

    python benchmarks/redis_sizing.py [--requests 96] [--json benchmarks/results/redis_sizing.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gpu_worker.model import LlamaForCausalLM, init_random_weights, tiny_config  # noqa: E402
from services.transport import redis_streams  # noqa: E402
from services.transport.keys import (  # noqa: E402
    DEAD_LETTERS_MAXLEN,
    OUTPUTS_MAXLEN,
    REQUESTS_MAXLEN,
    RESULTS_MAXLEN,
    STEPS_MAXLEN,
)
from services.transport.redis_server import RedisServer  # noqa: E402
from tests.harness.stack import GATEWAY, Stack  # noqa: E402

VOCABS = {"byte tokenizer (258)": 258, "Llama 3 (128,256)": 128_256}
BASELINE_MB = 300  # the docs before issue 22: "the KV-events budget, plus ~50 MB per replica"
KV_EVENTS_BUDGET_MB = 256  # --kv-events-max-mb's default
DEAD_LETTER_SAMPLES = 500


def model_of(vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    net = LlamaForCausalLM(tiny_config(vocab_size=vocab))
    init_random_weights(net, seed=0)
    return net.eval()


async def entry_stats(r, stream: str) -> dict[str, float]:
    """Entries, payload bytes (mean, max) and Redis bytes per entry of one stream."""
    count = await r.xlen(stream)
    if not count:
        return {"entries": 0, "payload_mean": 0, "payload_max": 0, "redis_per_entry": 0}
    sizes = []
    last = "-"
    while True:
        page = await r.xrange(stream, min=last, count=2000)
        if last != "-":
            page = page[1:]
        if not page:
            break
        sizes.extend(sum(len(k) + len(v) for k, v in f.items()) for _, f in page)
        last = page[-1][0]
    usage = await r.memory_usage(stream, samples=0)
    return {
        "entries": count,
        "payload_mean": statistics.fmean(sizes),
        "payload_max": max(sizes),
        "redis_per_entry": usage / count,
    }


async def measure_streams(url: str, vocab: int, n_requests: int) -> dict[str, dict]:
    rng = random.Random(vocab)
    stack = await Stack(url, model_of(vocab), num_blocks=8192, max_model_len=2048).start()
    try:
        started = time.monotonic()
        ids = []
        for i in range(n_requests):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(32, 1024))]
            req_id = f"cmpl-{rng.getrandbits(128):032x}"  # the gateway's ids: 37 characters
            await stack.submit(req_id, prompt, rng.randint(16, 128), temperature=1.0, seed=i)
            ids.append(req_id)
        await stack.wait(ids, timeout=3600)
        print(f"  {n_requests} requests served in {time.monotonic() - started:.0f}s", flush=True)
        s = stack.streams
        names = {
            "requests": s.requests,
            "steps:<group>": s.steps("default"),
            "results": s.results,
            "outputs:<gateway>": s.outputs(GATEWAY),
            "kv-events": s.events,
        }
        found = {name: await entry_stats(stack.r, key) for name, key in names.items()}
        snapshot = await stack.r.memory_usage(s.events_snapshot, samples=0) or 0
        cached = len(stack.ledger.manager.block_pool.cached_block_hash_to_block.keys())
        found["kv-events:snapshot"] = {"bytes": snapshot, "cached_blocks": cached}
        return found
    finally:
        await stack.stop()


async def measure_dead_letters(url: str) -> dict[str, dict]:
    r = redis_streams.connect(url)
    shapes = {
        "one 10 MB field": {b"m": b"\xc1" * (10 << 20)},
        "16 fields of 64 KB": {f"field-{i:02d}".encode(): b"\xc1" * (64 << 10) for i in range(16)},
    }
    found = {}
    try:
        for name, fields in shapes.items():
            dead = f"sizing:dead:{len(found)}"
            entry = redis_streams.Entry("sizing:source", b"1-1", fields)
            for _ in range(DEAD_LETTER_SAMPLES):
                await redis_streams.dead_letter(r, dead, entry, "not msgpack: " + "x" * 200)
            found[name] = await entry_stats(r, dead)
            await r.delete(dead)
    finally:
        await r.aclose()
    return found


CAPS = {
    "requests": REQUESTS_MAXLEN,
    "steps:<group>": STEPS_MAXLEN,
    "results": RESULTS_MAXLEN,
    "outputs:<gateway>": OUTPUTS_MAXLEN,
}


def table(streams: dict[str, dict[str, dict]], dead: dict[str, dict]) -> list[tuple]:
    rows = []
    for name, cap in CAPS.items():
        per_entry = max(v[name]["redis_per_entry"] for v in streams.values())
        rows.append((name, cap, per_entry, cap * per_entry / 1e6))
    kv = max(v["kv-events"]["redis_per_entry"] for v in streams.values())
    rows.append(("kv-events", f"{KV_EVENTS_BUDGET_MB} MB", kv, float(KV_EVENTS_BUDGET_MB)))
    worst = max(d["redis_per_entry"] for d in dead.values())
    rows.append(("dead-letters", DEAD_LETTERS_MAXLEN, worst, DEAD_LETTERS_MAXLEN * worst / 1e6))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger(redis_streams.__name__).setLevel(logging.ERROR)  # a line per dead letter
    streams: dict[str, dict[str, dict]] = {}
    with RedisServer() as server:
        for label, vocab in VOCABS.items():
            print(f"vocabulary {label}:", flush=True)
            streams[label] = asyncio.run(measure_streams(server.url, vocab, args.requests))
        dead = asyncio.run(measure_dead_letters(server.url))

    print("\nper entry, measured (payload mean / max, Redis bytes per entry):")
    print(f"{'stream':22} " + " ".join(f"{label:>40}" for label in VOCABS))
    for name in [*CAPS, "kv-events"]:
        cells = []
        for label in VOCABS:
            st = streams[label][name]
            cells.append(
                f"{st['entries']:>6} x {st['payload_mean']:>7.0f} / {st['payload_max']:>7.0f}"
                f" -> {st['redis_per_entry']:>7.0f} B"
            )
        print(f"{name:22} " + " ".join(f"{c:>40}" for c in cells))
    for label in VOCABS:
        snap = streams[label]["kv-events:snapshot"]
        print(f"kv-events:snapshot ({label}): {snap['bytes']} B for {snap['cached_blocks']} blocks")
    for name, st in dead.items():
        print(f"dead letter of {name}: {st['payload_mean']:.0f} B payload -> "
              f"{st['redis_per_entry']:.0f} B per entry")  # fmt: skip

    rows = table(streams, dead)
    print("\nat the caps, per replica (outputs: per gateway):")
    print(f"{'stream':22} {'cap':>10} {'B/entry':>9} {'MB at cap':>10}")
    for name, cap, per_entry, mb in rows:
        print(f"{name:22} {cap!s:>10} {per_entry:>9.0f} {mb:>10.0f}")
    total = sum(mb for *_, mb in rows)
    print(f"{'total (one gateway)':22} {'':>10} {'':>9} {total:>10.0f}")
    print(f"{'baseline: docs before':22} {'':>10} {'':>9} {BASELINE_MB:>10.0f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "streams": streams,
                    "dead_letters": dead,
                    "table": [list(row) for row in rows],
                    "total_mb": total,
                },
                indent=2,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
