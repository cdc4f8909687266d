"""The scheduler: one token budget, chunked prefill, preemption by recompute, priorities, stops."""

from __future__ import annotations

import pytest

from ledger.hashing import BlockHasher
from ledger.kv_cache_manager import KVCacheManager
from ledger.request import Request, RequestStatus
from ledger.scheduler import Scheduler, SchedulerConfig

BS = 16
HASHER = BlockHasher("sha256", seed="test")


def make_scheduler(num_blocks: int = 100, **config) -> Scheduler:
    config.setdefault("max_model_len", min(1024, (num_blocks - 1) * BS))
    config.setdefault("max_num_batched_tokens", 1024)
    config.setdefault("max_num_seqs", 64)
    watermark = config.pop("watermark", 0.0)
    manager = KVCacheManager(num_blocks, BS, config["max_model_len"], watermark=watermark)
    return Scheduler(SchedulerConfig(**config), manager)


def request(
    request_id: str, num_prompt: int, max_tokens: int = 100, start: int = 0, **kwargs
) -> Request:
    kwargs.setdefault(
        "arrival_time",
        float(len(request_id)) + int(request_id[-1]) if request_id[-1].isdigit() else 0.0,
    )
    return Request(
        request_id,
        list(range(start, start + num_prompt)),
        max_tokens,
        block_hasher=HASHER,
        **kwargs,
    )


def run_step(scheduler: Scheduler, token: int = 7):
    """One step with a fake worker that samples `token` for every request reaching its end."""
    out = scheduler.schedule()
    assert not out.is_empty or not scheduler.has_unfinished_requests(), "the scheduler is stuck"
    sampled = {
        rid: token
        for rid in out.num_scheduled_tokens
        if scheduler.requests[rid].num_computed_tokens >= scheduler.requests[rid].num_tokens
    }
    return out, scheduler.update_from_output(out, sampled)


def test_new_requests_get_all_blocks_and_running_ones_only_new_blocks():
    s = make_scheduler()
    s.add_request(request("a1", 20))
    out, updates = run_step(s)
    (new,) = out.scheduled_new_reqs
    assert (
        new.block_ids == [1, 2]
        and new.token_ids == list(range(20))
        and new.num_computed_tokens == 0
    )
    assert out.num_scheduled_tokens == {"a1": 20}
    assert [u.new_token_ids for u in updates] == [(7,)]
    for _ in range(12):  # slots 21..32 fit in block 2
        out, _ = run_step(s)
        (cached,) = out.scheduled_cached_reqs
        # The workers keep the tokens they sample: nothing to send back, only new blocks.
        assert cached.new_token_ids == () and cached.new_block_ids == ()
    out, _ = run_step(s)  # the 33rd token needs block 3
    assert out.scheduled_cached_reqs[0].new_block_ids == (3,)
    assert out.scheduled_cached_reqs[0].num_computed_tokens == 32


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_the_end():
    s = make_scheduler(max_num_batched_tokens=64, max_num_seqs=4)
    s.add_request(request("a1", 150))
    chunks = []
    while True:
        out, updates = run_step(s)
        chunks.append(out.num_scheduled_tokens["a1"])
        if updates:
            break
        assert s.requests["a1"].num_output_tokens == 0
    assert chunks == [64, 64, 22]
    assert s.requests["a1"].num_output_tokens == 1


def test_without_chunked_prefill_a_prompt_over_the_budget_waits():
    s = make_scheduler(
        max_num_batched_tokens=1024, max_model_len=1024, enable_chunked_prefill=False
    )
    s.add_request(request("a1", 1000))
    s.add_request(request("b2", 100, start=5000))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["a1"]
    assert (out.waiting_held.request_id, out.waiting_held.reason) == ("b2", "budget")
    out, _ = run_step(s)  # a1 decodes (1 token); b2's 100 tokens fit in the rest of the budget
    assert out.num_scheduled_tokens == {"a1": 1, "b2": 100}
    assert out.waiting_held is None  # nobody left waiting


def test_without_chunked_prefill_the_long_prefill_cap_comes_before_the_budget_check():
    # vLLM caps a prompt at long_prefill_token_threshold first, then checks it against what is
    # left of the budget: b's capped 16 tokens fit in the 16 that a leaves (its 20 would not).
    s = make_scheduler(
        max_model_len=32,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        enable_chunked_prefill=False,
        long_prefill_token_threshold=16,
    )
    s.add_request(request("a1", 20))
    s.add_request(request("b2", 20, start=500))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a1": 16, "b2": 16}
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a1": 4, "b2": 4}


def test_token_budget_is_shared_running_first():
    s = make_scheduler(max_num_batched_tokens=100, max_num_seqs=8)
    s.add_request(request("a1", 60))
    s.add_request(request("b2", 60, start=500))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a1": 60, "b2": 40}  # b2 starts with a chunk
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a1": 1, "b2": 20}


def test_max_num_seqs_caps_running_requests():
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=512)
    for i in range(3):
        s.add_request(request(f"r{i}", 10))
    out, _ = run_step(s)
    assert sorted(out.num_scheduled_tokens) == ["r0", "r1"] and s.num_waiting == 1
    assert (out.waiting_held.request_id, out.waiting_held.reason) == ("r2", "seats")


def test_the_head_held_by_a_spent_token_budget_is_named():
    s = make_scheduler(max_num_batched_tokens=64, max_num_seqs=4)
    s.add_request(request("a1", 64))
    s.add_request(request("b2", 10, start=500))
    out, _ = run_step(s)  # a1's prompt takes the whole budget
    assert list(out.num_scheduled_tokens) == ["a1"]
    assert (out.waiting_held.request_id, out.waiting_held.reason) == ("b2", "budget")


def test_fcfs_preempts_the_newest_running_request_by_recompute():
    s = make_scheduler(num_blocks=8)  # 7 lendable blocks
    a, b = request("a1", 32, max_tokens=2), request("b2", 64, start=1000)
    s.add_request(a)
    s.add_request(b)
    out, _ = run_step(s)
    assert [x.request.request_id for x in out.scheduled_new_reqs] == ["a1", "b2"]
    assert s.kv_cache_manager.num_free_blocks == 1  # a: 2 blocks, b: 4 blocks
    out, _ = run_step(s)  # a's 33rd slot takes the last block; b's 65th finds none
    assert out.num_scheduled_tokens == {"a1": 1}
    assert out.preempted_req_ids == ["b2"]
    (p,) = out.preemptions
    assert (p.request_id, p.caused_by, p.num_blocks_freed) == ("b2", "b2", 4)
    assert (
        b.status == RequestStatus.PREEMPTED
        and b.num_computed_tokens == 0
        and b.num_preemptions == 1
    )
    assert s.num_preemptions == 1 and list(s.waiting) == [b]
    assert out.admissions == []  # nobody is admitted in a step that preempted
    assert (out.waiting_held.request_id, out.waiting_held.reason) == ("b2", "preemption")
    assert a.is_finished  # its second token was its last
    # b comes back as a new request carrying its prompt and its sampled token, and hits its own
    # four cached blocks.
    out, _ = run_step(s)
    (resumed,) = out.scheduled_new_reqs
    assert resumed.request is b and resumed.token_ids == list(range(1000, 1064)) + [7]
    assert out.admissions[0].resumed and out.admissions[0].num_hit_tokens == 64
    assert out.num_scheduled_tokens == {"b2": 1}


def test_a_running_request_that_cannot_grow_preempts_a_later_one_it_names():
    s = make_scheduler(num_blocks=6)  # 5 lendable
    a, b = request("a1", 32), request("b2", 40, start=500)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # a: 2 blocks, b: 3 blocks -> 0 free
    out, _ = run_step(s)  # a needs block 3 for its 33rd token: preempts b
    (p,) = out.preemptions
    assert (p.request_id, p.caused_by) == ("b2", "a1")
    assert out.num_scheduled_tokens == {"a1": 1}


def test_priority_policy_preempts_the_lowest_priority_and_restores_its_budget():
    s = make_scheduler(num_blocks=7, policy="priority")
    low = request("low1", 32, priority=5, arrival_time=0.0)
    high = request("hi2", 32, start=900, priority=0, arrival_time=1.0)
    s.add_request(low)
    s.add_request(high)
    out, _ = run_step(s)
    # Under the priority policy the waiting heap admits high first.
    assert [x.request.request_id for x in out.scheduled_new_reqs] == ["hi2", "low1"]
    assert s.running == [high, low]
    s.add_request(request("mid3", 16, start=5000, priority=3, arrival_time=2.0))
    out, _ = run_step(s)  # both need a 3rd block, 2 free: both fit
    assert out.num_scheduled_tokens == {"hi2": 1, "low1": 1} and not out.preemptions
    for _ in range(15):
        out, _ = run_step(s)
    assert s.kv_cache_manager.num_free_blocks == 0
    out, _ = run_step(s)  # the 49th slot of each: high (served first) preempts low
    assert [p.request_id for p in out.preemptions] == ["low1"]
    assert out.num_scheduled_tokens == {"hi2": 1}


def test_priority_victim_already_scheduled_gives_its_tokens_back():
    s = make_scheduler(num_blocks=5, policy="priority", max_num_batched_tokens=200)  # 4 lendable
    low = request("low1", 30, priority=9, arrival_time=0.0)  # room left in its 2nd block
    high = request("hi2", 32, start=900, priority=0, arrival_time=1.0)
    s.add_request(low)
    s.add_request(high)
    run_step(s)
    assert s.kv_cache_manager.num_free_blocks == 0
    s.running.reverse()  # low is served first this step, and fits without a new block
    out, _ = run_step(s)
    # high's 33rd slot needs a block: the victim is low, already scheduled this step.
    (p,) = out.preemptions
    assert (p.request_id, p.caused_by) == ("low1", "hi2")
    assert out.num_scheduled_tokens == {"hi2": 1}
    assert [c.request.request_id for c in out.scheduled_cached_reqs] == ["hi2"]
    assert out.scheduled_cached_reqs[0].new_block_ids == (4,)  # low's freed (uncached) tail block


def test_admission_gate_requires_the_whole_prompt_to_fit():
    s = make_scheduler(num_blocks=9, max_num_batched_tokens=32, max_num_seqs=4)  # 8 lendable
    s.add_request(request("a1", 60))
    while s.requests["a1"].num_computed_tokens < 60:
        run_step(s)
    assert s.kv_cache_manager.num_free_blocks == 4
    s.add_request(request("b2", 80, start=400))  # 5 blocks: its first 32-token chunk would fit
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a1": 1} and s.num_waiting == 1
    assert (out.waiting_held.request_id, out.waiting_held.reason) == ("b2", "blocks")


def test_watermark_keeps_blocks_free_for_running_requests():
    s = make_scheduler(num_blocks=11, watermark=0.2)  # 2 blocks of headroom
    s.add_request(request("a1", 64))
    s.add_request(request("b2", 64, start=300))
    out, _ = run_step(s)
    # a1 is admitted with nothing running (no watermark); b2 would leave 10-4-4 = 2 free... ok
    assert sorted(out.num_scheduled_tokens) == ["a1", "b2"]
    s.add_request(request("c3", 20, start=600))
    out, _ = run_step(s)
    assert "c3" not in out.num_scheduled_tokens  # 2 free - 2 new < watermark 2
    assert out.admissions == []
    # a1 and b2 each took a fifth block for their 65th token: nothing is left for c3.
    assert (out.waiting_held.request_id, out.waiting_held.reason) == ("c3", "blocks")


def test_a_head_whose_blocks_fit_but_not_with_the_watermark_is_held_by_the_watermark():
    s = make_scheduler(num_blocks=11, watermark=0.2)  # 10 lendable, 2 kept free at admission
    s.add_request(request("a1", 60))  # 4 blocks, room to decode to 64 tokens without a fifth
    run_step(s)
    s.add_request(request("c3", 80, start=600))  # 5 blocks: 6 are free, but 6 - 5 < 2
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a1": 1}
    assert (out.waiting_held.request_id, out.waiting_held.reason) == ("c3", "watermark")


@pytest.mark.parametrize(
    ("kwargs", "tokens", "reason", "num_outputs"),
    [
        ({"eos_token_id": 9}, [5, 9], "stop", 2),
        ({"eos_token_id": 9}, [9], "stop", 1),  # min_tokens is the sampler's mask, as in vLLM
        ({"stop_token_ids": [4]}, [5, 4], "stop", 2),
        ({"max_tokens": 3}, [5, 5, 5], "length", 3),
    ],
)
def test_stop_conditions(kwargs, tokens, reason, num_outputs):
    s = make_scheduler()
    max_tokens = kwargs.pop("max_tokens", 100)
    s.add_request(request("a1", 10, max_tokens=max_tokens, **kwargs))
    updates = []
    for token in tokens:
        _, updates = run_step(s, token)
    (last,) = updates
    assert last.finished and last.finish_reason == reason
    assert last.request.num_output_tokens == num_outputs
    assert s.kv_cache_manager.num_free_blocks == 99 and not s.has_unfinished_requests()
    out = s.schedule()
    assert out.finished_req_ids == {"a1"}


def test_max_model_len_caps_length():
    s = make_scheduler(max_model_len=20)
    s.add_request(request("a1", 18))
    _, updates = run_step(s)
    assert not updates[0].finished
    _, updates = run_step(s)
    assert updates[0].finished and updates[0].finish_reason == "length"
    assert updates[0].request.num_tokens == 20


def test_prompt_leaving_no_room_is_refused():
    s = make_scheduler(max_model_len=20)
    with pytest.raises(ValueError, match="no room"):
        s.add_request(request("a1", 20))


def test_abort_frees_running_and_waiting_requests():
    s = make_scheduler(num_blocks=4)
    s.add_request(request("a1", 40))
    s.add_request(request("b2", 40, start=100))
    run_step(s)
    assert s.num_running == 1 and s.num_waiting == 1
    aborted = s.finish_requests(["a1", "b2", "nope"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in aborted] == ["a1", "b2"]
    assert s.kv_cache_manager.num_free_blocks == 3
    assert not s.has_unfinished_requests()
    assert s.schedule().finished_req_ids == {"a1", "b2"}


def test_resumed_requests_are_counted_apart_in_prefix_cache_stats():
    s = make_scheduler(num_blocks=6)
    s.add_request(request("a1", 32, max_tokens=2))
    s.add_request(request("b2", 40, start=500))
    run_step(s)
    out, _ = run_step(s)  # b2 preempted, a1 finishes
    assert out.preempted_req_ids == ["b2"]
    stats = s.kv_cache_manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 72, 0)
    out, _ = run_step(s)
    assert out.admissions[0].resumed
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 41, 32)
    assert (stats.requests, stats.queries) == (2, 72)


def test_preempt_all_requeues_everything_in_order():
    s = make_scheduler()
    for i in range(3):
        s.add_request(request(f"r{i}", 20, start=100 * i))
    run_step(s)
    preemptions = s.preempt_all("worker_lost")
    assert [p.reason for p in preemptions] == ["worker_lost"] * 3
    assert [r.request_id for r in s.waiting] == ["r0", "r1", "r2"]
    assert s.kv_cache_manager.num_free_blocks == 99
