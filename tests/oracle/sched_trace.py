"""Scheduler-level differential: a seeded workload run step by step through our Scheduler.

Requests arrive over the first steps with shared prefixes and cache salts; each step's
"sampled" token is a fixed function of (request, position), with an EOS that stops some early.
Each step is reduced to a side-neutral record (`step_record`) that vllm_sched_driver.py also
writes, so the two schedulers can be compared step by step.
"""

from __future__ import annotations

import random
from typing import Any

from ledger.core.events import KVEventBatch, encode_batch
from ledger.core.hashing import BlockHasher
from ledger.core.kv_cache_manager import KVCacheManager
from ledger.core.request import Request
from ledger.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tests.oracle.ledger_backend import none_hash_seed

EOS = 7
SAMPLE_VOCAB = 50  # small, so EOS comes up now and then


def sampled_token(index: int, position: int, seed: int) -> int:
    return (index * 7919 + position * 104729 + seed * 31) % SAMPLE_VOCAB


def generate_workload(
    seed: int,
    num_requests: int = 40,
    hash_algo: str = "sha256",
    num_blocks: int = 48,
    max_num_seqs: int = 6,
    max_num_batched_tokens: int = 128,
    watermark: float = 0.0,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
) -> dict:
    rng = random.Random(seed)
    config = {
        "seed": seed,
        "hash_algo": hash_algo,
        "none_hash_seed": None,
        "block_size": 16,
        "num_blocks": num_blocks,
        "max_model_len": 512,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "watermark": watermark,
        "long_prefill_token_threshold": long_prefill_token_threshold,
        "policy": policy,
    }
    prefixes = [
        [rng.randrange(100, 32000) for _ in range(rng.randrange(20, 120))] for _ in range(3)
    ]
    requests = []
    for i in range(num_requests):
        head = rng.choice(prefixes) if rng.random() < 0.7 else []
        tail = [rng.randrange(100, 32000) for _ in range(rng.randrange(1, 160))]
        requests.append(
            {
                "rid": f"q{i}",
                "prompt": head + tail,
                "max_tokens": rng.randrange(1, 120),
                "salt": rng.choice((None, None, "tenant-a")),
                "arrival_step": rng.randrange(0, 60),
                "priority": rng.randrange(3) if policy == "priority" else 0,
            }
        )
    requests.sort(key=lambda r: r["arrival_step"])
    return {"config": config, "requests": requests}


def step_record(
    scheduled: list[tuple[str, int]],
    full_tables: dict[str, list[int]],
    new_blocks: dict[str, list[int]],
    preempted: list[str],
    finished: list[str],
    done: list[str],
    events: bytes,
    free_queue: list[int],
) -> dict[str, Any]:
    """One step, side-neutral: vLLM sends resumed requests as cached ones, we as new ones."""
    return {
        "scheduled": [list(item) for item in scheduled],
        "full_tables": dict(sorted(full_tables.items())),
        "new_blocks": dict(sorted(new_blocks.items())),
        "preempted": sorted(preempted),
        "finished": sorted(finished),
        "done": sorted(done),
        "events": events.hex(),
        "free_queue": free_queue,
    }


def _record(out: SchedulerOutput, done: list[str], manager: KVCacheManager, step: int) -> dict:
    return step_record(
        scheduled=list(out.num_scheduled_tokens.items()),
        full_tables={n.request.request_id: n.block_ids for n in out.scheduled_new_reqs},
        new_blocks={c.request.request_id: c.new_block_ids for c in out.scheduled_cached_reqs},
        preempted=out.preempted_req_ids,
        finished=list(out.finished_req_ids),
        done=done,
        events=encode_batch(KVEventBatch(ts=float(step), events=manager.take_events())),
        free_queue=[b.block_id for b in manager.block_pool.free_block_queue],
    )


def run_ledger(workload: dict, max_steps: int = 5000) -> list[dict]:
    config = workload["config"]
    hasher = BlockHasher(config["hash_algo"], seed=none_hash_seed(config))
    manager = KVCacheManager(
        config["num_blocks"],
        config["block_size"],
        config["max_model_len"],
        enable_kv_cache_events=True,
        watermark=config["watermark"],
    )
    scheduler = Scheduler(
        SchedulerConfig(
            max_model_len=config["max_model_len"],
            max_num_seqs=config["max_num_seqs"],
            max_num_batched_tokens=config["max_num_batched_tokens"],
            policy=config["policy"],
            long_prefill_token_threshold=config["long_prefill_token_threshold"],
        ),
        manager,
    )
    pending = list(workload["requests"])
    index = {r["rid"]: i for i, r in enumerate(workload["requests"])}
    records = []
    for step in range(max_steps):
        while pending and pending[0]["arrival_step"] <= step:
            spec = pending.pop(0)
            scheduler.add_request(
                Request(
                    spec["rid"],
                    spec["prompt"],
                    spec["max_tokens"],
                    eos_token_id=EOS,
                    priority=spec["priority"],
                    arrival_time=float(index[spec["rid"]]),
                    cache_salt=spec["salt"],
                    block_hasher=hasher,
                    block_size=config["block_size"],
                )
            )
        if not pending and not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        sampled = {}
        for rid in out.num_scheduled_tokens:
            request = scheduler.requests[rid]
            if request.num_computed_tokens >= request.num_tokens:
                sampled[rid] = sampled_token(index[rid], request.num_tokens, config["seed"])
        updates = scheduler.update_from_output(out, sampled)
        done = [u.request.request_id for u in updates if u.finished]
        records.append(_record(out, done, manager, step))
    return records
