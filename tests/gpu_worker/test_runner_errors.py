"""Steps the runner must refuse with a StepError naming the request, before touching state or
the cache, plus the state rules: epochs, finished and preempted ids."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.runner import RequestsFailed, StepError
from services.wire.messages import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    StepMessage,
    StructuredOutput,
)

GREEDY = SamplingParams()


def new(req_id: str, tokens: list[int], blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(req_id, tokens, len(tokens), blocks, computed, GREEDY)


def step(
    new_reqs=(), cached=(), scheduled=None, epoch="e1", finished=(), preempted=(), block_size=4
) -> StepMessage:
    return StepMessage(
        1,
        epoch,
        list(new_reqs),
        list(cached),
        dict(scheduled or {}),
        list(finished),
        list(preempted),
        block_size,
    )


@pytest.fixture
def runner(make_runner):
    runner = make_runner(num_blocks=16, block_size=4)
    runner.execute(step([new("a", [256, 1, 2, 3, 4], [1, 2])], scheduled={"a": 5}))
    return runner


def snapshot(runner) -> dict[str, tuple[list[int], list[int]]]:
    return {r: (list(s.token_ids), list(s.block_ids)) for r, s in runner.requests.items()}


def assert_unchanged(runner, before) -> None:
    assert snapshot(runner) == before


def test_unknown_cached_request_is_named(runner):
    with pytest.raises(StepError, match="request ghost: sent as cached but this worker holds no"):
        runner.execute(
            step(cached=[CachedRequestData("ghost", [5], [], 5)], scheduled={"ghost": 1})
        )
    with pytest.raises(StepError, match="request nobody: scheduled but unknown"):
        runner.execute(step(scheduled={"nobody": 1}))


def test_short_block_table_is_refused_before_any_write(runner):
    before = snapshot(runner)
    cache = runner.kv_caches[0][0].clone()
    bad = new("b", list(range(9)), [3, 4])  # 9 tokens need 3 blocks of 4
    with pytest.raises(
        StepError,
        match="request b: block table of 2 blocks holds 8 tokens, the step writes position 8",
    ):
        runner.execute(step([bad], scheduled={"b": 9}))
    assert torch.equal(runner.kv_caches[0][0], cache)
    assert_unchanged(runner, before)


def test_out_of_range_token_and_block_ids(runner):
    with pytest.raises(StepError, match=r"request b: token id 258 is outside the vocabulary"):
        runner.execute(step([new("b", [1, 258], [3])], scheduled={"b": 2}))
    with pytest.raises(StepError, match=r"request b: block id 16 is outside the cache 0\.\.15"):
        runner.execute(step([new("b", [1, 2], [16])], scheduled={"b": 2}))
    with pytest.raises(StepError, match="request a: token id -1 is outside"):
        runner.execute(step(cached=[CachedRequestData("a", [-1], [], 5)], scheduled={"a": 1}))


def test_a_refused_step_changes_nothing_and_the_next_one_runs(runner):
    before = snapshot(runner)
    first = runner.requests["a"].token_ids[-1]  # the fixture's step sampled it, the worker kept it
    good = CachedRequestData("a", [], [], 5)
    with pytest.raises(StepError, match="request c"):
        runner.execute(step([new("c", [1, 2], [99])], cached=[good], scheduled={"a": 1, "c": 2}))
    assert_unchanged(runner, before)
    sampled = runner.execute(step(cached=[good], scheduled={"a": 1}))
    assert set(sampled) == {"a"}
    # The worker keeps the token it sampled: the next step computes it without a resend.
    assert runner.requests["a"].token_ids == [256, 1, 2, 3, 4, first, sampled["a"]]


def test_more_tokens_than_known_and_zero_tokens_are_refused(runner):
    # 5 prompt tokens, the one sampled by the fixture's step, and 65 sent now: 7 known.
    with pytest.raises(StepError, match=r"request a: cannot compute tokens 5\.\.7: it has 7 known"):
        runner.execute(step(cached=[CachedRequestData("a", [65], [3], 5)], scheduled={"a": 3}))
    with pytest.raises(StepError, match="request a: scheduled with 0 tokens"):
        runner.execute(step(scheduled={"a": 0}))


def test_block_size_mismatch_is_refused(runner):
    with pytest.raises(StepError, match="block_size 16 != the cache's 4"):
        runner.execute(step(block_size=16))


def test_epoch_change_drops_all_state(runner):
    runner.execute(step(epoch="e1"))
    assert "a" in runner.requests
    with pytest.raises(StepError, match="request a: sent as cached"):
        runner.execute(
            step(cached=[CachedRequestData("a", [65], [], 5)], scheduled={"a": 1}, epoch="e2")
        )
    assert runner.requests == {}


def test_finished_and_preempted_ids_drop_state(runner):
    runner.execute(step([new("b", [256, 7], [5])], scheduled={"b": 2}))
    runner.execute(step(finished=["a"], preempted=["b"]))
    assert runner.requests == {}


def test_new_request_replaces_held_state(runner):
    resumed = new("a", [256, 9, 9], [6])
    sampled = runner.execute(step([resumed], scheduled={"a": 3}))
    assert set(sampled) == {"a"}
    assert runner.requests["a"].token_ids == [256, 9, 9, sampled["a"]]
    assert runner.requests["a"].block_ids == [6]


def test_a_grammar_the_worker_cannot_build_fails_that_request_alone(runner):
    """Named in RequestsFailed (the ledger fails it alone, as a sampling failure), not a
    refused step that strikes every request beside it; nothing changes, and the others run."""
    bad = StructuredOutput(kind="grammar", grammar="start: undefined_rule")
    poison = NewRequestData(
        "bad", [256, 9, 8], 3, [5], 0, SamplingParams(max_tokens=4, structured=bad)
    )
    before = snapshot(runner)
    cache = runner.kv_caches[0][0].clone()
    with pytest.raises(RequestsFailed) as failed:
        runner.execute(
            step([new("b", [256, 7, 7], [4]), poison], scheduled={"b": 3, "bad": 3, "a": 1})
        )
    assert list(failed.value.errors) == ["bad"]
    assert failed.value.errors["bad"].startswith("GrammarError: structured output (grammar): ")
    assert 'unknown name: "undefined_rule"' in failed.value.errors["bad"]
    assert_unchanged(runner, before)
    assert torch.equal(runner.kv_caches[0][0], cache)
    # The same step without it runs (the ledger re-sends it so once it failed the request).
    sampled = runner.execute(step([new("b", [256, 7, 7], [4])], scheduled={"b": 3, "a": 1}))
    assert set(sampled) == {"a", "b"}
