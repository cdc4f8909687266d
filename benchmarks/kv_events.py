"""KV-event codec throughput: kvledger's msgspec codec vs vLLM 0.33's own encoder and the old one.

The batches are what the ledger publishes on a real run: our scheduler and KVCacheManager (events
on) over the shared-prefix workload in the blog's 100k-token pool, one batch per step. Three
codecs encode and decode the same batches, interleaved repetitions, GC on as in the service:
kvledger's (`ledger.core.events`), vLLM's `msgspec.msgpack.Encoder` over its own structs (in its
venv, a subprocess driven rep by rep), and the pure-Python codec kvledger had before (kept
below; its decoder lives on as `decode_batch_generic`, the fallback for older layouts). Every
codec's bytes are checked against kvledger's before timing.
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
    from ledger.core.events import KVEventBatch, encode_batch
    from ledger.core.hashing import BlockHasher
    from ledger.core.kv_cache_manager import KVCacheManager
    from ledger.core.request import Request
    from ledger.core.scheduler import Scheduler, SchedulerConfig

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
    from ledger.core.events import _FIELDS, _REQUIRED

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


def vllm_side(batches_path: str) -> int:
    """Inside vLLM's venv: decode the batches into vLLM's structs, then one rep per stdin line."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    blobs = msgspec.msgpack.decode(Path(batches_path).read_bytes(), type=list[bytes])
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(KVEventBatch)
    structs = [decoder.decode(b) for b in blobs]
    print(json.dumps({"digest": digest(encoder.encode, structs)}), flush=True)
    for _ in sys.stdin:
        print(json.dumps(time_codec(encoder.encode, decoder.decode, structs, blobs)), flush=True)
    return 0


class VllmCodec:
    def __init__(self, venv: str, batches_path: Path) -> None:
        # -P: benchmarks/ must not shadow vLLM's imports (benchmarks/kernels.py vs `kernels`).
        command = [str(Path(venv) / "bin" / "python"), "-P", __file__, "--side", batches_path]
        self.proc = subprocess.Popen(
            [str(c) for c in command], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.digest = self._read()["digest"]

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            sys.exit("the vLLM side exited (is --vllm-venv vLLM 0.33's venv?)")
        return json.loads(line)

    def rep(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vllm-venv", default=os.environ.get("KVLEDGER_VLLM_ORACLE"))
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        return vllm_side(args.side)

    import msgspec

    from ledger.core.events import decode_batch, decode_batch_generic, encode_batch

    global _PACK
    _PACK = _make_packer().pack

    blobs = record_batches(args.requests)
    structs = [decode_batch(b) for b in blobs]
    num_events = sum(len(b.events) for b in structs)
    ours = digest(encode_batch, structs)
    codecs: dict[str, Any] = {
        "kvledger (msgspec)": lambda: time_codec(encode_batch, decode_batch, structs, blobs),
        "kvledger before (pure Python)": lambda: time_codec(
            legacy_encode_batch, decode_batch_generic, structs, blobs
        ),
    }
    if digest(legacy_encode_batch, structs) != ours:
        sys.exit("the old codec's bytes differ from the new one's")
    vllm = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.vllm_venv:
            path = Path(tmp) / "batches.msgpack"
            path.write_bytes(msgspec.msgpack.encode(blobs))
            vllm = VllmCodec(args.vllm_venv, path)
            if vllm.digest != ours:
                sys.exit("vLLM's encoder wrote different bytes for the same events")
            codecs["vLLM 0.33 (msgspec)"] = vllm.rep
        runs: dict[str, list[dict]] = {name: [] for name in codecs}
        for _ in range(args.repeats):
            for name, rep in codecs.items():
                runs[name].append(rep())
        if vllm is not None:
            vllm.close()

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
    base = "vLLM 0.33 (msgspec)" if vllm else "kvledger before (pure Python)"
    for op in ("encode", "decode"):
        ratio = rows["kvledger (msgspec)"][op]["median"] / rows[base][op]["median"]
        print(f"  kvledger {op} vs {base}: {ratio:.2f}x")
    if args.json:
        machine = {"python": sys.version.split()[0], "cpus": os.cpu_count()}
        result = {"batches": len(blobs), "events": num_events, "rows": rows, "machine": machine}
        args.json.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
