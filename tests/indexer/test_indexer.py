"""`kvledger indexer` over two real replicas (ledger + worker each, one redis-server): /score
reports the prefix each ledger really holds, refuses bad fields by name, survives a poison event
entry, resumes from its checkpoints, and marks a replica whose ledger died as out."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp.test_utils import TestClient, TestServer

from indexer import create_app
from indexer.app import REPLICAS
from ledger.hashing import BlockHasher, to_event_hash
from ledger.offloading.base import offload_key_block_hash
from services.config import IndexerConfig, SharedTierSpec
from services.tokenization.load import load_tokenizer
from tests.engine.test_cpu_tier import SETTINGS as TIER_SETTINGS
from tests.engine.test_cpu_tier import TIER_GIB
from tests.engine.test_cpu_tier import workload as tier_workload
from tests.engine.test_ledger_service import prompts
from tests.harness.stack import Stack


def ledger_hit_blocks(stack: Stack, prompt: list[int], cache_salt: str | None = None) -> int:
    """The ledger's own answer: leading routable blocks of the prompt in its prefix cache."""
    assert stack.ledger is not None
    pool = stack.ledger.manager.block_pool
    routable = prompt[: (len(prompt) - 1) // 16 * 16]
    hits = 0
    for block_hash in BlockHasher("sha256").hash_blocks(routable, 16, cache_salt=cache_salt):
        if pool.get_cached_block(block_hash) is None:
            break
        hits += 1
    return hits


@contextlib.asynccontextmanager
async def indexer_on(url: str, **settings) -> AsyncIterator[TestClient]:
    config = IndexerConfig(redis_url=url, **{"model": "tiny", **settings})
    client = TestClient(TestServer(create_app(config)))
    await client.start_server()
    try:
        await client.app[REPLICAS].wait_caught_up()
        yield client
    finally:
        await client.close()


async def scores(client: TestClient, body: dict) -> dict:
    await client.app[REPLICAS].wait_caught_up()
    response = await client.post("/score", json=body)
    assert response.status == 200, await response.text()
    return await response.json()


async def test_score_reports_each_replicas_real_prefix_and_refuses_bad_fields(
    redis_url, tiny_model, tmp_path
):
    # Two replicas under one key prefix, told apart by the hash tag in their keys.
    a = await Stack(redis_url, tiny_model, num_blocks=64, max_model_len=200, replica="a").start()
    b = await Stack(
        redis_url, tiny_model, num_blocks=64, max_model_len=200, prefix=a.prefix, replica="b"
    ).start()
    try:
        long_prompt = prompts(1, 90, seed=41)[0]
        text = "You are a careful assistant. " * 3 + "Say hello."
        text_ids = load_tokenizer("tiny").encode(text, add_special_tokens=True)
        await a.submit("long", long_prompt, 4)
        await b.submit("text", text_ids, 4)
        await a.wait(["long"], timeout=120)
        await b.wait(["text"], timeout=120)
        assert a.streams.events == f"{a.prefix}:{{a}}:kv-events"
        assert b.streams.requests == f"{a.prefix}:{{b}}:requests"
        replicas = {"stream_prefix": a.prefix, "replicas": "a,b"}

        async with indexer_on(redis_url, **replicas, checkpoint_dir=str(tmp_path)) as client:
            got = await scores(client, {"prompt_token_ids": long_prompt})
            assert got["num_tokens"] == 90
            a_score = got["replicas"]["a"]
            assert {k: a_score[k] for k in ("cached_blocks", "cached_tokens", "block_size")} == {
                "cached_blocks": ledger_hit_blocks(a, long_prompt),
                "cached_tokens": 16 * ledger_hit_blocks(a, long_prompt),
                "block_size": 16,
            }
            assert a_score["health"] == "live" and a_score["pending_requests"] == 0
            # What a router should expect at admission: all of it (nothing queued to evict it),
            # and the cost (seconds) lower than on b, which must prefill the whole prompt.
            assert a_score["expected_cached_tokens"] == 80 and a_score["evicted_blocks"] == 0
            assert got["cost_unit"] == "s"
            assert a_score["cost"] < got["replicas"]["b"]["cost"]
            assert got["replicas"]["a"]["cached_blocks"] == 5  # (90 - 1) // 16 blocks
            assert got["replicas"]["b"]["cached_blocks"] == 0
            assert got["best"] == "a"

            by_text = await scores(client, {"prompt": text})
            assert by_text["num_tokens"] == len(text_ids)
            assert by_text["replicas"]["b"]["cached_blocks"] == ledger_hit_blocks(b, text_ids) > 0
            assert by_text["replicas"]["a"]["cached_blocks"] == 0
            assert by_text["best"] == "b"

            salted = await scores(client, {"prompt_token_ids": long_prompt, "cache_salt": "t1"})
            assert salted["replicas"]["a"]["cached_blocks"] == 0  # another tenant's cache
            # Nothing cached anywhere: no best (a router following it would send every new
            # prompt to the same replica); the costs are there to balance by.
            assert salted["best"] is None
            assert all(r["cost"] > 0 for r in salted["replicas"].values())

            for body, field in (
                ({"prompt_token_ids": [1, "x"]}, "prompt_token_ids[1]"),
                ({"prompt_token_ids": []}, "prompt_token_ids"),
                ({"prompt": 7}, "prompt"),
                ({"prompt": "hi", "prompt_token_ids": [1]}, "prompt"),
                ({}, "prompt"),
                ({"prompt": "hi", "cache_salt": 3}, "cache_salt"),
                ({"prompt": "hi", "model": "x"}, "model"),
                ([1, 2], "body"),
            ):
                response = await client.post("/score", json=body)
                assert response.status == 400, body
                error = (await response.json())["error"]
                assert error["message"].startswith(f"{field}:"), (body, error)
                # The gateway's shape: the field in `param`, the status in `code`.
                assert error["param"] == (None if field == "body" else field), error
                assert (error["code"], error["type"]) == (400, "invalid_request_error")
            response = await client.post("/score", data=b"{not json")
            assert response.status == 400
            error = (await response.json())["error"]
            assert error["message"].startswith("body:") and error["code"] == 400

            # A poison entry in a ledger's events stream is stepped over; later events count.
            await a.r.xadd(a.streams.events, {b"batch": b"\xc1not msgpack"})
            await a.r.xadd(a.streams.events, {b"other": b"x"})
            await a.submit("more", prompts(1, 70, seed=42)[0], 4)
            await a.wait(["more"], timeout=120)
            more = await scores(client, {"prompt_token_ids": prompts(1, 70, seed=42)[0]})
            assert more["replicas"]["a"]["cached_blocks"] == 4
            health = await client.get("/health")
            assert health.status == 200
            report = (await health.json())["replicas"]
            assert report["a"]["entries_skipped"] == 2 and report["a"]["health"] == "live"
            assert report["a"]["bootstraps"] == 1

        # Restarted with the same checkpoints: resumed, not rebuilt, with the same answer.
        async with indexer_on(redis_url, **replicas, checkpoint_dir=str(tmp_path)) as client:
            again = await scores(client, {"prompt_token_ids": long_prompt})
            assert again["replicas"]["a"]["cached_blocks"] == 5
            report = (await (await client.get("/health")).json())["replicas"]
            assert report["a"]["bootstraps"] == 0 and report["b"]["bootstraps"] == 0
    finally:
        await a.stop()
        await b.stop()


async def test_a_replica_whose_ledger_dies_goes_out_and_health_follows(redis_url, tiny_model):
    a = await Stack(redis_url, tiny_model, num_blocks=32, max_model_len=160, replica="a").start()
    try:
        async with indexer_on(
            redis_url,
            stream_prefix=a.prefix,
            replicas="a,ghost",
            stale_after_s=1.5,
            out_after_s=3.0,
        ) as client:
            first = await client.get("/health")
            assert first.status == 200
            report = (await first.json())["replicas"]
            assert report["a"]["health"] == "live"
            assert report["ghost"]["health"] == "out" and report["ghost"]["ledger"] is False
            got = await scores(client, {"prompt_token_ids": [1] * 40})
            ghost = got["replicas"]["ghost"]
            assert {k: ghost[k] for k in ("cached_blocks", "cached_tokens", "block_size")} == {
                "cached_blocks": 0,
                "cached_tokens": 0,
                "block_size": None,
            }
            assert ghost["health"] == "out"

            ledger = a.tasks[0]  # the ledger stops: its status is written no more
            ledger.cancel()
            await asyncio.gather(ledger, return_exceptions=True)
            seen = []
            for _ in range(200):
                response = await client.get("/health")
                state = (await response.json())["replicas"]["a"]["health"]
                if not seen or seen[-1] != state:
                    seen.append(state)
                if state == "out":
                    break
                await asyncio.sleep(0.05)
            assert seen == ["live", "stale", "out"] and response.status == 503
            got = await scores(client, {"prompt_token_ids": [1] * 40})
            assert got["best"] is None
    finally:
        await a.stop()


def ledger_tier_blocks(stack: Stack, prompt: list[int]) -> tuple[int, int]:
    """The ledger's own books: the prompt's leading routable blocks in its prefix cache, then
    those in a row its CPU tier holds (the connector's ready keys)."""
    connector = stack.ledger.scheduler.connector
    assert connector is not None
    held = {to_event_hash(offload_key_block_hash(k)) for k in connector.manager.ready_keys()}
    gpu = ledger_hit_blocks(stack, prompt)
    routable = prompt[: (len(prompt) - 1) // 16 * 16]
    hashes = [to_event_hash(h) for h in BlockHasher("sha256").hash_blocks(routable, 16)]
    cpu = 0
    while gpu + cpu < len(hashes) and hashes[gpu + cpu] in held:
        cpu += 1
    return gpu, cpu


async def test_score_counts_each_replicas_blocks_per_tier_from_its_cpu_tiers_real_events(
    redis_url, tiny_model, tmp_path
):
    """Replica a has a CPU tier and a GPU pool too small for its documents: after fillers push
    them off the GPU, /score finds them in its CPU tier (its KV events of medium CPU), as its
    ledger's books say, and prefers a to b, which would prefill them; a restarted indexer
    resumes the CPU tier's index from its checkpoint."""
    a = await Stack(
        redis_url, tiny_model, kv_offloading_size=TIER_GIB, replica="a", **TIER_SETTINGS
    ).start()
    b = await Stack(redis_url, tiny_model, prefix=a.prefix, replica="b", **TIER_SETTINGS).start()
    try:
        first, fillers, _ = tier_workload()
        for phase, batch in (("a", first), ("f", fillers)):
            for i, prompt in enumerate(batch):
                await a.submit(f"{phase}{i}", prompt, 4)
            await a.wait([f"{phase}{i}" for i in range(len(batch))], timeout=120)
        replicas = {"stream_prefix": a.prefix, "replicas": "a,b"}
        for restart in range(2):
            async with indexer_on(redis_url, **replicas, checkpoint_dir=str(tmp_path)) as client:
                loaded = 0
                for prompt in first:
                    got = await scores(client, {"prompt_token_ids": prompt})
                    on_a, on_b = got["replicas"]["a"], got["replicas"]["b"]
                    gpu, cpu = ledger_tier_blocks(a, prompt)
                    assert (on_a["gpu_blocks"], on_a["cpu_blocks"], on_a["shared_blocks"]) == (
                        gpu, cpu, 0,
                    )  # fmt: skip
                    assert on_a["cpu_tokens"] == 16 * cpu and on_a["gpu_tokens"] == 16 * gpu
                    assert on_a["cached_blocks"] == gpu  # today's field: the GPU's
                    assert on_a["expected_cached_tokens"] == 16 * (gpu + cpu)
                    assert (on_b["gpu_blocks"], on_b["cpu_blocks"]) == (0, 0)
                    assert on_b["tier_cost"] == 0 and (on_a["tier_cost"] > 0) == (cpu > 0)
                    assert gpu + cpu == 4 and got["best"] == "a"
                    loaded += cpu
                assert loaded > 0  # the fillers pushed some document off the GPU
                # Cached nowhere, on no tier: no best.
                fresh = await scores(client, {"prompt_token_ids": prompts(1, 72, seed=99)[0]})
                assert fresh["best"] is None
                assert all(r["cpu_blocks"] == 0 for r in fresh["replicas"].values())
                report = (await (await client.get("/health")).json())["replicas"]
                assert report["a"]["cpu_hashes"] == len(
                    a.ledger.scheduler.connector.manager.ready_keys()  # type: ignore[union-attr]
                )
                assert report["a"]["bootstraps"] == (1 - restart)  # then resumed
    finally:
        await a.stop()
        await b.stop()


async def test_score_finds_another_replicas_blocks_in_the_shared_tier(
    redis_url, tiny_model, tmp_path
):
    """Replicas a and b behind one shared tier: what a computed, /score finds on b too (loads
    from the shared tier, priced), following the catalog b's status names; a prompt that no
    replica computed is in no tier."""
    spec = SharedTierSpec("dir", path=str(tmp_path / "kv"))
    shared = {"kv_offloading_size": TIER_GIB, "kv_shared_tier": spec, **TIER_SETTINGS}
    a = await Stack(redis_url, tiny_model, replica="a", **shared).start()
    b = await Stack(redis_url, tiny_model, prefix=a.prefix, replica="b", **shared).start()
    try:
        docs = [p + t for p, t in zip(prompts(2, 64, seed=31), prompts(2, 8, seed=32), strict=True)]
        for i, prompt in enumerate(docs):
            await a.submit(f"a{i}", prompt, 4)
        await a.wait(["a0", "a1"], timeout=60)
        manager = a.ledger.scheduler.connector.manager  # the TieringManager
        for _ in range(200):
            if manager.stats.cascades == 8:
                break
            await asyncio.sleep(0.05)
        async with indexer_on(redis_url, stream_prefix=a.prefix, replicas="a,b") as client:
            for _ in range(100):  # the catalog is followed once a status names it
                got = await scores(client, {"prompt_token_ids": docs[0]})
                if got["replicas"]["b"]["shared_blocks"] == 4:
                    break
                await asyncio.sleep(0.1)
            on_a, on_b = got["replicas"]["a"], got["replicas"]["b"]
            assert (on_b["gpu_blocks"], on_b["cpu_blocks"], on_b["shared_blocks"]) == (0, 0, 4)
            assert on_b["shared_tokens"] == 64 and on_b["tier_cost"] > 0
            assert on_b["expected_cached_tokens"] == 64  # loads count as cached, as vLLM's
            assert on_a["gpu_blocks"] + on_a["cpu_blocks"] + on_a["shared_blocks"] == 4
            fresh = await scores(client, {"prompt_token_ids": prompts(1, 72, seed=99)[0]})
            assert all(r["shared_blocks"] == 0 for r in fresh["replicas"].values())
            assert fresh["best"] is None
    finally:
        await b.stop()
        await a.stop()
