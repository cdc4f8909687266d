"""`n` through the real gateway, ledger and worker: the samples are child requests that share
the prompt's blocks through the prefix cache (one prefill of its full blocks, ref counts of n),
and the KV events store each prompt block once."""

from __future__ import annotations

import asyncio

import msgpack

from tests.harness.gateway_stack import gateway_on
from tests.harness.stack import Stack

PROMPT = "Paged attention shares the prompt blocks."  # 41 chars + BOS: two full blocks of 16


async def test_n_samples_share_the_prompts_blocks_through_the_prefix_cache(redis_url, tiny_model):
    stack = await Stack(redis_url, tiny_model, num_blocks=64).start()
    try:
        async with gateway_on(stack) as client:
            manager = stack.ledger.manager
            max_ref = 0

            async def watch_ref_counts() -> None:
                nonlocal max_ref
                while True:
                    held = [b.ref_cnt for b in manager.block_pool.blocks if b.block_hash]
                    max_ref = max([max_ref, *held])
                    await asyncio.sleep(0.002)

            watcher = asyncio.create_task(watch_ref_counts())
            resp = await client.post(
                "/v1/completions",
                json={"prompt": PROMPT, "n": 3, "max_tokens": 12, "temperature": 1.0,
                      "seed": 7, "ignore_eos": True},
            )  # fmt: skip
            body = await resp.json()
            watcher.cancel()
            assert resp.status == 200, body
            stats = manager.prefix_cache_stats
            batches = [
                msgpack.unpackb(f[b"batch"]) for _, f in await stack.r.xrange(stack.streams.events)
            ]
    finally:
        await stack.stop()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in body["choices"]}) == 3  # seeds 7, 8, 9 draw apart
    assert body["usage"]["prompt_tokens"] == 42 and body["usage"]["completion_tokens"] == 36
    # The first child computes the two full prompt blocks; the others hit them.
    assert stats.requests == 3 and stats.hits == 2 * 32
    assert max_ref == 3  # each prompt block held by all three children at once
    events = [e for b in batches for e in b[1] if e["type"] == "BlockStored"]
    hashes = [h for e in events for h in e["block_hashes"]]
    assert len(hashes) == len(set(hashes))  # each block stored once, by the first child
    prompt_ids = [256, *PROMPT.encode()]
    first_stored = [t for e in events for t in e["token_ids"]][:32]
    assert first_stored == prompt_ids[:32]
