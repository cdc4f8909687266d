"""`kvledger hash`, `capacity`, `simulate` and `events`: tools around the ledger core."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path

from kvledger.report import format_table
from ledger.capacity import (
    KVCacheShape,
    capacity_line,
    check_enough_kv_cache_memory,
    dtype_bytes,
    kv_budget_from_utilization,
    num_blocks_from_memory,
    tier_capacity_line,
)
from ledger.hashing import HASH_ALGOS, BlockHasher, resolve_none_hash_seed, to_event_hash
from ledger.offloading.base import num_cpu_chunks
from services.config import parse_bytes, parse_offloading_size


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "hash",
        help="print the block hashes of a prompt (hex, and as KV events carry them: the int and "
        "the 16 hex digits `kvledger events` prints)",
    )
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens", help="comma-separated token ids, e.g. 1,2,3")
    prompt.add_argument("--text", help="a prompt, tokenized with --model's tokenizer")
    p.add_argument(
        "--model", default="smollm2", help="model whose tokenizer reads --text (default: smollm2)"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--algo", choices=HASH_ALGOS, default="sha256")
    p.add_argument("--seed", help="NONE_HASH seed (default: PYTHONHASHSEED, else vLLM's default)")
    p.add_argument("--cache-salt", help="the request's cache_salt (enters block 0 only)")
    p.set_defaults(func=cmd_hash)

    p = sub.add_parser(
        "capacity", help="print the KV cache capacity line, or why one request cannot fit"
    )
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument(
        "--dtype", default="bfloat16", help="KV cache dtype (bfloat16, float16, float32, fp8)"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--kv-cache-memory", help="the KV budget, e.g. 55910MiB or 20GiB")
    p.add_argument(
        "--total-memory", help="device memory, e.g. 80GiB (with --gpu-memory-utilization)"
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    p.add_argument("--weights", default="0", help="weights size, e.g. 15GiB")
    p.add_argument("--activation-peak", default="0", help="profiled peak activation memory")
    p.add_argument("--num-gpu-blocks-override", type=int)
    p.add_argument("--device", default="GPU", help="name in the capacity line (GPU, CPU)")
    p.add_argument(
        "--kv-offloading-size",
        help="the CPU tier in GiB, as the ledger's --kv-offloading-size: print its size in blocks "
        "and tokens too",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="workers sharing each block (the CPU tier pads each worker's share to whole pages)",
    )
    p.add_argument(
        "--shared-tier-size",
        help="the shared tier's budget, e.g. 100GiB: print what it holds in blocks and tokens",
    )
    p.set_defaults(func=cmd_capacity)

    p = sub.add_parser(
        "simulate", help="run the real ledger on the paged-allocator blog's workload"
    )
    p.add_argument(
        "--policy",
        choices=("blog", "vllm", "all"),
        default="all",
        help="blog: the blog's rules over our BlockPool (reproduces its tables); vllm: our scheduler",
    )
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--json", type=Path, help="also write every result as JSON here")
    p.add_argument(
        "--plot", type=Path, help="also draw the sweeps as a PNG here (needs matplotlib)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("events", help="tail the KV-events stream in a readable form")
    p.add_argument("--redis-url", help="Redis URL (env KVLEDGER_REDIS_URL)")
    p.add_argument(
        "--stream-prefix",
        default=None,
        help="key prefix (default: kvl; env KVLEDGER_STREAM_PREFIX)",
    )
    p.add_argument(
        "--replica",
        default=None,
        help="replica to follow (default: the one replica publishing events, or `default`; "
        "env KVLEDGER_REPLICA)",
    )
    p.add_argument(
        "--from",
        dest="start",
        default="snapshot",
        choices=("snapshot", "start", "end"),
        help="snapshot: the cached blocks now, then new events; start: replay the stream",
    )
    p.add_argument("--count", type=int, default=0, help="stop after this many batches (0: follow)")
    p.set_defaults(func=cmd_events)


def cmd_hash(args: argparse.Namespace) -> int:
    if args.text is not None:
        from services.tokenization.load import load_tokenizer

        tokens = load_tokenizer(args.model).encode(args.text)
        print(f"{len(tokens)} tokens: {','.join(map(str, tokens))}")
    else:
        try:
            tokens = [int(t) for t in args.tokens.replace(" ", "").split(",") if t]
        except ValueError:
            print(
                "kvledger hash: --tokens takes comma-separated integers, e.g. 1,2,3",
                file=sys.stderr,
            )
            return 2
    seed = args.seed if args.seed is not None else resolve_none_hash_seed(args.algo)
    hasher = BlockHasher(args.algo, seed=seed)
    hashes = hasher.hash_blocks(tokens, args.block_size, cache_salt=args.cache_salt)
    print(
        f"algo={args.algo} seed={seed!r} block_size={args.block_size} NONE_HASH={hasher.none_hash.hex()}"
    )
    rows = [
        [
            i,
            f"{i * args.block_size}..{(i + 1) * args.block_size - 1}",
            h.hex(),
            str(to_event_hash(h)),
            f"{to_event_hash(h):016x}",
        ]
        for i, h in enumerate(hashes)
    ]
    print(format_table(["block", "tokens", "hash (hex)", "KV-event int", "in `events`"], rows))
    if len(tokens) % args.block_size:
        print(f"({len(tokens) % args.block_size} trailing tokens make no full block: never cached)")
    return 0


def cmd_capacity(args: argparse.Namespace) -> int:
    shape = KVCacheShape(
        args.layers, args.kv_heads, args.head_dim, dtype_bytes(args.dtype), args.block_size
    )
    if args.kv_cache_memory:
        budget = parse_bytes(args.kv_cache_memory)
    elif args.total_memory:
        budget = kv_budget_from_utilization(
            parse_bytes(args.total_memory),
            args.gpu_memory_utilization,
            parse_bytes(args.weights),
            parse_bytes(args.activation_peak),
        )
    else:
        print(
            "kvledger capacity: give --kv-cache-memory, or --total-memory (with --weights ...)",
            file=sys.stderr,
        )
        return 2
    num_blocks = num_blocks_from_memory(budget, shape, args.num_gpu_blocks_override)
    print(f"{shape.bytes_per_block:,} bytes per block; {num_blocks:,} blocks from {budget:,} bytes")
    try:
        check_enough_kv_cache_memory(num_blocks * shape.bytes_per_block, shape, args.max_model_len)
    except ValueError as exc:
        print(f"ValueError: {exc}")
        return 1
    print(capacity_line(num_blocks, args.block_size, args.max_model_len, args.device))
    try:
        for line in tier_lines(args, shape.bytes_per_block):
            print(line)
    except ValueError as exc:
        print(f"kvledger capacity: {exc}", file=sys.stderr)
        return 2
    return 0


def tier_lines(args: argparse.Namespace, bytes_per_block: int) -> list[str]:
    """Each tier beyond the GPU's, in blocks and tokens: the CPU tier as the ledger sizes it
    (vLLM's count: the budget over one block of every worker, padded to whole pages), the shared
    tier as its budget over a block's bytes (before its backend's own overhead)."""
    lines = []
    tp = max(1, args.tensor_parallel_size)
    if args.kv_offloading_size:
        gib = parse_offloading_size(args.kv_offloading_size)
        chunks = num_cpu_chunks(gib * 2**30, -(-bytes_per_block // tp), tp)
        lines.append(tier_capacity_line("CPU tier", chunks, args.block_size, gib * 2**30))
    if args.shared_tier_size:
        budget = parse_bytes(args.shared_tier_size)
        blocks = budget // bytes_per_block if bytes_per_block else 0
        lines.append(tier_capacity_line("Shared tier", blocks, args.block_size, budget))
    return lines


def cmd_simulate(args: argparse.Namespace) -> int:
    from kvledger.simulate_report import run_and_report

    return run_and_report(args)


def cmd_events(args: argparse.Namespace) -> int:
    import asyncio

    from services.environment import env
    from services.events.subscriber import print_events

    url = args.redis_url or env("KVLEDGER_REDIS_URL")
    if not url:
        print("kvledger events: set --redis-url or KVLEDGER_REDIS_URL", file=sys.stderr)
        return 2
    prefix = args.stream_prefix or env("KVLEDGER_STREAM_PREFIX") or "kvl"
    replica = args.replica or env("KVLEDGER_REPLICA")
    if replica is None:
        found = asyncio.run(_replicas(url, prefix))
        if len(found) > 1:
            print(
                f"kvledger events: {len(found)} replicas publish KV events here "
                f"({', '.join(found)}): follow one with --replica NAME",
                file=sys.stderr,
            )
            return 2
        replica = found[0] if found else "default"
    # `kvledger events | head`: a reader that is gone ends the tool quietly, as it ends `cat`.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(print_events(url, prefix, args.start, args.count, replica))
    except BrokenPipeError:
        # `kvledger events | head`: the reader is gone, which is no error. Python would still
        # complain flushing stdout at exit; point it at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


async def _replicas(url: str, prefix: str) -> list[str]:
    from services.transport.redis_client import connect
    from services.transport.registry import known_replicas

    r = connect(url)
    try:
        return await known_replicas(r, prefix)
    finally:
        await r.aclose()
