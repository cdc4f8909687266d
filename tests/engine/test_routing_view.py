"""What the ledger tells routers, over a real redis-server: its measured step costs and the
eviction head in its status, and the admissions that found less than their router expected."""

from __future__ import annotations

from prometheus_client import generate_latest

from ledger.hashing import BlockHasher, to_event_hash
from services.wire import codec
from services.wire.messages import EvictionHead, LedgerStatus
from tests.engine.test_ledger_service import prompts
from tests.harness.stack import Stack


def metric(stack: Stack, name: str) -> float:
    for line in generate_latest(stack.ledger.metrics.registry).decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} on the ledger's /metrics")


async def test_the_ledger_publishes_its_measured_costs_and_the_blocks_it_evicts_next(
    redis_url, tiny_model
):
    stack = await Stack(redis_url, tiny_model, num_blocks=64).start()
    try:
        # One after another: four prefill steps of 10 to 180 tokens, decode steps between.
        batch = [prompts(1, n, seed=21 + n)[0] for n in (10, 60, 120, 180)]
        for i, prompt in enumerate(batch):
            await stack.submit(f"r{i}", prompt, 6)
            await stack.wait([f"r{i}"])
        await stack.ledger._write_status()
        status = codec.decode(await stack.r.get(stack.streams.ledger_status), LedgerStatus)
        costs = status.costs
        assert costs is not None and costs.steps >= 4 * 5
        assert costs.prefill_tokens_per_s > 0  # measured from this CPU's steps
        assert costs.queued_prefill_tokens == 0  # idle: nothing queued
        assert costs.max_num_batched_tokens == stack.ledger_cfg.max_num_batched_tokens
        # Every cached block is free now: the head lists them in the order they would go. It
        # has its own key, written a few times a second from the engine loop.
        stack.ledger._eviction_written = -1e9
        await stack.ledger._write_eviction_head()
        eviction = codec.decode(await stack.r.get(stack.streams.ledger_eviction), EvictionHead)
        assert eviction.epoch == status.epoch and eviction.queued_prefill_tokens == 0
        pool = stack.ledger.manager.block_pool
        assert (eviction.positions, eviction.hashes, eviction.horizon) == pool.eviction_head(
            eviction.horizon
        )
        hasher = BlockHasher("sha256")
        prompt_blocks = {to_event_hash(h) for p in batch for h in hasher.hash_blocks(p, 16)}
        cached = {to_event_hash(h) for h in pool.cached_hashes()}
        assert set(eviction.hashes) == cached and prompt_blocks <= cached
        assert len(prompt_blocks) == 3 + 7 + 11
    finally:
        await stack.stop()


async def test_admissions_below_the_routers_expectation_are_counted(redis_url, tiny_model):
    stack = await Stack(redis_url, tiny_model, num_blocks=64).start()
    try:
        first, fresh = prompts(2, 40, seed=22)
        await stack.submit("a", first, 2)
        await stack.wait(["a"])
        # As expected: 32 of b's tokens are cached (a's two full blocks).
        await stack.submit("b", first + [50, 51], 2, expected_cached_tokens=32)
        # Expected 32 and none is there: one shortfall of 32 tokens.
        await stack.submit("c", fresh, 2, expected_cached_tokens=32)
        # Not routed: nothing to compare.
        await stack.submit("d", fresh[:20] + [60] * 20, 2)
        results = await stack.wait(["b", "c", "d"])
        assert results["b"].final.num_cached_tokens == 32
        assert metric(stack, "kvledger:routed_expected_hit_tokens_total") == 64
        assert metric(stack, "kvledger:routed_hit_shortfall_requests_total") == 1
        assert metric(stack, "kvledger:routed_hit_shortfall_tokens_total") == 32
    finally:
        await stack.stop()
