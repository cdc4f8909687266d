"""kvledger on a real 3-master Redis Cluster (`redis+cluster://`): the client, the services'
tests rerun on the cluster, and two replicas behind the routing gateway end to end over HTTP.

The rerun tests are the single-server tests themselves, called with the cluster's URL, so the
cluster is held to exactly the same assertions."""

from __future__ import annotations

import pytest

from services.tokenization.load import load_tokenizer
from services.transport import redis_client, redis_streams, registry
from services.transport.keys import StreamNames
from services.wire.messages import WorkerHello
from tests.e2e import test_parallel_sampling
from tests.engine import test_fencing, test_ledger_service
from tests.harness.gateway_stack import gateway_on
from tests.harness.stack import Stack, dense_greedy
from tests.indexer import test_indexer
from tests.kvledger import test_bridge
from tests.redis_cluster import RedisClusterServers
from tests.services.events import test_subscriber
from tests.services.transport import test_redis_streams


def _hello(worker_id: str) -> WorkerHello:
    return WorkerHello(
        worker_id=worker_id,
        group="g",
        num_gpu_blocks=8,
        block_size=16,
        bytes_per_block=1,
        available_kv_bytes=8,
        model_name="m",
        max_model_len=64,
        vocab_size=10,
        device="cpu",
        started_at=0.0,
    )


@pytest.fixture(scope="module")
def cluster():
    with RedisClusterServers() as servers:
        yield servers


def test_cluster_urls_are_told_apart_and_read_node_by_node():
    assert redis_client.is_cluster_url("redis+cluster://h:1,g:2")
    assert not redis_client.is_cluster_url("redis://h:1/0")
    plain, seeds = redis_client._cluster_seeds("rediss+cluster://u:pw@h1:7000,h2:7001/")
    assert plain == "rediss://u:pw@h1:7000"
    assert seeds == [("h1", 7000), ("h2", 7001)]
    with pytest.raises(ValueError, match="redis_url: cluster node 'h3' is not host:port"):
        redis_client._cluster_seeds("redis+cluster://h1:7000,h3")


async def test_replicas_spread_over_masters_and_multi_key_commands_stay_in_one_slot(cluster):
    assert cluster.formed_by
    r = redis_streams.connect(cluster.url)
    try:
        names = [StreamNames("kvc", f"r{i}") for i in range(8)]
        masters = {cluster.master_of(n.requests) for n in names}
        assert len(masters) == 3  # eight replicas reach every master
        for n in names:
            keys = [n.requests, n.results, n.events, n.steps("g"), n.outputs("gw"), n.ledger_status]
            assert {cluster.master_of(key) for key in keys} == {cluster.master_of(n.requests)}
        # A group read over two streams of one replica: one XREADGROUP, one slot.
        one = names[0]
        reader = redis_streams.GroupReader(r, [one.requests, one.results], "ledger", "c1")
        await reader.ensure_groups()
        await r.xadd(one.requests, {redis_streams.FIELD: b"a"})
        await r.xadd(one.results, {redis_streams.FIELD: b"b"})
        got = await reader.read(count=10, block_ms=1000)
        assert sorted(entry.fields[redis_streams.FIELD] for entry in got) == [b"a", b"b"]
        # Worker registrations of replicas on different masters: SCAN visits every master.
        for n in names:
            await registry.register(r, n, _hello(f"w-{n.replica}"), ttl_s=30)
        for n in names:
            assert list(await registry.live_workers(r, n, "g")) == [f"w-{n.replica}"]
    finally:
        await r.aclose()


async def test_two_replicas_behind_the_precise_gateway_serve_end_to_end(cluster, tiny_model):
    a = await Stack(cluster.url, tiny_model, num_blocks=64, max_model_len=200, replica="r0").start()
    b = await Stack(
        cluster.url, tiny_model, num_blocks=64, max_model_len=200, prefix=a.prefix, replica="r1"
    ).start()
    assert cluster.master_of(a.streams.requests) != cluster.master_of(b.streams.requests)
    try:
        async with gateway_on(a, replicas="r0,r1", routing="precise") as client:
            prompt = test_ledger_service.prompts(1, 70, seed=5)[0]
            body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
            replies = []
            for _ in range(3):
                response = await client.post("/v1/completions", json=body)
                assert response.status == 200, await response.text()
                replies.append(await response.json())
        expected = dense_greedy(tiny_model, prompt, 6)
        cached = [reply["usage"]["prompt_tokens_details"]["cached_tokens"] for reply in replies]
        # The first lands cold; the repeats go where its blocks are: 4 full blocks before the
        # last token (round robin would have sent the second to the cold replica).
        assert cached == [0, 64, 64]
        for reply in replies:
            assert reply["choices"][0]["finish_reason"] == "length"
            assert reply["usage"]["completion_tokens"] == 6
        text = load_tokenizer("tiny").decode(expected)
        assert [reply["choices"][0]["text"] for reply in replies] == [text] * 3
    finally:
        await a.stop()
        await b.stop()


# The single-server tests, rerun on the cluster.


async def test_transport_on_cluster(cluster):
    await (
        test_redis_streams.test_a_restarted_consumer_rereads_its_pending_entries_once_then_new_ones(
            cluster.url
        )
    )
    await test_redis_streams.test_entries_of_a_dead_consumer_can_be_claimed(cluster.url)
    await test_redis_streams.test_a_dead_letter_keeps_the_entry_and_the_error(cluster.url)


async def test_fenced_bulk_writes_on_cluster(cluster):
    # WATCH, the read of the token counter and MULTI/EXEC of the appends: one slot, one node.
    for successor in (True, False):
        await test_fencing.test_a_bulk_write_is_fenced_when_the_counter_moves_after_its_check(
            cluster.url, successor
        )


async def test_bridge_on_cluster(cluster):
    r = redis_streams.connect(cluster.url)
    publisher = test_bridge.Publisher().start()
    try:
        await test_bridge.test_the_bridge_writes_the_publishers_batches_as_a_ledger_would(
            cluster.url, (r, "bcluster", publisher), byte_hashes=False
        )
    finally:
        publisher.close()
        await r.aclose()


async def test_ledger_service_on_cluster(cluster, tiny_model):
    url = cluster.url
    await test_ledger_service.test_shared_prefix_requests_hit_the_cache_and_match_the_dense_model(
        url, tiny_model
    )
    await test_ledger_service.test_a_worker_lost_mid_run_preempts_its_requests_which_then_complete(
        url, tiny_model
    )
    await test_ledger_service.test_requests_left_pending_by_another_ledger_are_claimed_and_served(
        url, tiny_model
    )
    await test_parallel_sampling.test_n_samples_share_the_prompts_blocks_through_the_prefix_cache(
        url, tiny_model
    )


async def test_subscriber_on_cluster(cluster, tiny_model, tmp_path):
    await test_subscriber.test_snapshot_replay_and_restart_subscribers_agree_with_the_ledger(
        cluster.url, tiny_model, tmp_path
    )


async def test_indexer_on_cluster(cluster, tiny_model, tmp_path):
    await test_indexer.test_score_reports_each_replicas_real_prefix_and_refuses_bad_fields(
        cluster.url, tiny_model, tmp_path
    )
    await test_indexer.test_a_replica_whose_ledger_dies_goes_out_and_health_follows(
        cluster.url, tiny_model
    )
