"""The tools a newcomer runs first: `kvledger hash` prints a block's hash as `kvledger events`
shows it, `kvledger events | head` ends quietly, and `events` without --replica says which
replicas exist instead of showing an empty view."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from ledger.events import BlockStored, KVEventBatch, encode_batch
from ledger.hashing import BlockHasher, resolve_none_hash_seed, to_event_hash
from ledger.offloading.base import num_cpu_chunks
from services.transport.keys import StreamNames
from services.transport.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]


def kvledger(*argv: str, **kwargs) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
    return subprocess.run(
        [sys.executable, "-m", "kvledger.cli", *argv], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=60, **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


def publish(url: str, replica: str, batches: int) -> None:
    r = redis.Redis.from_url(url)
    for i in range(batches):
        event = BlockStored([i + 1], None, [1, 2, 3, 4], 4, None, None, None)
        r.xadd(
            StreamNames("kvl", replica).events,
            {b"batch": encode_batch(KVEventBatch(time.time(), [event]))},
        )
    r.close()


def test_hash_prints_the_digits_events_prints():
    done = kvledger("hash", "--tokens", ",".join(map(str, range(32))), "--block-size", "16")
    assert done.returncode == 0, done.stderr
    hasher = BlockHasher("sha256", seed=resolve_none_hash_seed("sha256"))
    for block in hasher.hash_blocks(list(range(32)), 16):
        assert f"{to_event_hash(block):016x}" in done.stdout
        assert block.hex() in done.stdout


def test_hash_takes_text_through_the_models_tokenizer():
    done = kvledger("hash", "--text", "the quick brown fox " * 8, "--block-size", "16")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].endswith(
        "tokens: " + done.stdout.split("tokens: ")[1].splitlines()[0]
    )
    assert "in `events`" in done.stdout


@pytest.mark.parametrize("reader", ["head -n 2", "(sleep 2; head -n 2)"])
def test_events_piped_into_head_ends_without_a_traceback(redis_url, reader):
    # A late reader finds all 200 lines in the pipe's buffer: no write fails, and the tool
    # must notice the closed pipe while it waits for more events (CI hung here once).
    publish(redis_url, "default", 200)
    command = (
        f"{sys.executable} -m kvledger.cli events --redis-url {redis_url} --from start | {reader}"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert len(done.stdout.splitlines()) == 2 and "BlockStored" in done.stdout
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_events_without_a_replica_names_the_replicas_there(redis_url):
    publish(redis_url, "r0", 1)
    publish(redis_url, "r1", 1)
    done = kvledger("events", "--redis-url", redis_url, "--count", "1")
    assert done.returncode == 2
    assert "--replica" in done.stderr and "default, r0, r1" in done.stderr
    followed = kvledger("events", "--redis-url", redis_url, "--replica", "r1", "--count", "1")
    assert followed.returncode == 0 and "BlockStored" in followed.stdout


def test_capacity_prints_each_tiers_size_in_blocks_and_tokens_as_the_ledger_sizes_them():
    """Llama-3.2-1B's block (16 layers, 8 KV heads of 64, bfloat16: 512 KiB): the GPU line as
    before, then the CPU tier as the ledger counts its chunks (vLLM's: the budget over one page-
    padded block of every worker) and the shared tier's budget over a block's bytes."""
    shape = ["--layers", "16", "--kv-heads", "8", "--head-dim", "64", "--dtype", "bfloat16",
             "--kv-cache-memory", "20GiB", "--max-model-len", "8192"]  # fmt: skip
    done = kvledger("capacity", *shape, "--kv-offloading-size", "0.75", "--shared-tier-size",
                    "1TiB")  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].startswith("GPU KV cache size: 655,360 tokens")
    chunks = num_cpu_chunks(0.75 * 2**30, 524_288)
    assert chunks == 1536
    assert lines[2] == "CPU tier: 1,536 blocks, 24,576 tokens, 0.75 GiB"
    assert lines[3] == "Shared tier: 2,097,152 blocks, 33,554,432 tokens, 1024 GiB"
    # Without the tiers' flags, the GPU's line alone, as before.
    assert len(kvledger("capacity", *shape).stdout.splitlines()) == 2
    # Under tensor parallelism each worker's share is padded to whole pages: a 3-way split of
    # 524,288 bytes is 174,763 each, 176,128 padded, so 3 shares take 528,384 bytes.
    tp = kvledger("capacity", *shape, "--kv-offloading-size", "0.75", "--tensor-parallel-size", "3")
    assert tp.stdout.splitlines()[2].startswith(
        f"CPU tier: {num_cpu_chunks(0.75 * 2**30, 174_763, 3):,} blocks"
    )
    bad = kvledger("capacity", *shape, "--kv-offloading-size", "0")
    assert bad.returncode == 2 and "a size in GiB greater than 0" in bad.stderr
