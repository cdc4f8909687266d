"""KV-event codec throughput: kvledger's msgspec codec vs vLLM 0.33's own encoder and the old one.

The batches are what the ledger publishes on a real run: our scheduler and KVCacheManager (events
on) over the shared-prefix workload in the blog's 100k-token pool, one batch per step. Three
codecs encode and decode the same batches, interleaved repetitions (each rep in another order),
GC on as in the service: kvledger's (`ledger.events`) and vLLM's `msgspec.msgpack.Encoder`
over its own structs (in its venv), each in a fresh subprocess of its own driven rep by rep, and
the pure-Python codec kvledger had before (kept below; its decoder lives on as
`decode_batch_generic`, the fallback for older layouts). Every codec's bytes are checked against
kvledger's before timing. kvledger's codec is also timed inside this process, whose heap holds
the whole recorded run (the same calls ran ~25% slower there than in a fresh process: what the
earlier 0.75-0.91x against vLLM's subprocess measured), and in a second fresh process, to show
how far two processes running the same code differ here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def record_batches(num_requests: int) -> list[bytes]:
    from kvledger.simulate import BLOG_MAX_MODEL_LEN, BLOG_POOL_TOKENS
    from kvledger.workloads import shared_prefix_workload, synthetic_token
    from ledger.events import KVEventBatch, encode_batch
    from ledger.hashing import BlockHasher
    from ledger.kv_cache_manager import KVCacheManager
    from ledger.request import Request
    from ledger.scheduler import Scheduler, SchedulerConfig

    sims = shared_prefix_workload(num_requests)
    manager = KVCacheManager(
        BLOG_POOL_TOKENS // 16 + 1, 16, BLOG_MAX_MODEL_LEN, enable_kv_cache_events=True
    )
    scheduler = Scheduler(SchedulerConfig(max_model_len=BLOG_MAX_MODEL_LEN), manager)
    hasher = BlockHasher("sha256", seed="vllm-none-hash")
    for sim in sims:
        scheduler.add_request(
            Request(sim.request_id, sim.prompt_token_ids, sim.max_tokens, block_hasher=hasher)
        )
    index = {sim.request_id: i for i, sim in enumerate(sims)}
    batches = []
    step = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        sampled = {
            rid: synthetic_token(index[rid], scheduler.requests[rid].num_tokens)
            for rid in out.num_scheduled_tokens
        }
        scheduler.update_from_output(out, sampled)
        events = manager.take_events()
        if events:
            batches.append(encode_batch(KVEventBatch(1_700_000_000.0 + step * 0.01, events)))
        step += 1
    return batches


# ---------------------------------------------------------------- the codec kvledger had before


def _legacy_map_header(count: int, capacity: int) -> bytes:
    if capacity <= 15:
        return bytes((0x80 | count,))
    return b"\xde" + count.to_bytes(2, "big")


def _make_packer() -> Any:
    import msgpack

    return msgpack.Packer(use_bin_type=True)


_PACK: Any = None  # msgpack's Packer.pack, bound in main (vLLM's venv has no msgpack)


def legacy_encode_event(event: Any, fields: tuple[str, ...], required: tuple[str, ...]) -> bytes:
    parts = [_PACK("type"), _PACK(type(event).__name__)]
    for name in fields:
        value = getattr(event, name)
        if value is None and name not in required:
            continue
        parts.append(_PACK(name))
        parts.append(_PACK(value))
    return _legacy_map_header(len(parts) // 2, len(fields) + 1) + b"".join(parts)


def legacy_encode_batch(batch: Any) -> bytes:
    from ledger.events import _FIELDS, _REQUIRED

    events = batch.events
    if len(events) <= 15:
        header = bytes((0x90 | len(events),))
    elif len(events) <= 0xFFFF:
        header = b"\xdc" + len(events).to_bytes(2, "big")
    else:
        header = b"\xdd" + len(events).to_bytes(4, "big")
    body = b"".join(legacy_encode_event(e, _FIELDS[type(e)], _REQUIRED[type(e)]) for e in events)
    return b"\x93" + _PACK(float(batch.ts)) + header + body + _PACK(batch.data_parallel_rank)


# ---------------------------------------------------------------- timing


def time_codec(encode: Any, decode: Any, structs: list[Any], blobs: list[bytes]) -> dict:
    start = time.perf_counter()
    for batch in structs:
        encode(batch)
    encoded = time.perf_counter() - start
    start = time.perf_counter()
    for blob in blobs:
        decode(blob)
    return {"encode_s": encoded, "decode_s": time.perf_counter() - start}


def digest(encode: Any, structs: list[Any]) -> str:
    h = hashlib.sha256()
    for batch in structs:
        h.update(encode(batch))
    return h.hexdigest()


def side(batches_path: str, codec: str) -> int:
    """In a fresh process: decode the batches into each codec's own structs, then one rep per
    stdin line. In vLLM's venv kvledger's codec (msgspec alone, on PYTHONPATH) is timed too, the
    two taking turns to go first: one interpreter, one heap, the same library."""
    import msgspec

    codecs: dict[str, tuple[Any, Any]] = {}
    if codec == "vllm":
        from vllm.distributed.kv_events import KVEventBatch

        encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(KVEventBatch)
        codecs[VLLM] = (encoder.encode, decoder.decode)
    try:
        from ledger.events import decode_batch, encode_batch
    except ImportError:
        pass
    else:
        name = {"kvledger": OURS, "kvledger-twin": TWIN}.get(codec, HEAD_TO_HEAD)
        codecs[name] = (encode_batch, decode_batch)
    blobs = msgspec.msgpack.decode(Path(batches_path).read_bytes(), type=list[bytes])
    structs = {name: [decode(b) for b in blobs] for name, (_, decode) in codecs.items()}
    digests = {name: digest(encode, structs[name]) for name, (encode, _) in codecs.items()}
    print(json.dumps({"digests": digests}), flush=True)
    names = list(codecs)
    for i, _ in enumerate(sys.stdin):
        reps = {}
        for name in names[i % len(names) :] + names[: i % len(names)]:
            encode, decode = codecs[name]
            reps[name] = time_codec(encode, decode, structs[name], blobs)
        print(json.dumps(reps), flush=True)
    return 0


class SideCodec:
    def __init__(self, python: str, batches_path: Path, codec: str) -> None:
        # -P: benchmarks/ must not shadow vLLM's imports (benchmarks/kernels.py vs `kernels`).
        command = [python, "-P", __file__, "--side", batches_path, "--codec", codec]
        # The project on PYTHONPATH: in vLLM's venv that is what times kvledger's codec head to
        # head with vLLM's in one process (msgspec is all it needs there).
        root = str(Path(__file__).resolve().parent.parent)
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [str(c) for c in command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONPATH=path),
        )
        self.digests: dict[str, str] = self._read()["digests"]

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            sys.exit("a codec's subprocess exited (is --vllm-venv vLLM 0.33's venv?)")
        return json.loads(line)

    def rep(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self._read()  # {codec: its timings}

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


OURS, VLLM = "kvledger (msgspec)", "vLLM 0.33 (msgspec)"
HEAD_TO_HEAD = "kvledger, in vLLM's process"
TWIN = "kvledger (msgspec), a 2nd process"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vllm-venv", default=os.environ.get("KVLEDGER_VLLM_ORACLE"))
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--codec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        return side(args.side, args.codec)

    import msgspec

    from ledger.events import decode_batch, decode_batch_generic, encode_batch

    global _PACK
    _PACK = _make_packer().pack

    blobs = record_batches(args.requests)
    structs = [decode_batch(b) for b in blobs]
    num_events = sum(len(b.events) for b in structs)
    ours = digest(encode_batch, structs)

    def in_process(name: str, encode: Any, decode: Any) -> Any:
        return lambda: {name: time_codec(encode, decode, structs, blobs)}

    codecs: dict[str, Any] = {
        "kvledger, this process": in_process("kvledger, this process", encode_batch, decode_batch),
        "kvledger before (pure Python)": in_process(
            "kvledger before (pure Python)", legacy_encode_batch, decode_batch_generic
        ),
    }
    if digest(legacy_encode_batch, structs) != ours:
        sys.exit("the old codec's bytes differ from the new one's")
    sides: dict[str, SideCodec] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "batches.msgpack"
        path.write_bytes(msgspec.msgpack.encode(blobs))
        sides[OURS] = SideCodec(sys.executable, path, "kvledger")
        if args.vllm_venv:
            sides[VLLM] = SideCodec(str(Path(args.vllm_venv) / "bin" / "python"), path, "vllm")
        # The same codec in one more process: how far two processes differ with nothing else
        # different (up to ~12% on this machine), the yardstick for the rows across processes.
        sides[TWIN] = SideCodec(sys.executable, path, "kvledger-twin")
        for codec in sides.values():
            for name, side_digest in codec.digests.items():
                if side_digest != ours:
                    sys.exit(f"{name} wrote different bytes for the same events")
            codecs[" + ".join(codec.digests)] = codec.rep
        runs: dict[str, list[dict]] = {}
        names = list(codecs)
        for i in range(args.repeats):
            # Each rep starts with another codec, so none is always the one after the others.
            for name in names[i % len(names) :] + names[: i % len(names)]:
                for row, timing in codecs[name]().items():
                    runs.setdefault(row, []).append(timing)
        for codec in sides.values():
            codec.close()

    print(
        f"\nKV-event codec: {len(blobs)} batches, {num_events:,} events "
        f"({sum(map(len, blobs)) / 1e6:.1f} MB), same bytes from every codec; "
        f"events/s, median of {args.repeats} interleaved (min-max), GC on"
    )
    print(f"{'codec':<32} {'encode':>26} {'decode':>26}")
    rows = {}
    for name, reps in runs.items():
        row = {}
        cells = []
        for op in ("encode", "decode"):
            rates = [num_events / r[f"{op}_s"] for r in reps]
            row[op] = {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}
            cells.append(
                f"{row[op]['median'] / 1e6:.2f}M ({min(rates) / 1e6:.2f}-{max(rates) / 1e6:.2f})"
            )
        rows[name] = row
        print(f"{name:<32} {cells[0]:>26} {cells[1]:>26}")
    base = VLLM if VLLM in rows else "kvledger before (pure Python)"
    for row in (OURS, TWIN, HEAD_TO_HEAD):
        if row not in rows:
            continue
        for op in ("encode", "decode"):
            ratio = rows[row][op]["median"] / rows[base][op]["median"]
            pairs = [
                b[f"{op}_s"] / a[f"{op}_s"] for a, b in zip(runs[row], runs[base], strict=True)
            ]
            print(f"  {row} {op} vs {base}: {ratio:.2f}x (rep by rep: "
                  f"{min(pairs):.2f}-{max(pairs):.2f}x, median {statistics.median(pairs):.2f}x)")  # fmt: skip
    if args.json:
        machine = {"python": sys.version.split()[0], "cpus": os.cpu_count()}
        result = {"batches": len(blobs), "events": num_events, "rows": rows, "machine": machine}
        args.json.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
