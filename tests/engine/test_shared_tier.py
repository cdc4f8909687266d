"""The shared tier end to end: two replicas (each a ledger and a worker over one real
redis-server) behind --kv-shared-tier, the directory and the Redis backends. Blocks replica A
computed reach the tier through A's CPU tier (a cascade); replica B, which never saw the
prompts, promotes them into its CPU tier and loads them instead of computing them, and its
greedy tokens are the dense model's. A corrupt, truncated or missing block is recomputed,
never loaded, and leaves the catalog."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import msgpack
import pytest

from gpu_worker.checkpoint import load_model
from ledger.events import MEDIUM_STORAGE
from ledger.hashing import to_event_hash
from services.config import SharedTierSpec
from services.tiers.blocks import block_path, unpack_block
from services.transport.keys import SharedTierKeys
from services.transport.redis_server import RedisServer
from tests.engine.test_cpu_tier import serve as serve_cpu_workload
from tests.engine.test_ledger_service import prompts
from tests.engine.test_ledger_traces import Traced
from tests.gpu_worker.checkpoints import ARCHITECTURES, make_tiny_checkpoint
from tests.harness.spans import named
from tests.harness.stack import Stack, dense_greedy

TIER_GIB = 1 / 1024  # 32 blocks of the tiny Llama
BLOCK_BYTES = 32 * 1024  # 4 layers, K and V, 16 tokens of one 64-wide head, float32
SETTINGS = {"num_blocks": 24, "max_model_len": 112, "max_num_batched_tokens": 256}


def documents() -> list[list[int]]:
    return [
        doc + tail
        for doc, tail in zip(prompts(3, 64, seed=21), prompts(3, 8, seed=22), strict=True)
    ]


async def serve(stack: Stack, batch: list[list[int]], tag: str, max_tokens: int = 8) -> None:
    for i, prompt in enumerate(batch):
        await stack.submit(f"{tag}{i}", prompt, max_tokens)
    await stack.wait([f"{tag}{i}" for i in range(len(batch))], timeout=120)


async def until(condition, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def storage_events(stack: Stack) -> list[dict]:
    return [
        event
        for _, fields in await stack.r.xrange(stack.streams.events)
        for event in msgpack.unpackb(fields[b"batch"])[1]
        if event.get("medium") == MEDIUM_STORAGE
    ]


def spec_of(kind: str, tmp_path: Path) -> SharedTierSpec:
    return (
        SharedTierSpec("dir", path=str(tmp_path / "kv"))
        if kind == "dir"
        else SharedTierSpec("redis")
    )


async def two_replicas(redis_url: str, tiny_model, spec: SharedTierSpec) -> tuple[Stack, Stack]:
    prefix = f"t{uuid.uuid4().hex[:8]}"  # one catalog: the replicas share the key prefix
    stacks = []
    for name in ("ra", "rb"):
        stacks.append(
            await Stack(
                redis_url, tiny_model, prefix=prefix, replica=name, kv_offloading_size=TIER_GIB,
                kv_shared_tier=spec, **SETTINGS,
            ).start()
        )  # fmt: skip
    return stacks[0], stacks[1]


def metric(stack: Stack, name: str, **extra: str) -> float | None:
    labels = {"model_name": "kvledger-tiny-llama", "engine": "0", **extra}
    return stack.ledger.metrics.registry.get_sample_value(name, labels)


@pytest.mark.parametrize("kind", ["dir", "redis"])
async def test_a_block_computed_on_one_replica_is_loaded_by_another(
    redis_url, tiny_model, tmp_path, kind
):
    a, b = await two_replicas(redis_url, tiny_model, spec_of(kind, tmp_path))
    try:
        docs = documents()
        await serve(a, docs, "a")
        shared_a = a.ledger.scheduler.connector.manager  # the TieringManager
        # 3 prompts of 72 tokens: 4 full blocks each went GPU -> CPU -> shared.
        await until(lambda: shared_a.stats.cascades == 12)
        assert a.ledger.shared.namespace == b.ledger.shared.namespace
        shared_b = b.ledger.scheduler.connector.manager
        await until(lambda: len(shared_b.index) == 12)  # B follows the catalog
        computed_before = b.ledger.scheduler.num_prompt_tokens_computed
        await serve(b, docs, "b")
        scheduler = b.ledger.scheduler
        assert shared_b.stats.promotions == 12 and shared_b.stats.promotion_failures == 0
        assert scheduler.num_loaded_tokens == 3 * 64
        # Only each prompt's last 8 tokens were computed on B: the rest came from A's work.
        assert scheduler.num_prompt_tokens_computed - computed_before == 3 * 8
        for i, prompt in enumerate(docs):
            assert b.results[f"b{i}"].tokens == dense_greedy(tiny_model, prompt, 8), f"b{i}"
            assert b.results[f"b{i}"].final.num_cached_tokens == 64
        # A published its cascades as BlockStored with vLLM's STORAGE medium and the locality.
        stored = await storage_events(a)
        assert len(stored) == 12
        assert all(e["type"] == "BlockStored" and e["locality"] == "REMOTE" for e in stored)
        assert (await storage_events(b)) == []  # B wrote nothing to the tier
        catalog = SharedTierKeys(a.prefix, a.ledger.shared.namespace)
        assert await a.r.zcard(catalog.index) == 12
        # On /metrics: B's promotions, A's cascades, the catalog's size.
        await until(lambda: metric(b, "kvledger:shared_tier_promoted_blocks_total") == 12)
        await until(lambda: metric(a, "kvledger:shared_tier_cascaded_blocks_total") == 12)
        await until(lambda: metric(a, "kvledger:shared_tier_size", unit="blocks") == 12)
        assert metric(b, "kvledger:shared_tier_promotion_failures_total") == 0
        # vLLM's tiering names: the bytes moved, and the time the workers' copies took.
        tier = {"tier": "shared"}
        assert metric(b, "vllm:kv_offload_tiering_read_bytes_total", **tier) == 12 * BLOCK_BYTES
        assert metric(a, "vllm:kv_offload_tiering_write_bytes_total", **tier) == 12 * BLOCK_BYTES
        assert metric(b, "vllm:kv_offload_tiering_read_time_total", **tier) > 0
        assert metric(a, "vllm:kv_offload_tiering_write_time_total", **tier) > 0
        # Every GPU block ends free on both replicas.
        for stack in (a, b):
            await until(lambda s=stack: s.ledger.manager.block_pool.get_num_free_blocks() == 23)
    finally:
        await b.stop()
        await a.stop()


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "missing"])
async def test_a_bad_block_is_recomputed_never_loaded(redis_url, tiny_model, tmp_path, damage):
    spec = spec_of("dir", tmp_path)
    a, b = await two_replicas(redis_url, tiny_model, spec)
    try:
        docs = documents()[:1]
        await serve(a, docs, "a")
        shared_a = a.ledger.scheduler.connector.manager
        await until(lambda: shared_a.stats.cascades == 4)
        namespace = a.ledger.shared.namespace
        keys = sorted(shared_a.index.keys)
        victim = block_path(spec.path, namespace, keys[0], 0)
        data = victim.read_bytes()
        if damage == "corrupt":
            victim.write_bytes(data[:-10] + bytes(10 * [0xFF]))
        elif damage == "truncated":
            victim.write_bytes(data[: len(data) // 2])
        else:
            victim.unlink()
        shared_b = b.ledger.scheduler.connector.manager
        await until(lambda: len(shared_b.index) == 4)
        await serve(b, docs, "b")
        assert shared_b.stats.promotion_failures == 1
        assert b.results["b0"].tokens == dense_greedy(tiny_model, docs[0], 8)
        # B announced the bad block gone, recomputed it, and wrote it to the tier again.
        removed = [e for e in await storage_events(b) if e["type"] == "BlockRemoved"]
        assert [e["block_hashes"] for e in removed] == [[to_event_hash(keys[0][:-4])]]
        await until(lambda: shared_b.stats.cascades >= 1)
        assert keys[0] in shared_b.index
        unpack_block(victim.read_bytes(), namespace, keys[0], 0, 1, BLOCK_BYTES)  # whole again
    finally:
        await b.stop()
        await a.stop()


async def test_the_size_bound_evicts_the_oldest_blocks_and_their_values(redis_url, tiny_model):
    spec = SharedTierSpec("redis")
    prefix = f"t{uuid.uuid4().hex[:8]}"
    # Room for 6 blocks (32 KiB each and a header): the second document's blocks evict the first's.
    stack = await Stack(
        redis_url, tiny_model, prefix=prefix, replica="ra", kv_offloading_size=TIER_GIB,
        kv_shared_tier=spec, kv_shared_tier_size=6 * 33_000, **SETTINGS,
    ).start()  # fmt: skip
    try:
        docs = documents()[:2]
        await serve(stack, docs[:1], "a")
        manager = stack.ledger.scheduler.connector.manager
        await until(lambda: manager.stats.cascades == 4)
        first = sorted(manager.index.keys)
        await serve(stack, docs[1:], "b")
        await until(lambda: manager.stats.cascades == 8)
        await until(lambda: manager.stats.evictions >= 2)
        namespace = stack.ledger.shared.namespace
        catalog = SharedTierKeys(prefix, namespace)
        assert await stack.r.zcard(catalog.index) <= 6
        evicted = [k for k in first if await stack.r.zscore(catalog.index, k) is None]
        assert len(evicted) >= 2
        for key in evicted:  # the values went with them
            assert not await stack.r.exists(SharedTierKeys(prefix, namespace).data(key, 0))
        removed = [e for e in await storage_events(stack) if e["type"] == "BlockRemoved"]
        assert sum(len(e["block_hashes"]) for e in removed) == manager.stats.evictions
    finally:
        await stack.stop()


async def test_the_tier_unreachable_means_recompute_never_a_failed_request(
    redis_url, tiny_model, tmp_path
):
    """The Redis backend on a server of its own: stopped, every request still ends with the
    dense model's tokens (loads and writes fail, blocks are recomputed); restarted empty, the
    replicas follow its empty catalog and fill it again."""
    tier = RedisServer().start()
    try:
        a, b = await two_replicas(
            redis_url, tiny_model, SharedTierSpec("redis", redis_url=tier.url)
        )
        try:
            docs = documents()
            await serve(a, docs[:2], "a")
            shared_a, shared_b = (s.ledger.scheduler.connector.manager for s in (a, b))
            await until(lambda: len(shared_b.index) == 8)
            tier.stop()
            await serve(b, docs[:2], "b")  # B's index lists them: every promotion fails
            await serve(a, docs[2:], "c")  # A's cascades cannot be written
            for stack, tag, batch in ((b, "b", docs[:2]), (a, "c", docs[2:])):
                for i, prompt in enumerate(batch):
                    assert stack.results[f"{tag}{i}"].tokens == dense_greedy(tiny_model, prompt, 8)
            # Not the blocks' fault: the catalog keeps them, and each ledger leaves the store
            # alone for a while after its first failed copy.
            assert shared_b.stats.promotions == 0 and shared_b.stats.promotion_failures == 0
            assert shared_b.stats.unreachable >= 1 and len(shared_b.index) == 8
            # A's cascades run in a step after its stores are reported, maybe after the answers.
            await until(lambda: shared_a.stats.cascade_failures >= 1)
            assert shared_a.stats.unreachable == shared_a.stats.cascade_failures
            await until(
                lambda: (metric(b, "kvledger:shared_tier_unreachable_blocks_total") or 0) >= 1
            )
            tier.start()  # the same port, empty: the followers read its empty index (and the
            # ledgers, paused since their copies failed, use the tier again)
            await until(lambda: len(shared_a.index) == 0 and len(shared_b.index) == 0)
            await serve(a, [prompts(1, 64, seed=23)[0]], "d")
            await until(lambda: len(shared_b.index) == 4)
        finally:
            await b.stop()
            await a.stop()
    finally:
        tier.stop()


async def test_a_directory_that_cannot_be_written_means_recompute(redis_url, tiny_model, tmp_path):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the tier's directory should be")
    a, b = await two_replicas(redis_url, tiny_model, SharedTierSpec("dir", path=str(blocked)))
    try:
        docs = documents()
        await serve(a, docs, "a")
        await serve(b, docs, "b")
        shared_a = a.ledger.scheduler.connector.manager
        await until(lambda: shared_a.stats.unreachable >= 1)
        assert len(shared_a.index) == 0  # nothing written, nothing listed
        assert shared_a.stats.cascade_failures == shared_a.stats.unreachable
        for i, prompt in enumerate(docs):
            assert b.results[f"b{i}"].tokens == dense_greedy(tiny_model, prompt, 8)
    finally:
        await b.stop()
        await a.stop()


async def test_a_worker_lost_mid_run_leaves_no_block_listed_that_is_not_there(
    redis_url, tiny_model, tmp_path
):
    spec = spec_of("dir", tmp_path)
    a, b = await two_replicas(redis_url, tiny_model, spec)
    try:
        docs = documents() + [
            p + t for p, t in zip(prompts(3, 64, seed=24), prompts(3, 8, seed=25), strict=True)
        ]
        for i, prompt in enumerate(docs):
            await a.submit(f"a{i}", prompt, 8)
        shared_a = a.ledger.scheduler.connector.manager
        await until(lambda: shared_a.stats.cascades > 0)
        await a.kill_worker("w0")  # mid-run: steps with copies in flight die with it
        await a.start_worker("w1")
        await a.wait([f"a{i}" for i in range(len(docs))], timeout=120)
        for i, prompt in enumerate(docs):
            assert a.results[f"a{i}"].tokens == dense_greedy(tiny_model, prompt, 8)
        await until(lambda: not shared_a.has_pending_work())
        # Every block the catalog lists is on disk, whole, under its key.
        namespace = a.ledger.shared.namespace
        listed = await a.r.zrange(SharedTierKeys(a.prefix, namespace).index, 0, -1)
        assert listed
        for key in listed:
            unpack_block(
                block_path(spec.path, namespace, key, 0).read_bytes(),
                namespace,
                key,
                0,
                1,
                BLOCK_BYTES,
            )
        # ...and B loads them all.
        shared_b = b.ledger.scheduler.connector.manager
        await until(lambda: len(shared_b.index) == len(listed))
        await serve(b, docs, "b")
        assert shared_b.stats.promotion_failures == 0
        for i, prompt in enumerate(docs):
            assert b.results[f"b{i}"].tokens == dense_greedy(tiny_model, prompt, 8)
    finally:
        await b.stop()
        await a.stop()


async def test_a_requests_trace_says_what_it_loaded_from_which_tier_and_what_it_recomputed(
    redis_url, tiny_model, tmp_path
):
    spec = spec_of("dir", tmp_path)
    prefix = f"t{uuid.uuid4().hex[:8]}"
    a = await Stack(
        redis_url, tiny_model, prefix=prefix, replica="ra", kv_offloading_size=TIER_GIB,
        kv_shared_tier=spec, **SETTINGS,
    ).start()  # fmt: skip
    traced = Traced(
        redis_url, tiny_model, prefix=prefix, replica="rb", kv_offloading_size=TIER_GIB,
        kv_shared_tier=spec, **SETTINGS,
    )  # fmt: skip
    b = await traced.stack.start()
    try:
        doc = documents()[0]
        await serve(a, [doc], "a")
        await until(lambda: len(b.ledger.scheduler.connector.manager.index) == 4)
        await traced.submit("b0", doc, 8)
        await b.wait(["b0"], timeout=60)
    finally:
        await b.stop()
        await a.stop()
    (admit,) = named(traced.traces()["b0"], "kvledger.admit")
    attributes = admit["attributes"]
    assert attributes["kvledger.loaded.tokens"] == 64
    assert attributes["kvledger.loaded.shared_blocks"] == 4
    assert attributes["kvledger.loaded.bytes"] == 4 * BLOCK_BYTES
    assert attributes["kvledger.recomputed.tokens"] == 8
    assert attributes["kvledger.prefix_hit.tokens"] == 0  # B's GPU had none of it
    assert attributes["kvledger.loaded.from_replicas"] == ["ra"]  # A computed it
    assert 0 < attributes["kvledger.loaded.wait_s"] < 30  # promotion, then the CPU load


@pytest.mark.parametrize("arch", ARCHITECTURES)
async def test_tiers_change_no_greedy_token_of_llama_mistral_or_qwen2(redis_url, tmp_path, arch):
    """Through preemption and loads of blocks evicted mid-flight (tests/engine/test_cpu_tier.py's
    workload), on one replica with both tiers and on a second that finds the first's blocks in
    the shared tier: the tokens of the run without tiers, for each architecture."""
    model = load_model(make_tiny_checkpoint(tmp_path, arch), dtype="float32")
    off = await Stack(redis_url, model, **SETTINGS).start()
    try:
        tokens_off = await serve_cpu_workload(off)
    finally:
        await off.stop()
    a, b = await two_replicas(redis_url, model, spec_of("dir", tmp_path))
    try:
        assert await serve_cpu_workload(a) == tokens_off
        manager_b = b.ledger.scheduler.connector.manager
        await until(lambda: len(manager_b.index) >= 8)
        assert await serve_cpu_workload(b) == tokens_off
        assert manager_b.stats.promotions > 0 and b.ledger.scheduler.num_preemptions > 0
    finally:
        await b.stop()
        await a.stop()


async def test_a_fence_left_by_a_token_counter_that_restarted_is_lowered_not_obeyed(
    redis_url, tiny_model
):
    """The tier's catalog keeps each replica's highest leader token. A replica whose token
        counter restarted (its Redis lost its data, the tier's kept) draws tokens below it: refused
        as if deposed, it would never write the tier again. The leader whose token is the latest its
        replica drew lowers the fence and writes (a leader that a later token deposed is still refused:
    tests/services/tiers/test_catalog.py)."""
    a = await Stack(
        redis_url, tiny_model, replica="ra", kv_offloading_size=TIER_GIB,
        kv_shared_tier=SharedTierSpec("redis"), **SETTINGS,
    ).start()  # fmt: skip
    try:
        ledger = a.ledger
        catalog = SharedTierKeys(a.prefix, ledger.shared.namespace)
        await a.r.hset(catalog.fence, "ra", 99)  # from the counter's earlier life
        await serve(a, documents(), "a")
        await until(lambda: len(ledger.shared.manager.index) == 12)
        assert await a.r.zcard(catalog.index) == 12 and not ledger.shared.fenced
        token = ledger.leadership.token
        assert int(await a.r.hget(catalog.fence, "ra")) == token < 99
    finally:
        await a.stop()
