"""`kvledger up --tensor-parallel-size N` on the CPU (gloo): greedy tokens equal the TP=1 model's
token for token through preemptions and prefix-cache hits, and a rank killed mid-run is
restarted, the group re-forms for a new epoch, and every request still finishes right."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest

from gpu_worker.checkpoint import load_checkpoint
from tests.e2e.conftest import Served, metric_value, serve
from tests.e2e.test_checkpoints_served import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    NUM_GPU_BLOCKS,
    complete_ids,
    random_prompt,
)
from tests.gpu_worker.checkpoints import ARCHITECTURES, make_tiny_checkpoint
from tests.harness.stack import dense_greedy

NO_PREEMPTION = "the wave preempted no request"


def get_text_sync(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()


def served_tp(folder: Path, size: int):
    return serve(
        folder,
        num_gpu_blocks=NUM_GPU_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        extra_args=("--tensor-parallel-size", str(size)),
        startup_timeout=180.0,
    )


def rank_pid(served: Served, rank: int) -> int:
    """The pid of the worker child of `kvledger up` that runs tensor-parallel rank `rank`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == served.process.pid and f"KVLEDGER_TP_RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no rank {rank} among the children of {served.process.pid}")


async def check_wave(
    served: Served, folder: Path, seed: int, kill_rank: int | None = None, max_tokens: int = 12
) -> float | None:
    """Run a wave and check its tokens; with `kill_rank`, that rank is killed mid-wave and the
    return is the wall time of the kill (else None)."""
    reference = load_checkpoint(folder, dtype="float32")
    rng = random.Random(seed)
    shared = random_prompt(rng, 24)
    # The shared prefix is cached before the wave, and its prompts go first: admitted before the
    # wave's preemptions can evict those blocks, they hit whatever order the scheduler picks.
    await complete_ids(served.url, [shared + random_prompt(rng, 3)], max_tokens=2)
    prompts = [shared + random_prompt(rng, 5), shared + random_prompt(rng, 9)]
    prompts += [random_prompt(rng, n) for n in (9, 17, 23, 30, 34, 41)]
    metrics = served.ledger_metrics_url
    preempted = metric_value(get_text_sync(metrics), "vllm:num_preemptions_total")
    wave = asyncio.create_task(complete_ids(served.url, prompts, max_tokens=max_tokens))
    if kill_rank is not None:  # mid-run: once the ledger has stepped the wave a little
        await asyncio.sleep(0.5)
        assert not wave.done()
        killed_at = time.time()
        os.kill(rank_pid(served, kill_rank), signal.SIGKILL)
    replies = await wave
    for i, (ids, reply) in enumerate(zip(prompts, replies, strict=True)):
        assert reply["choices"][0]["token_ids"] == dense_greedy(reference, ids, max_tokens), i
    text = get_text_sync(metrics)
    assert metric_value(text, "vllm:prefix_cache_hits_total") > 0
    if kill_rank is None:
        assert metric_value(text, "vllm:num_preemptions_total") > preempted, NO_PREEMPTION
    return killed_at if kill_rank is not None else None


async def check_waves(served: Served, folder: Path, seed: int, tries: int = 3) -> None:
    """Waves until one preempted (each checked token for token): on a loaded machine the
    prompts can reach the ledger spread out enough that one wave fits without preempting."""
    for attempt in range(tries):
        try:
            await check_wave(served, folder, seed=seed + 100 * attempt)
            return
        except AssertionError as exc:
            if NO_PREEMPTION not in str(exc) or attempt == tries - 1:
                raise


def reformed_after(served: Served, since: float, size: int) -> float:
    """Seconds from `since` until every rank had formed the group of one later epoch."""
    formed: dict[str, dict[int, float]] = {}
    for record in served.log_records("tp_group_formed"):
        at = datetime.fromisoformat(record["timestamp"]).timestamp()
        if at > since:
            ranks = formed.setdefault(record["epoch"], {})
            ranks[record["rank"]] = at
            if len(ranks) == size:
                return max(ranks.values()) - since
    raise AssertionError(f"no group of {size} ranks formed after the kill")


@pytest.mark.parametrize(
    "arch",
    [ARCHITECTURES[0], *(pytest.param(a, marks=pytest.mark.slow) for a in ARCHITECTURES[1:])],
)
async def test_tp2_greedy_tokens_equal_tp1(arch, tmp_path):
    folder = make_tiny_checkpoint(tmp_path, arch, seed=ARCHITECTURES.index(arch))
    with served_tp(folder, 2) as served:
        await check_waves(served, folder, seed=1)
        assert "tensor parallel 2" in served.capacity_line


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
async def test_tp4_greedy_tokens_equal_tp1(arch, tmp_path):
    folder = make_tiny_checkpoint(tmp_path, arch, seed=ARCHITECTURES.index(arch))
    with served_tp(folder, 4) as served:
        await check_waves(served, folder, seed=2)


async def test_a_killed_rank_is_restarted_and_every_request_finishes_right(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, ARCHITECTURES[0], seed=0)
    with served_tp(folder, 2) as served:
        await check_waves(served, folder, seed=3)  # the group has formed and served
        victim = rank_pid(served, 1)
        killed_at = await check_wave(served, folder, seed=4, kill_rank=1, max_tokens=40)
        assert killed_at is not None and rank_pid(served, 1) != victim
        failed = [r for r in served.log_records("tp_rendezvous_failed") if r["epoch"]]
        print(
            f"\nre-formed {reformed_after(served, killed_at, 2):.2f} s after the kill "
            f"({len(failed)} rendezvous failed on the way)"
        )
        assert served.log_records("workers_changing") or served.log_records("workers_changed")
        deadline = time.monotonic() + 30
        while metric_value(get_text_sync(served.ledger_metrics_url), "vllm:kv_cache_usage_perc"):
            assert time.monotonic() < deadline, "blocks still in use after every request ended"
            time.sleep(0.2)
