"""Async scheduling: two steps in flight give the same tokens as lock-step scheduling, and the
in-between cases (a stop, a preemption, an abort while the next step runs) end cleanly."""

from __future__ import annotations

import random
from collections import deque

import pytest

from ledger.events import BlockStored
from ledger.hashing import BlockHasher
from ledger.kv_cache_manager import KVCacheManager
from ledger.request import Request, RequestStatus
from ledger.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

BS = 4
HASHER = BlockHasher("sha256", seed="async")


class FakeWorker:
    """The worker's side of the protocol: it keeps the tokens it samples, drops what the step
    says is finished or preempted, and samples a token that depends only on the sequence."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        for rid in (*out.finished_req_ids, *out.preempted_req_ids):
            self.tokens.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.request.request_id] = list(new.token_ids)
        for cached in out.scheduled_cached_reqs:
            self.tokens[cached.request.request_id].extend(cached.new_token_ids)
        sampled = {}
        for rid in out.sampling_req_ids:
            seq = self.tokens[rid]
            token = (sum(seq[-3:]) * 31 + len(seq)) % 50  # a function of the sequence alone
            seq.append(token)
            sampled[rid] = token
        return sampled


def make(async_scheduling: bool, num_blocks: int = 40, **config) -> Scheduler:
    max_model_len = min(96, (num_blocks - 1) * BS)
    manager = KVCacheManager(num_blocks, BS, max_model_len, enable_kv_cache_events=True)
    return Scheduler(SchedulerConfig(max_model_len=max_model_len, max_num_seqs=8, max_num_batched_tokens=64,
                                     async_scheduling=async_scheduling, **config), manager)  # fmt: skip


def workload(seed: int) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(50) for _ in range(8)]
    return [
        Request(
            f"r{i}",
            shared[: rng.randrange(9)] + [rng.randrange(50) for _ in range(rng.randrange(1, 30))],
            rng.randrange(1, 25),
            eos_token_id=rng.choice([None, 7]),
            arrival_time=float(i),
            block_hasher=HASHER,
        )
        for i in range(12)
    ]


def run(
    scheduler: Scheduler, requests: list[Request], depth: int
) -> dict[str, tuple[list[int], str]]:
    worker = FakeWorker()
    for request in requests:
        scheduler.add_request(request)
    results: dict[str, tuple[list[int], str]] = {}
    in_flight: deque[tuple[SchedulerOutput, dict[str, int]]] = deque()
    for _ in range(10_000):
        if not scheduler.has_unfinished_requests() and not in_flight:
            break
        if len(in_flight) < depth:
            out = scheduler.schedule()
            if not out.is_empty:
                in_flight.append((out, worker.execute(out)))
                if len(in_flight) < depth:
                    continue
        out, sampled = in_flight.popleft()
        for update in scheduler.update_from_output(out, sampled):
            if update.finished:
                results[update.request.request_id] = (
                    update.request.output_token_ids,
                    update.finish_reason,
                )
    return results


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [40, 14])  # 14: preemptions and evictions happen
def test_two_steps_in_flight_give_the_lock_step_tokens(seed, num_blocks):
    lock_step = make(False, num_blocks)
    expected = run(lock_step, workload(seed), depth=1)
    pipelined = make(True, num_blocks)
    got = run(pipelined, workload(seed), depth=2)
    assert got == expected and len(got) == 12
    for scheduler in (lock_step, pipelined):
        assert scheduler.kv_cache_manager.num_free_blocks == num_blocks - 1
        assert not scheduler.kv_cache_manager.req_to_blocks
    if num_blocks == 14:
        assert pipelined.num_preemptions > 0


def test_the_next_step_is_scheduled_before_the_tokens_are_back():
    s = make(True)
    s.add_request(Request("a", list(range(10)), 3, block_hasher=HASHER))
    first = s.schedule()
    assert first.sampling_req_ids == {"a"} and s.requests["a"].num_output_placeholders == 1
    second = s.schedule()  # step 1's token is still being sampled
    (cached,) = second.scheduled_cached_reqs
    assert second.num_scheduled_tokens == {"a": 1} and cached.new_token_ids == ()
    third = s.schedule()
    assert third.num_scheduled_tokens == {"a": 1} and s.requests["a"].num_output_placeholders == 3
    assert s.schedule().is_empty  # max_tokens 3: every output is already in flight
    for out, token in ((first, 11), (second, 12), (third, 13)):
        s.update_from_output(out, {"a": token})
    assert "a" not in s.requests and s.kv_cache_manager.num_free_blocks == 39


def test_a_stop_while_the_next_step_runs_frees_the_request_and_ignores_its_late_token():
    s = make(True)
    s.add_request(Request("a", list(range(10)), 20, eos_token_id=7, block_hasher=HASHER))
    first = s.schedule()
    second = s.schedule()
    (update,) = s.update_from_output(first, {"a": 7})  # EOS
    assert update.finished and update.finish_reason == "stop"
    assert s.update_from_output(second, {"a": 9}) == []
    assert s.kv_cache_manager.num_free_blocks == 39 and s.schedule().finished_req_ids == {"a"}


def test_a_request_preempted_while_its_step_runs_keeps_that_token():
    s = make(True, num_blocks=9)  # 8 lendable blocks of 4
    s.add_request(Request("a", list(range(13)), 20, arrival_time=0.0, block_hasher=HASHER))
    s.add_request(Request("b", list(range(100, 116)), 20, arrival_time=1.0, block_hasher=HASHER))
    first = s.schedule()  # a: 4 blocks, b: 4 blocks (16 tokens + room for one sampled)
    assert s.kv_cache_manager.num_free_blocks == 0
    second = s.schedule()  # b's 17th slot needs a 5th block: b, the newest, is preempted
    assert second.preempted_req_ids == ["b"]
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 0
    s.update_from_output(first, {"a": 1, "b": 2})
    assert b.output_token_ids == [2]  # computed before the preemption reached the workers
    s.update_from_output(second, {"a": 3})
    assert s.requests["a"].output_token_ids == [1, 3]


def test_an_abort_between_steps_is_ignored_by_the_step_in_flight():
    s = make(True)
    s.add_request(Request("a", list(range(10)), 20, block_hasher=HASHER))
    first = s.schedule()
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert s.update_from_output(first, {"a": 5}) == []
    assert s.kv_cache_manager.num_free_blocks == 39


def _stored_tokens(s: Scheduler) -> list[list[int]]:
    return [e.token_ids for e in s.kv_cache_manager.take_events() if isinstance(e, BlockStored)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_finished_requests_last_full_block_is_cached_and_hit_later(async_scheduling):
    # The smallest case: vLLM caches a's block [11, 12, 13, 4817] in both modes; with
    # two steps in flight it does so when a's last token comes back, since a, whose last token
    # is already being sampled, is not scheduled again.
    s = make(async_scheduling, num_blocks=10)
    s.add_request(Request("a", [11, 12, 13], 2, block_hasher=HASHER))
    first = s.schedule()
    if async_scheduling:
        second = s.schedule()
        s.update_from_output(first, {"a": 4817})
        assert s.schedule().is_empty and _stored_tokens(s) == []
    else:
        s.update_from_output(first, {"a": 4817})
        second = s.schedule()
        assert _stored_tokens(s) == [[11, 12, 13, 4817]]
    (update,) = s.update_from_output(second, {"a": 99})
    assert update.finished and update.finish_reason == "length"
    if async_scheduling:
        assert _stored_tokens(s) == [[11, 12, 13, 4817]]
    pool = s.kv_cache_manager.block_pool
    # Cached, so it went to the back of the free queue (uncached blocks go to the front).
    assert [b.block_id for b in pool.free_block_queue][-1] == 1 and pool.blocks[1].block_hash
    s.add_request(Request("b", [11, 12, 13, 4817, 99], 1, block_hasher=HASHER))
    (admission,) = s.schedule().admissions
    assert admission.num_hit_tokens == 4 and s.kv_cache_manager.prefix_cache_stats.hits == 4


def test_a_block_is_cached_only_once_its_last_token_is_computed():
    # With two steps in flight a token's KV is computed one step after it is sampled: a block
    # whose last token just came back is not cached yet; the next step computes it.
    s = make(True, num_blocks=10)
    s.add_request(Request("a", [11, 12, 13], 10, block_hasher=HASHER))
    first, second = s.schedule(), s.schedule()
    s.update_from_output(first, {"a": 14})  # block 0 is full, its last slot still in flight
    assert _stored_tokens(s) == [] and s.kv_cache_manager.num_cached_block.get("a", 0) == 0
    third = s.schedule()  # allocate_slots caches it: this step's tokens are known
    assert _stored_tokens(s) == [[11, 12, 13, 14]]
    s.update_from_output(second, {"a": 15})
    s.update_from_output(third, {"a": 16})
    assert _stored_tokens(s) == []
