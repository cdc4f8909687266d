"""The CPU tier end to end: the ledger and worker services over a real redis-server, with
--kv-offloading-size on a GPU pool too small to keep the prompts' prefixes. Blocks evicted from
the GPU are loaded back from the worker's host buffer instead of computed again; the greedy
tokens are those of the dense model and of the same run without the tier; a restarted worker
takes the tier with it and the ledger forgets and unpublishes it."""

from __future__ import annotations

import asyncio

import msgpack

from ledger.hashing import to_event_hash
from ledger.offloading.base import offload_key_block_hash
from services.config import SharedTierSpec
from services.events.subscriber import KVEventSubscriber
from services.wire.messages import TIER_CPU, TIER_SHARED
from tests.engine.test_ledger_service import prompts
from tests.harness.gateway_stack import gateway_on
from tests.harness.stack import Stack, dense_greedy

# The tiny Llama's block is 32 KiB (4 layers, K and V, 16 tokens of one 64-wide head, float32):
# 1 MiB of tier holds 32 blocks, more than the 23 the GPU lends.
TIER_GIB = 1 / 1024
SETTINGS = {"num_blocks": 24, "max_model_len": 112, "max_num_batched_tokens": 256}


def workload() -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Three documents of four blocks; each is read, then pushed off the GPU by unrelated
    prompts, then read again by requests that outgrow the pool together (preemption)."""
    documents = prompts(3, 64, seed=11)
    first = [doc + tail for doc, tail in zip(documents, prompts(3, 8, seed=12), strict=True)]
    fillers = prompts(4, 80, seed=13)
    again = [documents[i % 3] + tail for i, tail in enumerate(prompts(6, 8, seed=14))]
    return first, fillers, again


async def serve(stack: Stack, max_tokens: int = 24) -> dict[str, list[int]]:
    first, fillers, again = workload()
    for phase, batch, tokens in (("a", first, 4), ("f", fillers, 4), ("b", again, max_tokens)):
        for i, prompt in enumerate(batch):
            await stack.submit(f"{phase}{i}", prompt, tokens)
        await stack.wait([f"{phase}{i}" for i in range(len(batch))], timeout=120)
    return {rid: result.tokens for rid, result in stack.results.items()}


async def stream_events(stack: Stack) -> list[dict]:
    return [
        event
        for _, fields in await stack.r.xrange(stack.streams.events)
        for event in msgpack.unpackb(fields[b"batch"])[1]
    ]


async def test_the_cpu_tier_loads_evicted_prefixes_and_keeps_greedy_tokens_exact(
    redis_url, tiny_model
):
    off = await Stack(redis_url, tiny_model, **SETTINGS).start()
    try:
        tokens_off = await serve(off)
        computed_off = off.ledger.scheduler.num_prompt_tokens_computed
        # No tier: nothing measured, none published.
        assert off.worker_services["w0"].hello.load_s_per_block is None
        status = off.ledger.status()
        assert status.num_cpu_blocks == 0 and status.costs is not None
        assert status.costs.load_s_per_block is None
    finally:
        await off.stop()
    on = await Stack(redis_url, tiny_model, kv_offloading_size=TIER_GIB, **SETTINGS).start()
    try:
        tokens_on = await serve(on)
        ledger = on.ledger
        assert ledger.num_cpu_chunks == 32
        assert tokens_on == tokens_off
        _, _, again = workload()
        for i, prompt in enumerate(again):
            assert tokens_on[f"b{i}"] == dense_greedy(tiny_model, prompt, 24), f"b{i}"
        scheduler = ledger.scheduler
        assert scheduler.num_loads > 0 and scheduler.num_loaded_tokens >= 64
        assert scheduler.num_preemptions > 0
        assert (
            ledger.scheduler.num_prompt_tokens_computed
            < computed_off - scheduler.num_loaded_tokens // 2
        )
        host = on.worker_services["w0"].runner.host_tier
        assert host is not None and host.blocks_loaded * 16 == scheduler.num_loaded_tokens
        # Loaded requests report their loaded tokens as cached, as vLLM counts external hits.
        assert any(r.final.num_cached_tokens >= 64 for r in on.results.values())
        # Its metrics: vLLM's connector lookups, and the blocks moved.
        labels = {"model_name": "kvledger-tiny-llama", "engine": "0"}

        def metric(name: str) -> float | None:
            return ledger.metrics.registry.get_sample_value(name, labels)

        for _ in range(100):  # the idle loop updates them within half a second
            if metric("kvledger:cpu_tier_loaded_blocks_total") == scheduler.num_loaded_blocks and (
                metric("kvledger:prompt_tokens_computed_total")
                == scheduler.num_prompt_tokens_computed
            ):
                break
            await asyncio.sleep(0.02)
        assert metric("kvledger:cpu_tier_loaded_blocks_total") == host.blocks_loaded
        assert metric("kvledger:cpu_tier_stored_blocks_total") == host.blocks_stored
        assert metric("vllm:external_prefix_cache_hits_total") > 0
        # vLLM's transfer metrics: bytes from the blocks moved (32 KiB each), time as timed.
        block_bytes = on.worker_services["w0"].hello.bytes_per_block
        assert metric("vllm:kv_offload_load_bytes_total") == host.blocks_loaded * block_bytes
        assert metric("vllm:kv_offload_store_bytes_total") == host.blocks_stored * block_bytes
        assert 0 < metric("vllm:kv_offload_load_time_total") < 5  # type: ignore[operator]
        assert 0 < metric("vllm:kv_offload_store_time_total") < 5  # type: ignore[operator]
        held_now = len(scheduler.connector.manager.ready_keys())  # type: ignore[union-attr]
        assert metric("kvledger:cpu_tier_blocks") == held_now
        # Every store past the tier's 32 chunks evicted one, and published it.
        assert metric("kvledger:cpu_tier_evicted_blocks_total") == host.blocks_stored - held_now
        assert metric("vllm:kv_offload_cpu_cache_usage_perc") == 0.0  # nothing in flight
        assert (
            metric("kvledger:prompt_tokens_computed_total")
            == ledger.scheduler.num_prompt_tokens_computed
        )
        # Every GPU block is free; the tier holds what it stored, nothing in flight.
        assert ledger.manager.num_free_blocks == 23 and not ledger.manager.req_to_blocks
        connector = scheduler.connector
        assert connector is not None and not connector.jobs and not scheduler.holding
        # The tier's changes are on the KV-event stream beside the GPU's, with medium CPU.
        events = await stream_events(on)
        cpu = [e for e in events if e.get("medium") == "CPU"]
        assert [e["type"] for e in cpu].count("BlockStored") == host.blocks_stored
        held = {to_event_hash(offload_key_block_hash(k)) for k in connector.manager.ready_keys()}
        stored = {e["block_hashes"][0] for e in cpu if e["type"] == "BlockStored"}
        assert held <= stored and held
        # The stream's mirror, its snapshot and a router's index of the tier are its books.
        assert set(ledger.events.tier_counts["CPU"]) == held
        follower = KVEventSubscriber(on.r, on.streams.prefix, replica=on.streams.replica)
        await follower.start("start")
        while await follower.poll(block_ms=None):
            pass
        await ledger.events.write_snapshot(ledger.manager.block_pool, ledger.epoch)
        late = KVEventSubscriber(on.r, on.streams.prefix, replica=on.streams.replica)
        await late.start("snapshot")
        for index in (follower.index, late.index):
            assert set(index.tier("CPU")) == held
            assert index.counts == ledger.events.counts
    finally:
        await on.stop()


async def test_the_workers_load_cost_reaches_the_status_and_the_gateways_health(
    redis_url, tiny_model, tmp_path
):
    stack = await Stack(
        redis_url, tiny_model, kv_offloading_size=TIER_GIB,
        kv_shared_tier=SharedTierSpec("dir", path=str(tmp_path)), **SETTINGS,
    ).start()  # fmt: skip
    try:
        hello = stack.worker_services["w0"].hello
        assert hello.load_s_per_block is not None
        measured = hello.load_s_per_block[TIER_CPU]
        assert 0 < measured < 0.05  # a 32 KiB copy on the CPU: microseconds, not a step
        # The shared tier's: a read through its backend into the host buffer, then that copy.
        shared = hello.load_s_per_block[TIER_SHARED]
        assert measured < shared < 0.5
        assert not any(tmp_path.rglob("*.kvb"))  # the probe blocks are gone again
        namespace = stack.ledger.shared.namespace
        async with gateway_on(stack) as client:
            for _ in range(100):  # the ledger rewrites its status every second
                body = await (await client.get("/health")).json()
                tiers = body.get("ledger", {}).get("tiers", {})
                if tiers.get("shared_tier") == namespace:
                    break
                await asyncio.sleep(0.05)
        assert tiers["load_s_per_block"] == {TIER_CPU: measured, TIER_SHARED: shared}
        assert tiers["num_cpu_blocks"] == 32
        assert body["ledger"]["costs"]["load_s_per_block"] == tiers["load_s_per_block"]
        assert "prefill_s_per_token" in tiers  # None until a prefill step is measured
    finally:
        await stack.stop()


async def test_a_restarted_worker_takes_the_tier_with_it_and_the_ledger_forgets_it(
    redis_url, tiny_model
):
    stack = await Stack(redis_url, tiny_model, kv_offloading_size=TIER_GIB, **SETTINGS).start()
    try:
        first, _, again = workload()
        for i, prompt in enumerate(first):
            await stack.submit(f"a{i}", prompt, 4)
        await stack.wait([f"a{i}" for i in range(3)])
        connector = stack.ledger.scheduler.connector
        assert connector is not None
        held = {to_event_hash(offload_key_block_hash(k)) for k in connector.manager.ready_keys()}
        assert len(held) >= 12  # the three documents' blocks at least
        for i, prompt in enumerate(again):
            await stack.submit(f"b{i}", prompt, 40)
        while sum(len(stack.results[f"b{i}"].tokens) for i in range(6)) < 6:
            await asyncio.sleep(0.01)
        epoch = stack.ledger.epoch
        await stack.kill_worker("w0")
        await stack.start_worker("w0")
        results = await stack.wait([f"b{i}" for i in range(6)], timeout=120)
        assert stack.ledger.epoch != epoch
        for i, prompt in enumerate(again):
            assert results[f"b{i}"].tokens == dense_greedy(tiny_model, prompt, 40), f"b{i}"
        # Everything the tier held was published as removed (medium CPU) when the worker went.
        events = await stream_events(stack)
        removed = {
            h
            for e in events
            if e["type"] == "BlockRemoved" and e.get("medium") == "CPU"
            for h in e["block_hashes"]
        }
        assert held <= removed
        # The mirror holds what the tier stored since, as its books do.
        now_held = {
            to_event_hash(offload_key_block_hash(k)) for k in connector.manager.ready_keys()
        }
        assert set(stack.ledger.events.tier_counts.get("CPU", {})) == now_held
        assert stack.ledger.manager.num_free_blocks == 23
        assert not connector.jobs and not stack.ledger.scheduler.holding
    finally:
        await stack.stop()


async def test_sync_loads_admit_a_loaded_request_in_the_step_that_loads_it(redis_url, tiny_model):
    """vLLM's sync-load budget (kv_connector_extra_config.sync_load_budget_bytes): a hit that fits
    it is copied before the forward pass of the step that admits its request, instead of a step
    of its own before it. The tokens stay the dense model's."""
    extra = {"sync_load_budget_bytes": 1 << 30}
    on = await Stack(
        redis_url, tiny_model, kv_offloading_size=TIER_GIB, kv_transfer_config=extra, **SETTINGS
    ).start()
    try:
        tokens = await serve(on)
        scheduler = on.ledger.scheduler
        _, _, again = workload()
        for i, prompt in enumerate(again):
            assert tokens[f"b{i}"] == dense_greedy(tiny_model, prompt, 24), f"b{i}"
        # Every load left a token to compute and fit the budget: none waited a step.
        assert scheduler.num_loads > 0 and scheduler.num_sync_loads == scheduler.num_loads
        assert scheduler.num_loaded_tokens >= 64
        host = on.worker_services["w0"].runner.host_tier
        assert host is not None and host.blocks_loaded * 16 == scheduler.num_loaded_tokens
        assert any(r.final.num_cached_tokens >= 64 for r in on.results.values())
        connector = scheduler.connector
        assert connector is not None and not connector.jobs and not scheduler.holding
        assert on.ledger.manager.num_free_blocks == 23 and not on.ledger.manager.req_to_blocks
    finally:
        await on.stop()
