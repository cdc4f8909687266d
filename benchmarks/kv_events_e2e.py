"""KV events end to end through Redis: the ledger's publisher, a real redis-server, a subscriber.

The batches are those of `kv_events.py` (our scheduler and KVCacheManager over the shared-prefix
workload, one batch per step), replayed until the stream holds `--events` events. They are
written by the ledger's own `KVEventStream.publish` (one awaited XADD per batch, MAXLEN as in
the service) and read by `KVEventSubscriber.poll` (XREAD from its position, decode, apply), each
rep from the first entry to the last: events/s is what one subscriber keeps up with. Then the
same with a checkpointing subscriber whose index was bootstrapped from a snapshot of `--entries`
hashes (1M), so the checkpoint's cost at that size is in the rate.

Baselines in the same run, interleaved, GC on: the subscriber of 337664e (before this work:
pure-Python decoder, the whole index rewritten as JSON after every poll; its checkpointing run is
cut to `--legacy-polls` polls, its rate being flat) and the subscriber this work had before its
read path was tuned (msgspec into the full event structs, the Counter updated per event, 256
entries per XREAD), both kept below; and for the checkpoint, this subscriber as it was before
its log held index operations (every applied batch logged whole).

`--zmq` adds the same batches over ZMQ as vLLM publishes them (issue 26): the ledger's
ZmqEventPublisher (`engine/zmq_events.py`, vLLM's default high-water mark and queue) sends the
recording as fast as it goes to one subscriber in another process, which decodes every batch
into a prefix index (`PrefixIndex.apply_bytes`, the batch's own bytes: ZMQ carries no `hashes`
field); events/s is from the first batch sent to the last one applied, and every batch must
arrive (dropped: the publisher's queue, gaps: sequence numbers the subscriber never saw).

    python benchmarks/kv_events_e2e.py --zmq --only "kvledger now" "batch field, read-ahead"
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
from collections import Counter
from pathlib import Path
from typing import Any

from kv_events import record_batches


# ------------------------------------------------------------ the subscribers kvledger had before
def _apply_counter(counts: Counter[int], batch: Any) -> None:
    from ledger.events import AllBlocksCleared, BlockRemoved, BlockStored

    for event in batch.events:
        if isinstance(event, BlockStored):
            counts.update(h for h in event.block_hashes if isinstance(h, int))
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                if counts.get(h, 0) > 1:
                    counts[h] -= 1
                else:
                    counts.pop(h, None)
        elif isinstance(event, AllBlocksCleared):
            counts.clear()


class LegacySubscriber:
    """337664e's poll: the pure-Python decoder and a JSON rewrite of the index per poll."""

    def __init__(self, r: Any, stream: str, counts: dict[int, int], checkpoint: Path | None):
        self.r, self.stream, self.checkpoint = r, stream, checkpoint
        self.counts: Counter[int] = Counter(counts)
        self.last_id = "0-0"

    async def poll(self, block_ms: int | None = None, count: int = 256) -> int:
        from ledger.events import decode_batch_generic
        from services.transport.redis_streams import read_from

        entries = await read_from(self.r, self.stream, self.last_id, count=count, block_ms=block_ms)
        for entry_id, fields in entries:
            self.last_id = entry_id.decode()
            _apply_counter(self.counts, decode_batch_generic(fields[b"batch"]))
        if entries and self.checkpoint is not None:
            tmp = self.checkpoint.with_suffix(".tmp")
            tmp.write_text(
                json.dumps({"last_id": self.last_id, "counts": list(self.counts.items())})
            )
            os.replace(tmp, self.checkpoint)
        return len(entries)


class BeforeTuningSubscriber:
    """This work's subscriber before its read path was tuned: full structs, Counter, count 256."""

    def __init__(self, r: Any, stream: str, counts: dict[int, int], checkpoint: Path | None):
        from services.events.snapshot import CheckpointWriter

        self.r, self.stream = r, stream
        self.counts: Counter[int] = Counter(counts)
        self.checkpoint = CheckpointWriter(checkpoint) if checkpoint else None
        if self.checkpoint is not None:
            self.checkpoint.compact("0-0", self.counts)
        self.last_id = "0-0"

    async def poll(self, block_ms: int | None = None, count: int = 256) -> int:
        from ledger.events import decode_batch
        from services.transport.redis_streams import read_from

        entries = await read_from(self.r, self.stream, self.last_id, count=count, block_ms=block_ms)
        applied = []
        for entry_id, fields in entries:
            self.last_id = entry_id.decode()
            data = fields[b"batch"]
            _apply_counter(self.counts, decode_batch(data))
            applied.append((self.last_id, data))
        if applied and self.checkpoint is not None:
            self.checkpoint.append(applied, self.last_id, self.counts)
        return len(entries)


def whole_batch_log_subscriber() -> type:
    """This work's subscriber before its checkpoint logged index operations: the same read path,
    but every applied batch appended to the log whole (so the 1M-entry base is rewritten each
    time that log outgrows it)."""
    from services.events.subscriber import KVEventSubscriber

    class WholeBatchLogSubscriber(KVEventSubscriber):
        async def poll(self, block_ms: int | None = 1000, count: int = 1024) -> int:
            from services.transport.redis_streams import read_from

            entries = await read_from(
                self.r, self.streams.events, self.last_id, count=count, block_ms=block_ms
            )
            applied = []
            for entry_id, fields in entries:
                self.last_id = entry_id.decode()
                data = fields[b"batch"]
                self.index.apply_bytes(data)
                applied.append((self.last_id, data))
            if applied and self.checkpoint is not None:
                self.checkpoint.append(applied, self.last_id, self.index.counts)
            return len(entries)

    return WholeBatchLogSubscriber


def batch_field_subscriber(read_ahead: bool) -> type:
    """This subscriber before the `hashes` field: every entry's vLLM bytes through the
    hashes-only decoder (which still scans the token_ids it skips); `read_ahead` keeps the
    XREAD of the next page while the last one is applied, as now (False: as before, one XREAD
    then its page, in turn)."""
    from services.events.snapshot import OpLog
    from services.events.subscriber import KVEventSubscriber

    class BatchFieldSubscriber(KVEventSubscriber):
        async def poll(self, block_ms: int | None = 1000, count: int = 1024) -> int:
            from services.transport.redis_streams import read_from

            if read_ahead:
                entries = await self._read(block_ms, count)
            else:
                entries = await read_from(
                    self.r, self.streams.events, self.last_id, count=count, block_ms=block_ms
                )
            ops = OpLog() if self.checkpoint is not None else None
            for entry_id, fields in entries:
                self.last_id = entry_id.decode()
                self.index.apply_bytes(fields[b"batch"], ops)
            if entries and self.checkpoint is not None:
                assert ops is not None
                self.checkpoint.append_ops(self.last_id, ops, self.index.counts)
            return len(entries)

    return BatchFieldSubscriber


def hashes_field_without_read_ahead() -> type:
    """This subscriber reading `hashes`, but one XREAD then its page, in turn."""
    from services.events.subscriber import KVEventSubscriber
    from services.transport.redis_streams import read_from

    class NoReadAhead(KVEventSubscriber):
        async def _read(self, block_ms: int | None, count: int) -> list:
            return await read_from(
                self.r, self.streams.events, self.last_id, count=count, block_ms=block_ms
            )

    return NoReadAhead


# ------------------------------------------------------------------------------------ the run
async def publish(
    r: Any, streams: Any, blobs: list[bytes], target_events: int
) -> tuple[int, float]:
    from engine.event_stream import KVEventStream
    from ledger.block_pool import BlockPool
    from ledger.events import decode_batch

    stream = KVEventStream(r, streams, max_bytes=10**10, snapshot_interval_s=1e9, block_size=16,
                           hash_algo="sha256")  # fmt: skip
    stream._last_snapshot_start = time.monotonic()  # this run times events, not snapshots
    pool = BlockPool(2, enable_caching=True)
    batches = [decode_batch(b).events for b in blobs]
    published, start = 0, time.perf_counter()
    while published < target_events:
        for events in batches:
            published += await stream.publish(events, pool, "bench")
    return published, time.perf_counter() - start


async def drain(sub: Any) -> float:
    start = time.perf_counter()
    while await sub.poll(block_ms=None):
        pass
    return time.perf_counter() - start


def synthetic_counts(n: int) -> dict[int, int]:
    # Distinct 64-bit hashes (an odd multiplier is a bijection mod 2^64), 1 in 10 held twice.
    return {(i * 0x9E3779B97F4A7C15) & (2**64 - 1): 2 if i % 10 == 0 else 1 for i in range(n)}


async def run(args: argparse.Namespace) -> dict:
    from ledger.events import decode_batch
    from services.events.snapshot import KVSnapshot, encode_snapshot, pack_counts
    from services.events.subscriber import KVEventSubscriber
    from services.transport.keys import StreamNames
    from services.transport.redis_server import RedisServer
    from services.transport.redis_streams import connect

    blobs = record_batches(args.requests)
    big = synthetic_counts(args.entries)
    hash_array, count_array = pack_counts(big)
    snapshot = encode_snapshot(KVSnapshot(epoch="bench", stream_id="0-0", block_size=16,
                                          hash_algo="sha256", written_at=time.time(),
                                          hash_array=hash_array, count_array=count_array))  # fmt: skip
    rates: dict[str, list[float]] = {}
    with RedisServer() as server, tempfile.TemporaryDirectory() as tmp:
        r = connect(server.url)
        streams = StreamNames("bench")
        events, publish_s = await publish(r, streams, blobs, args.events)
        entries = await r.xlen(streams.events)
        await r.set(streams.events_snapshot, snapshot)
        expected: Counter[int] = Counter()

        async def now(checkpoint: bool, cls: type = KVEventSubscriber) -> tuple[float, int, dict]:
            path = Path(tmp) / "now.ckpt"
            for p in (path, path.with_name(path.name + ".log")):
                p.unlink(missing_ok=True)
            sub = cls(r, "bench", checkpoint=path if checkpoint else None)
            if checkpoint:
                await sub.bootstrap()  # the 1M-entry index, at 0-0
            return await drain(sub), events, sub.index.counts

        def old(cls: type, checkpoint: bool, polls: int | None = None) -> Any:
            async def go() -> tuple[float, int, dict]:
                path = Path(tmp) / f"{cls.__name__}.ckpt"
                sub = cls(
                    r, streams.events, big if checkpoint else {}, path if checkpoint else None
                )
                if polls is None:
                    return await drain(sub), events, sub.counts
                start, read, seen = time.perf_counter(), 0, 0
                for _ in range(polls):
                    got = await sub.poll()
                    seen += sum(blob_events[i % len(blobs)] for i in range(read, read + got))
                    read += got
                return time.perf_counter() - start, seen, {}

            return go

        # Events per recorded batch: the stream holds them in this order, over and over.
        blob_events = [len(decode_batch(b).events) for b in blobs]

        variants = {
            "plain: kvledger now": lambda: now(False),
            "plain: hashes field, no read-ahead": lambda: now(
                False, hashes_field_without_read_ahead()
            ),
            "plain: batch field, read-ahead": lambda: now(False, batch_field_subscriber(True)),
            "plain: batch field (before)": lambda: now(False, batch_field_subscriber(False)),
            "plain: before tuning (i12)": old(BeforeTuningSubscriber, False),
            "plain: before (337664e)": old(LegacySubscriber, False),
            f"checkpoint, {args.entries:,} entries: kvledger now": lambda: now(True),
            f"checkpoint, {args.entries:,} entries: batch field (before)": lambda: now(
                True, batch_field_subscriber(False)
            ),
            f"checkpoint, {args.entries:,} entries: whole-batch log (i12)": lambda: now(
                True, whole_batch_log_subscriber()
            ),
            f"checkpoint, {args.entries:,} entries: before tuning (i12)": old(
                BeforeTuningSubscriber, True
            ),
            f"checkpoint, {args.entries:,} entries: before (337664e)": old(
                LegacySubscriber, True, args.legacy_polls
            ),
        }
        if args.only:
            variants = {k: v for k, v in variants.items() if any(o in k for o in args.only)}
            variants.setdefault("plain: before (337664e)", old(LegacySubscriber, False))
        finals: dict[str, dict] = {}
        for _ in range(args.repeats):
            for name, go in variants.items():
                seconds, seen, counts = await go()
                rates.setdefault(name, []).append(seen / seconds)
                finals[name] = counts
        # Every full drain ends with the same index: the plain ones hold the workload's hashes,
        # the checkpointing ones those plus the snapshot's.
        expected = Counter(finals["plain: before (337664e)"])
        for name, counts in finals.items():
            if not counts:
                continue
            want = expected if name.startswith("plain") else Counter(big) + expected
            if dict(counts) != dict(want):
                sys.exit(f"{name}: the index differs from the baseline's")
        await r.aclose()
    return {"events": events, "entries": entries, "publish_events_per_s": events / publish_s,
            "rates": rates}  # fmt: skip


# ------------------------------------------------------------------------------------ over ZMQ
ZMQ_SUBSCRIBER = """
import json, sys, time
import zmq
from services.events.subscriber import PrefixIndex
port, batches = int(sys.argv[1]), int(sys.argv[2])
sub = zmq.Context.instance().socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.setsockopt(zmq.RCVHWM, 100_000)
sub.connect(f"tcp://127.0.0.1:{port}")
index = PrefixIndex()
print("ready", flush=True)
received, gaps, last, first_at = 0, 0, None, None
while received < batches:
    if not sub.poll(10_000):
        break
    _, seq_bytes, payload = sub.recv_multipart()
    if first_at is None:
        first_at = time.time()
    seq = int.from_bytes(seq_bytes, "big")
    if last is not None and seq != last + 1:
        gaps += seq - last - 1
    last = seq
    index.apply_bytes(payload)
    received += 1
print(json.dumps({"received": received, "gaps": gaps, "first_at": first_at,
                  "done_at": time.time(), "hashes": len(index.counts)}), flush=True)
"""


def zmq_run(blobs: list[bytes], target_events: int) -> dict:
    """One pass of the recording over ZMQ, as fast as the publisher goes, to one subscriber."""
    import subprocess

    from engine.zmq_events import ZmqEventPublisher
    from ledger.events import decode_batch
    from services.config import KVEventsConfig
    from services.transport.redis_server import free_port

    per_blob = [len(decode_batch(b).events) for b in blobs]
    order, events = [], 0
    while events < target_events:
        for i, n in enumerate(per_blob):
            order.append(i)
            events += n
    port = free_port()
    root = Path(__file__).resolve().parents[1]
    sub = subprocess.Popen([sys.executable, "-c", ZMQ_SUBSCRIBER, str(port), str(len(order))],
                           cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                           stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert sub.stdout is not None
    assert sub.stdout.readline().strip() == "ready"
    publisher = ZmqEventPublisher(KVEventsConfig(True, endpoint=f"tcp://*:{port}")).start()
    time.sleep(0.5)  # the subscription reaches the publisher
    started = time.time()
    for seq, i in enumerate(order):
        publisher.publish(seq, blobs[i])
    queued_s = time.time() - started
    report = json.loads(sub.stdout.readline())
    sub.wait()
    publisher.close()
    seconds = report["done_at"] - started
    return {"events": events, "batches": len(order), "events_per_s": events / seconds,
            "received": report["received"], "gaps": report["gaps"],
            "dropped": publisher.dropped, "publish_call_s": queued_s,
            "hashes": report["hashes"]}  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--legacy-polls", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--only", nargs="*", help="run only the subscribers whose names hold one of these"
    )
    parser.add_argument("--zmq", action="store_true",
                        help="also the recording over ZMQ to one subscriber (issue 26)")  # fmt: skip
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    if args.zmq:
        blobs = record_batches(args.requests)
        result["zmq"] = [zmq_run(blobs, args.events) for _ in range(args.repeats)]
    print(f"\nKV events through Redis: {result['events']:,} events in {result['entries']:,} "
          f"stream entries, published by KVEventStream at "
          f"{result['publish_events_per_s'] / 1e3:.0f}k events/s (one XADD per batch); "
          f"subscriber events/s, median of {args.repeats} interleaved (min-max), GC on")  # fmt: skip
    print(f"{'subscriber':<58} {'events/s':>24}")
    for name, rates in result["rates"].items():
        print(f"{name:<58} {statistics.median(rates) / 1e3:>8.0f}k "
              f"({min(rates) / 1e3:.0f}k-{max(rates) / 1e3:.0f}k)")  # fmt: skip
    if args.zmq:
        runs = result["zmq"]
        rates = [x["events_per_s"] for x in runs]
        print(f"{'over ZMQ: one subscriber, batch decoded (publish to applied)':<58} "
              f"{statistics.median(rates) / 1e3:>8.0f}k ({min(rates) / 1e3:.0f}k-"
              f"{max(rates) / 1e3:.0f}k)")  # fmt: skip
        print(f"  ZMQ: {runs[0]['batches']:,} batches a run; received "
              f"{[x['received'] for x in runs]}, gaps {[x['gaps'] for x in runs]}, dropped "
              f"{[x['dropped'] for x in runs]} (queue {100_000:,}, hwm {100_000:,}); "
              f"publish() calls took {max(x['publish_call_s'] for x in runs) * 1e3:.0f} ms "
              f"for all batches at most")  # fmt: skip
    print(f"load average (1, 5, 15 min): {os.getloadavg()}")
    if args.json:
        result["machine"] = {"python": sys.version.split()[0], "cpus": os.cpu_count(),
                             "load": os.getloadavg()}  # fmt: skip
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
