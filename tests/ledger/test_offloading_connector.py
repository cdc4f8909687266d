"""When the CPU tier stores and loads (ledger.offloading.connector), on small cases.

The step-by-step equality with vLLM 0.33's OffloadingConnectorScheduler is in
tests/oracle/test_offload_connector_differential.py; these pin what a reader should expect.
"""

from __future__ import annotations

from ledger.block import KVCacheBlock
from ledger.hashing import BlockHasher
from ledger.offloading.base import make_offload_key
from ledger.offloading.connector import OffloadingConnectorScheduler
from ledger.offloading.manager import CPUOffloadingManager
from ledger.request import Request, RequestStatus
from ledger.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

BS = 4
HASHER = BlockHasher("sha256", seed="test")


def make(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, 8, block_size=BS, block_hasher=HASHER)


def tier(num_chunks: int = 8) -> OffloadingConnectorScheduler:
    return OffloadingConnectorScheduler(CPUOffloadingManager(num_chunks, enable_events=True), BS)


def blocks(*ids: int, cached: int = 0) -> list[KVCacheBlock]:
    table = [KVCacheBlock(i) for i in ids]
    for block in table[:cached]:
        block.block_hash = b"cached"
    return table


def step(
    conn: OffloadingConnectorScheduler,
    new: tuple[tuple[Request, list[int], int], ...] = (),
    running: tuple[tuple[Request, list[int], int], ...] = (),
    finished: tuple[str, ...] = (),
):
    """One step's end: new requests with their whole block table, running ones with the blocks
    added this step, each with its scheduled tokens."""
    output: SchedulerOutput = SchedulerOutput(
        step_id=0,
        scheduled_new_reqs=[NewRequestData(r, [], ids, r.num_computed_tokens) for r, ids, _ in new],
        scheduled_cached_reqs=[
            CachedRequestData(r, (), tuple(ids), r.num_computed_tokens) for r, ids, _ in running
        ],
        num_scheduled_tokens={r.request_id: n for r, _, n in (*new, *running)},
        finished_req_ids=set(finished),
    )
    return conn.build_connector_meta(output)


def admit(conn: OffloadingConnectorScheduler, request: Request, ids: list[int], local: int = 0):
    conn.on_new_request(request)
    hit, load_async = conn.get_num_new_matched_tokens(request, local)
    assert hit is not None
    conn.update_state_after_alloc(request, blocks(*ids, cached=local // BS), hit)
    return hit, load_async


def test_prompt_blocks_are_stored_as_the_step_computing_them_is_built() -> None:
    conn = tier()
    a = make("a", list(range(10)))  # two full blocks and a partial one
    assert admit(conn, a, [7, 8, 9]) == (0, False)
    meta = step(conn, ((a, [7, 8, 9], 10),))
    assert meta.load_jobs == {}
    [(job_id, job)] = meta.store_jobs.items()
    # GPU blocks 7 and 8 into chunks 0 and 1; the partial block stays.
    assert (job.req_id, job.src, job.dst, job.first_block_index) == ("a", [7, 8], [0, 1], 0)
    # While the store is in flight a lookup waits; once reported, it hits.
    b = make("b", list(range(10)))
    conn.on_new_request(b)
    assert conn.get_num_new_matched_tokens(b, 0) == (None, False)
    conn.update_connector_output({job_id: 1})
    assert conn.get_num_new_matched_tokens(b, 0) == (8, True)
    assert [type(e).__name__ for e in conn.take_events()] == ["BlockStored", "BlockStored"]


def test_a_hit_is_loaded_into_the_fresh_blocks_and_not_stored_back() -> None:
    conn = tier()
    a = make("a", list(range(12)))
    admit(conn, a, [1, 2, 3])
    [job_id] = step(conn, ((a, [1, 2, 3], 12),)).store_jobs
    conn.update_connector_output({job_id: 1})
    # b shares a's first two blocks; its first block is in the GPU cache already.
    b = make("b", list(range(8)) + [99, 98, 97, 96, 95])
    assert admit(conn, b, [1, 5, 6], local=BS) == (BS, True)
    meta = step(conn)
    [(load_id, load)] = meta.load_jobs.items()
    # Chunk 1 (a's second block) into GPU block 5, the second of b's table.
    assert (load.req_id, load.src, load.dst, load.first_block_index) == ("b", [1], [5], 1)
    conn.update_connector_output({load_id: 1})
    b.num_computed_tokens = 2 * BS
    conn.update_state_after_alloc(b, blocks(1, 5, 6, 4), 0)
    meta = step(conn, ((b, [1, 5, 6, 4], 5),))
    # Only b's third block is new to the tier.
    [(_, store)] = meta.store_jobs.items()
    assert (store.src, store.dst, store.first_block_index) == ([6], [3], 2)


def test_a_finished_requests_store_is_flushed_when_its_block_is_reused() -> None:
    conn = tier()
    a = make("a", list(range(8)))
    admit(conn, a, [1, 2])
    [job_id] = step(conn, ((a, [1, 2], 8),)).store_jobs
    a.status = RequestStatus.FINISHED_ABORTED
    a.num_computed_tokens = 8
    conn.request_finished(a)  # its blocks 1 and 2 go back to the pool
    assert step(conn, finished=("a",)).jobs_to_flush == set()
    c = make("c", [50, 51, 52, 53, 54])
    admit(conn, c, [2, 9])  # block 2 handed out again: the store must finish first
    assert step(conn, ((c, [2, 9], 5),)).jobs_to_flush == {job_id}
    conn.update_connector_output({job_id: 1})
    assert conn.requests.keys() == {"c"} and conn.jobs.keys() == {job_id + 1}


def test_each_worker_reports_and_the_job_completes_with_the_last() -> None:
    conn = OffloadingConnectorScheduler(CPUOffloadingManager(4), BS, num_workers=2)
    a = make("a", list(range(5)))
    admit(conn, a, [1, 2])
    [job_id] = step(conn, ((a, [1, 2], 5),)).store_jobs
    key = make_offload_key(a.block_hashes[0])
    conn.update_connector_output({job_id: 1})
    assert conn.manager.lookup(key).name == "HIT_PENDING"
    conn.update_connector_output({job_id: 1})
    assert conn.manager.lookup(key).name == "HIT"


def test_reset_forgets_the_tier_and_ignores_the_old_jobs_reports() -> None:
    conn = tier()
    a = make("a", list(range(8)))
    admit(conn, a, [1, 2])
    [job_id] = step(conn, ((a, [1, 2], 4),)).store_jobs
    conn.reset_cache()
    assert conn.has_pending_work()  # the old job's report is still due
    conn.update_connector_output({job_id: 1})
    assert not conn.has_pending_work()
    # a offers its first block again on its next step.
    a.num_computed_tokens = 4
    meta = step(conn, running=((a, [], 4),))
    [(_, store)] = meta.store_jobs.items()
    assert (store.src, store.dst) == ([1, 2], [0, 1])


def test_a_decoding_request_offers_its_prompt_again_after_a_reset_from_its_blocks_now() -> None:
    # Once its prompt is offered, a decoding request has nothing to store and the steps' stores
    # pass it by; after a reset (every chunk offered again) it is visited again, and its prompt
    # is stored from the GPU blocks that hold it.
    conn = tier()
    a = make("a", list(range(8)))
    admit(conn, a, [1, 2])
    [job_id] = step(conn, ((a, [1, 2], 8),)).store_jobs
    conn.update_connector_output({job_id: 1})
    a.num_computed_tokens = 8
    for token in range(100, 104):  # decodes: block 3 handed out, filled, hashed
        a.append_output_token_ids(token)
        meta = step(conn, running=((a, [3] if token == 100 else [], 1),))
        assert meta.store_jobs == {} and meta.load_jobs == {}
        a.num_computed_tokens += 1
    conn.reset_cache()
    [(_, store)] = step(conn, running=((a, [4], 1),)).store_jobs.items()
    assert (store.src, store.dst, store.first_block_index) == ([1, 2], [0, 1], 0)
    assert len(conn.manager.policy.chunks) == 2  # the prompt's two blocks, not the decoded one


def test_without_prompt_only_a_decoded_block_is_stored_under_its_hash_once_full() -> None:
    # Keys follow the request's block hashes only where they are read: the decoded block's
    # key is made when the step that fills it offers it.
    conn = OffloadingConnectorScheduler(
        CPUOffloadingManager(8, enable_events=True), BS, offload_prompt_only=False
    )
    a = make("a", list(range(4)))
    admit(conn, a, [1])
    [job_id] = step(conn, ((a, [1], 4),)).store_jobs
    conn.update_connector_output({job_id: 1})
    a.num_computed_tokens = 4
    a.append_output_token_ids(100)
    assert step(conn, running=((a, [2], 1),)).store_jobs == {}  # block 2 not full yet
    a.num_computed_tokens = 5
    a.append_output_token_ids([101, 102, 103])
    [(job_id, store)] = step(conn, running=((a, [], 3),)).store_jobs.items()
    assert (store.src, store.dst, store.first_block_index) == ([2], [1], 1)
    conn.update_connector_output({job_id: 1})
    key = make_offload_key(a.block_hashes[1])
    assert conn.manager.lookup(key).name == "HIT"
    stored = [e for e in conn.take_events() if type(e).__name__ == "BlockStored"]
    assert len(stored) == 2
