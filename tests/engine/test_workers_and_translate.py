"""Pool sizing from the workers' reports, membership changes, and request validation."""

from __future__ import annotations

import math

import pytest

from engine.translate import (
    normalize_sampling,
    request_from_message,
    request_output,
    validate_request,
)
from engine.workers import StartupError, membership_changes, plan_pool
from ledger.request import RequestStatus
from services.wire.messages import GenerateRequest, RequestOutput, SamplingParams, WorkerHello


def hello(
    worker_id: str,
    num_blocks: int,
    started_at: float = 1.0,
    block_size: int = 16,
    device: str = "cuda:0",
):
    return WorkerHello(
        worker_id=worker_id, group="g", num_gpu_blocks=num_blocks, block_size=block_size,
        bytes_per_block=2 * 1024 * 1024, available_kv_bytes=0, model_name="m", max_model_len=4096,
        vocab_size=32000, device=device, started_at=started_at,
    )  # fmt: skip


def test_the_smallest_worker_sizes_the_pool_and_the_capacity_line():
    plan = plan_pool([hello("a", 27_955), hello("b", 30_000)], 16, 131_072, None)
    assert plan.num_gpu_blocks == 27_955
    assert plan.capacity_line == (
        "GPU KV cache size: 447,280 tokens, Maximum concurrency for 131,072 tokens per request: 3.41x"
    )
    assert plan_pool([hello("a", 100, device="cpu")], 16, 1024, 80).capacity_line.startswith(
        "CPU KV cache size: 1,280"
    )


def test_the_ledger_refuses_what_cannot_serve_one_max_model_len_request():
    with pytest.raises(
        StartupError, match=r"max seq len \(131072\).*estimated maximum model length is 81904"
    ):
        plan_pool([hello("a", 5_120)], 16, 131_072, None)
    with pytest.raises(StartupError, match="cannot create memory"):
        plan_pool([hello("a", 100)], 16, 1024, 200)
    with pytest.raises(StartupError, match="KVLEDGER_BLOCK_SIZE"):
        plan_pool([hello("a", 100, block_size=32)], 16, 1024, None)


def test_membership_changes_tell_a_restart_from_a_heartbeat():
    known = {"a": hello("a", 100), "b": hello("b", 100)}
    assert membership_changes(known, dict(known), 100) == ([], [])
    restarted = {"a": hello("a", 100, started_at=2.0), "b": known["b"]}
    assert membership_changes(known, restarted, 100) == (["a"], [])
    assert membership_changes(known, {"a": known["a"]}, 100) == (["b"], [])
    grown = {**known, "c": hello("c", 100), "tiny": hello("tiny", 10)}
    assert membership_changes(known, grown, 100) == (
        [],
        ["c"],
    )  # too small to hold the pool: ignored


@pytest.mark.parametrize(
    ("prompt", "sampling", "message"),
    [
        ([], SamplingParams(), "empty prompt"),
        ([1, 40_000], SamplingParams(), "token id 40000 is outside the vocabulary"),
        ([1, 2], SamplingParams(max_tokens=0), "'sampling.max_tokens': must be at least 1"),
        ([1] * 100, SamplingParams(max_tokens=30), "exceed max_model_len 128"),
        ([1, 2], SamplingParams(top_p=0.0), "0 < top_p <= 1"),
        (
            [1, 2],
            SamplingParams(temperature=math.nan),
            "'sampling.temperature': must be a finite number",
        ),
        (
            [1, 2],
            SamplingParams(temperature=math.inf),
            "'sampling.temperature': must be a finite number",
        ),
        ([1, 2], SamplingParams(min_p=math.nan), "'sampling.min_p': must be a finite number"),
        ([1, 2], SamplingParams(min_p=1.5), "'sampling.min_p': must be in [0, 1]"),
        ([1, 2], SamplingParams(presence_penalty=3.0), "'sampling.presence_penalty'"),
        ([1, 2], SamplingParams(repetition_penalty=0.0), "'sampling.repetition_penalty'"),
        ([1, 2], SamplingParams(logit_bias={7: math.inf}), "token 7 has a bias of inf"),
    ],
)
def test_requests_the_ledger_cannot_run_are_named_by_field(prompt, sampling, message):
    msg = GenerateRequest(
        req_id="r", gateway_id="g", prompt_token_ids=prompt, sampling=sampling, arrival_time=0.0
    )
    assert message in validate_request(msg, 32_000, 128)


def test_a_valid_request_passes():
    msg = GenerateRequest(
        req_id="r",
        gateway_id="g",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(),
        arrival_time=0.0,
    )
    assert validate_request(msg, 32_000, 128) is None


# vLLM 0.33's SamplingParams.__post_init__ raises any positive temperature below _MAX_TEMP to
# it, the tiniest too (1e-300 samples at 0.01, not greedily); only 0 is greedy.
@pytest.mark.parametrize(
    ("temperature", "normalized"), [(1e-300, 1e-2), (0.0, 0.0), (1e-3, 1e-2), (0.7, 0.7)]
)
def test_sampling_is_normalized_as_vllm_does(temperature, normalized):
    s = SamplingParams(temperature=temperature, logit_bias={3: 1e30, 4: -500.0, 5: 2.5})
    normalize_sampling(s)
    assert s.temperature == normalized
    assert s.logit_bias == {3: 100.0, 4: -100.0, 5: 2.5}


def test_a_request_output_carries_each_field_of_its_request():
    """request_output builds RequestOutput positionally: every field lands where it belongs."""
    msg = GenerateRequest(req_id="r", gateway_id="g", prompt_token_ids=[3, 4, 5],
                          sampling=SamplingParams(max_tokens=8, stop_token_ids=[9]), arrival_time=1.0)  # fmt: skip
    request = request_from_message(msg, None, None, 16)
    request.num_cached_tokens, request.num_preemptions = 2, 1
    request.append_output_token_ids([6, 9])
    request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, 9
    assert request_output(request, (9,), "stop") == RequestOutput(
        req_id="r", new_token_ids=(9,), position=1, finished=True, finish_reason="stop",
        stop_token_id=9, num_prompt_tokens=3, num_cached_tokens=2, num_preemptions=1,
    )  # fmt: skip
    request.num_cached_tokens = -1  # never admitted: no hit to report
    assert request_output(request, (), error="gone") == RequestOutput(
        req_id="r", new_token_ids=(), position=2, stop_token_id=9, num_prompt_tokens=3,
        num_preemptions=1, error="gone",
    )  # fmt: skip
