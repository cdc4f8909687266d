"""Snapshotting 1M cached blocks: how long the engine loop stalls, how fast a subscriber
bootstraps, and what a checkpointing subscriber pays per poll; each against the code kvledger
had before (kept below), in the same run, over a real redis-server, GC on.

Stall: a ticker task records the longest gap between its turns while the snapshot is written
(before: the whole scan + pack + SET awaited inline; now: the background task). Bootstrap:
`KVEventSubscriber.bootstrap()` on a version-2 snapshot vs the version-1 list of pairs, and vs
the version-2 arrays built as a Counter of (hash, count) pairs (its code before dict.fromkeys).
Checkpoint: one poll's save at 1M entries (a JSON rewrite before; a log append now).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgpack


async def ticker(stop: asyncio.Event, gaps: list[float]) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def max_stall(work) -> float:
    stop, gaps = asyncio.Event(), []
    task = asyncio.create_task(ticker(stop, gaps))
    await asyncio.sleep(0.01)
    gaps.clear()
    await work()
    stop.set()
    await task
    return max(gaps) if gaps else 0.0


async def legacy_write_snapshot(r, key: str, pool, epoch: str, last_id: bytes) -> None:
    from ledger.hashing import to_event_hash

    counts: dict[int, int] = {}
    for block in pool.blocks:
        if block.block_hash is not None:
            k = to_event_hash(block.block_hash)
            counts[k] = counts.get(k, 0) + 1
    snapshot = {"epoch": epoch, "stream_id": last_id.decode(), "block_size": 16,
                "hash_algo": "sha256", "hashes": [[h, n] for h, n in counts.items()],
                "written_at": time.time()}  # fmt: skip
    await r.set(key, msgpack.packb(snapshot))


async def bootstrap_before_fromkeys(r, key: str) -> int:
    """The subscriber's bootstrap before dict.fromkeys: a Counter of (hash, count) pairs."""
    from array import array
    from collections import Counter

    from services.events.snapshot import decode_snapshot

    snapshot = decode_snapshot(await r.get(key))
    hashes, counts = array("Q"), array("I")
    hashes.frombytes(snapshot.hash_array)
    counts.frombytes(snapshot.count_array)
    return len(Counter(dict(zip(hashes, counts, strict=True))))


async def run(args: argparse.Namespace) -> dict:
    from engine.event_stream import KVEventStream
    from ledger.block_pool import BlockPool
    from services.events.subscriber import KVEventSubscriber
    from services.transport.keys import StreamNames
    from services.transport.redis_server import RedisServer
    from services.transport.redis_streams import connect

    n = args.blocks
    pool = BlockPool(n + 1, enable_caching=True)
    for block in pool.blocks[1:]:
        block.block_hash = block.block_id.to_bytes(32, "big")
    results: dict[str, list[float]] = {k: [] for k in (
        "stall_before", "stall_now", "bootstrap_v1", "bootstrap_v2_pairs", "bootstrap_v2",
        "checkpoint_json", "checkpoint_log")}  # fmt: skip
    with RedisServer() as server, tempfile.TemporaryDirectory() as tmp:
        r = connect(server.url)
        streams = StreamNames("bench")
        stream = KVEventStream(r, streams, max_bytes=10**9, snapshot_interval_s=1e9, block_size=16,
                               hash_algo="sha256")  # fmt: skip
        stream.last_id = await r.xadd(streams.events, {b"batch": b"x"})
        stream.sync_from_pool(pool)
        for _ in range(args.repeats):

            async def before() -> None:
                await legacy_write_snapshot(r, streams.events_snapshot, pool, "e", stream.last_id)

            results["stall_before"].append(await max_stall(before))
            v1 = await r.get(streams.events_snapshot)

            async def now() -> None:
                stream._snapshot_task = asyncio.create_task(stream._snapshot_in_background("e"))
                await stream._snapshot_task

            results["stall_now"].append(await max_stall(now))
            v2 = await r.get(streams.events_snapshot)
            await r.set(streams.events_snapshot, v2)
            start = time.perf_counter()
            assert await bootstrap_before_fromkeys(r, streams.events_snapshot) == n
            results["bootstrap_v2_pairs"].append(time.perf_counter() - start)
            for label, data in (("bootstrap_v1", v1), ("bootstrap_v2", v2)):
                await r.set(streams.events_snapshot, data)
                sub = KVEventSubscriber(r, "bench")
                start = time.perf_counter()
                await sub.bootstrap()
                results[label].append(time.perf_counter() - start)
                assert len(sub.index) == n
            # One poll's checkpoint at n entries: 256 batches of 4 events arrived.
            batch = b"\x93\xcb" + b"\x00" * 8 + b"\x90\xc0"
            path = Path(tmp) / "legacy.json"
            start = time.perf_counter()
            path.write_text(
                json.dumps({"last_id": "1-0", "counts": list(sub.index.counts.items())})
            )
            results["checkpoint_json"].append(time.perf_counter() - start)
            from services.events.snapshot import CheckpointWriter

            writer = CheckpointWriter(Path(tmp) / "sub.ckpt")
            writer.compact("1-0", sub.index.counts)
            start = time.perf_counter()
            writer.append([(f"2-{i}", batch) for i in range(256)], "2-255", sub.index.counts)
            results["checkpoint_log"].append(time.perf_counter() - start)
        await r.aclose()
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results = asyncio.run(run(args))
    print(f"\nsnapshot of {args.blocks:,} cached blocks, median of {args.repeats} "
          f"interleaved (min-max), ms, GC on")  # fmt: skip
    rows = (("engine-loop stall while snapshotting", "stall_before", "stall_now"),
            ("subscriber bootstrap (v1 snapshot)", "bootstrap_v1", "bootstrap_v2"),
            ("subscriber bootstrap (v2, Counter of pairs)", "bootstrap_v2_pairs", "bootstrap_v2"),
            ("checkpoint after one poll (256 batches)", "checkpoint_json", "checkpoint_log"))  # fmt: skip
    print(f"{'measure':<46} {'before':>22} {'now':>22}")
    for label, a, b in rows:
        cells = [f"{statistics.median(results[k]) * 1e3:.1f} ({min(results[k]) * 1e3:.1f}-"
                 f"{max(results[k]) * 1e3:.1f})" for k in (a, b)]  # fmt: skip
        print(f"{label:<46} {cells[0]:>22} {cells[1]:>22}")
    if args.json:
        machine = {"python": sys.version.split()[0], "cpus": os.cpu_count()}
        machine["load"] = os.getloadavg()
        args.json.write_text(json.dumps({"seconds": results, "machine": machine}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
