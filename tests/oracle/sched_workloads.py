"""Seeded workloads for the scheduler-level differential (run by sched_harness.drive).

A workload is {"config": {...}, "requests": [...], "aborts": [...], "resets": [...]}, plain
JSON so that it crosses into vLLM's venv as is. `random_workload` draws one per seed and mode
over tight pools, so that preemption, eviction, the watermark and the long-prefill cap all come
up: shared prefixes and cache salts for prefix hits, EOS and stop tokens, priorities, aborts
before a step and between a step and its results, and prefix-cache resets.
"""

from __future__ import annotations

import random
from typing import Any

from tests.oracle.sched_harness import SAMPLE_VOCAB

# async: two steps in flight (the service's default), chunked prefill on or off at random.
MODES = ("async", "lockstep", "lockstep-unchunked")


def base_config(seed: int, **overrides: Any) -> dict[str, Any]:
    config = {
        "seed": seed,
        "hash_algo": "sha256",
        "none_hash_seed": None,
        "block_size": 16,
        "num_blocks": 48,
        "max_model_len": 512,
        "max_num_seqs": 6,
        "max_num_batched_tokens": 128,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
        "async_scheduling": False,
        "watermark": 0.0,
        "long_prefill_token_threshold": 0,
        "policy": "fcfs",
        "reset_when_idle": False,
    }
    config.update(overrides)
    return config


def generate_workload(seed: int, num_requests: int = 40, **config: Any) -> dict:
    """The fixed lock-step workloads: requests arrive over 60 steps, 512-token context."""
    rng = random.Random(seed)
    config = base_config(seed, **config)
    prefixes = [
        [rng.randrange(100, 32000) for _ in range(rng.randrange(20, 120))] for _ in range(3)
    ]
    requests = []
    for i in range(num_requests):
        head = rng.choice(prefixes) if rng.random() < 0.7 else []
        tail = [rng.randrange(100, 32000) for _ in range(rng.randrange(1, 160))]
        requests.append(
            request_spec(
                f"q{i}",
                head + tail,
                max_tokens=rng.randrange(1, 120),
                salt=rng.choice((None, None, "tenant-a")),
                arrival_step=rng.randrange(0, 60),
                priority=rng.randrange(3) if config["policy"] == "priority" else 0,
            )
        )
    return {"config": config, "requests": requests}


def request_spec(rid: str, prompt: list[int], max_tokens: int, **fields: Any) -> dict[str, Any]:
    spec = {
        "rid": rid,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": 0,
        "stop_token_ids": [],
        "salt": None,
        "arrival_step": 0,
        "priority": 0,
    }
    spec.update(fields)
    return spec


def random_workload(seed: int, mode: str) -> dict:
    rng = random.Random(f"{mode}-{seed}")
    block_size = rng.choice((4, 8, 16))
    max_model_len = rng.choice((48, 64, 96, 128, 192))
    needed = -(-max_model_len // block_size)
    # From a pool that holds one full-length request to one that holds about three.
    num_blocks = needed + 1 + rng.randrange(0, 2 * needed + 1)
    max_num_seqs = rng.randrange(2, 9)
    chunked = mode == "lockstep" or (mode == "async" and rng.random() < 0.75)
    if chunked:
        budget = rng.randrange(max(max_num_seqs, 8), 2 * max_model_len + 1)
    else:  # at or near vLLM's floor, where long prompts compete for the budget
        budget = rng.choice((max_model_len, rng.randrange(max_model_len, 2 * max_model_len)))
    config = base_config(
        seed,
        hash_algo=rng.choice(("sha256", "sha256_cbor")),
        none_hash_seed=rng.choice((None, None, None, "0", "kvledger")),
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        async_scheduling=mode == "async",
        watermark=rng.choice((0.0, 0.0, 0.0, 0.02, 0.05, 0.1)),
        # vLLM refuses a threshold over max_model_len.
        long_prefill_token_threshold=rng.choice(
            (0, max_model_len // 2, max_model_len // 3, rng.randrange(1, max_model_len + 1))
        ),
        policy=rng.choice(("fcfs", "fcfs", "priority")),
        reset_when_idle=rng.random() < 0.5,
        # Off, every freed block is uncached: their order at the front of the free queue shows.
        enable_prefix_caching=rng.random() < 0.85,
    )
    prefixes = [
        [rng.randrange(100, 32000) for _ in range(rng.randrange(1, max_model_len // 2))]
        for _ in range(rng.randrange(1, 4))
    ]
    num_requests = rng.randrange(4, 25)
    requests, wave_start = [], 0
    for i in range(num_requests):
        if rng.random() < 0.15:  # a new wave, often after the last one has drained
            wave_start += rng.randrange(10, 120)
        head = rng.choice(prefixes) if rng.random() < 0.6 else []
        head = head[: max_model_len - 3]
        tail = [rng.randrange(100, 32000) for _ in range(rng.randrange(1, max_model_len // 2))]
        tail += [rng.randrange(100, 32000) for _ in range(max_model_len)]
        shortest = 1 if chunked or rng.random() < 0.5 else max_model_len // 3
        prompt = (head + tail)[: rng.randrange(shortest, max_model_len - 1)]
        # Sometimes past max_model_len, so the length cap there comes up too.
        max_tokens = rng.choice((rng.randrange(1, 24), rng.randrange(1, max_model_len)))
        requests.append(
            request_spec(
                f"q{i}",
                prompt,
                max_tokens=max_tokens,
                min_tokens=rng.choice((0, 0, 0, 0, rng.randrange(0, max_tokens + 1))),
                stop_token_ids=rng.choice(([], [], [], [rng.randrange(SAMPLE_VOCAB)])),
                salt=rng.choice((None, None, None, "tenant-a")),
                arrival_step=wave_start + rng.randrange(0, 12),
                priority=rng.randrange(3) if config["policy"] == "priority" else 0,
            )
        )
    last_arrival = max(r["arrival_step"] for r in requests)
    aborts = [
        {
            "rid": f"q{rng.randrange(num_requests)}",
            "step": rng.randrange(0, last_arrival + 60),
            "phase": rng.choice(("before", "between")),
        }
        for _ in range(rng.choice((0, 1, 2, 4)))
    ]
    resets = sorted(rng.randrange(0, last_arrival + 60) for _ in range(rng.randrange(0, 4)))
    return {"config": config, "requests": requests, "aborts": aborts, "resets": resets}
