"""The wire codec: round trips, and errors that name the offending field."""

from __future__ import annotations

import msgpack
import pytest

from services.wire.codec import WIRE_VERSION, WireError, decode, encode
from services.wire.messages import (
    TIER_CPU,
    TIER_SHARED,
    KVTransfer,
    KVTransfers,
    LedgerStatus,
    NewRequestData,
    OutputBatch,
    RequestOutput,
    RoutingCosts,
    SamplingParams,
    SharedTierStatus,
    StepMessage,
    StepResult,
    WorkerHello,
)


def step() -> StepMessage:
    new = NewRequestData(
        req_id="a",
        token_ids=[1, 2, 3],
        num_prompt_tokens=3,
        block_ids=[4],
        num_computed_tokens=0,
        sampling=SamplingParams(temperature=0.5, seed=7),
    )
    return StepMessage(step_id=3, epoch="e.1", new_reqs=[new], cached_reqs=[], num_scheduled_tokens={"a": 3},
                       finished_req_ids=["z"], preempted_req_ids=[], block_size=16)  # fmt: skip


def raw(msg) -> dict:
    return msgpack.unpackb(encode(msg))


def test_round_trip_keeps_every_field():
    assert decode(encode(step())) == step()
    batch = OutputBatch(outputs=[RequestOutput(req_id="a", new_token_ids=[5], position=2)])
    assert decode(encode(batch), OutputBatch) == batch
    assert raw(step())["v"] == WIRE_VERSION and raw(step())["kind"] == "step"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b.pop("epoch"), "field 'epoch': missing"),
        (
            lambda b: b["new_reqs"][0].__setitem__("block_ids", [1, "x"]),
            "field 'new_reqs[0].block_ids[1]': expected int, got str",
        ),
        (
            lambda b: b["new_reqs"][0]["sampling"].__setitem__("temperature", "hot"),
            "field 'new_reqs[0].sampling.temperature': expected float, got str",
        ),
        (
            lambda b: b["new_reqs"][0]["sampling"].__setitem__("seed", 1.5),
            "field 'new_reqs[0].sampling.seed': expected int, got float",
        ),
        (
            lambda b: b.__setitem__("num_scheduled_tokens", {"a": "3"}),
            "field 'num_scheduled_tokens[...]': expected int, got str",
        ),
        (lambda b: b.__setitem__("step_id", True), "field 'step_id': expected int, got bool"),
        (lambda b: b.__setitem__("v", 99), "unsupported wire version 99"),
        (lambda b: b.__setitem__("kind", "nope"), "unknown message kind 'nope'"),
    ],
)
def test_a_bad_message_names_its_field(mutate, message):
    body = raw(step())
    mutate(body)
    with pytest.raises(WireError) as err:
        decode(msgpack.packb(body))
    assert message in str(err.value)


def test_expecting_one_kind_refuses_another():
    with pytest.raises(WireError, match="expected 'result', got 'step'"):
        from services.wire.messages import StepResult

        decode(encode(step()), StepResult)


def test_non_msgpack_and_non_maps_are_refused():
    with pytest.raises(WireError, match="not msgpack"):
        decode(b"\xc1")
    with pytest.raises(WireError, match="expected a msgpack map"):
        decode(msgpack.packb([1, 2]))


def test_an_int_is_accepted_where_a_float_is_declared():
    body = raw(step())
    body["new_reqs"][0]["sampling"]["temperature"] = 1
    temperature = decode(msgpack.packb(body), StepMessage).new_reqs[0].sampling.temperature
    assert temperature == 1.0 and type(temperature) is float


def test_an_output_leaves_out_its_defaults_and_the_full_form_still_decodes():
    """RequestOutput is encoded with omit_defaults: a decoding ledger or gateway of a build that
    wrote every field reads the short form, and this build reads the long one."""
    out = RequestOutput(req_id="a", new_token_ids=[5], position=3, num_prompt_tokens=7)
    short = encode(OutputBatch(outputs=[out]))
    body = msgpack.unpackb(short)
    assert body["outputs"] == [{"req_id": "a", "new_token_ids": [5], "position": 3,
                                "num_prompt_tokens": 7}]  # fmt: skip
    full = {"req_id": "a", "new_token_ids": [5], "position": 3, "finished": False,
            "finish_reason": None, "stop_token_id": None, "num_prompt_tokens": 7,
            "num_cached_tokens": 0, "num_preemptions": 0, "error": None, "logprobs": None,
            "prompt_logprobs": None}  # fmt: skip
    long = msgpack.packb({"kind": "outputs", "outputs": [full], "v": WIRE_VERSION})
    assert decode(short, OutputBatch) == decode(long, OutputBatch) == OutputBatch(outputs=[out])
    ended = RequestOutput(req_id="b", new_token_ids=[], finished=True, finish_reason="stop",
                          stop_token_id=9)  # fmt: skip
    assert decode(encode(OutputBatch(outputs=[ended])), OutputBatch).outputs == [ended]


def test_a_step_carries_the_cpu_tiers_copies_and_older_messages_still_decode():
    transfers = KVTransfers(
        num_cpu_chunks=64,
        loads=[KVTransfer(3, [7, 8], [12, 13])],
        stores=[KVTransfer(4, [12], [9]), KVTransfer(5, [2], [1])],
        flush=[5],
    )
    with_tier = step()
    with_tier.kv_transfers = transfers
    assert decode(encode(with_tier), StepMessage).kv_transfers == transfers
    # A step or a result without the fields (an older ledger or worker) decodes with none.
    old = raw(step())
    assert "kv_transfers" in old and old["kv_transfers"] is None
    del old["kv_transfers"]
    assert decode(msgpack.packb(old), StepMessage).kv_transfers is None
    result = StepResult(
        step_id=1, epoch="e", worker_id="w", sampled_token_ids={}, transfers_done=[3, 4]
    )
    assert decode(encode(result), StepResult).transfers_done == [3, 4]
    old = raw(StepResult(step_id=1, epoch="e", worker_id="w", sampled_token_ids={}))
    del old["transfers_done"]
    assert decode(msgpack.packb(old), StepResult).transfers_done is None
    # A job is three fields in a row; a malformed one is named.
    bad = raw(with_tier)
    bad["kv_transfers"]["loads"][0][1] = "x"
    with pytest.raises(WireError, match=r"field 'kv_transfers.loads\[0\]\[1\]'"):
        decode(msgpack.packb(bad), StepMessage)


def test_the_tiers_load_costs_travel_in_the_hello_and_the_status_and_older_ones_decode():
    hello = WorkerHello(
        worker_id="w0", group="default", num_gpu_blocks=64, block_size=16, bytes_per_block=32768,
        available_kv_bytes=1 << 21, model_name="m", max_model_len=256, vocab_size=258,
        device="cpu", started_at=1.0, load_s_per_block={TIER_CPU: 4.5e-5},
    )  # fmt: skip
    assert decode(encode(hello), WorkerHello).load_s_per_block == {TIER_CPU: 4.5e-5}
    old = raw(hello)
    del old["load_s_per_block"]  # a worker of an earlier release
    assert decode(msgpack.packb(old), WorkerHello).load_s_per_block is None
    status = LedgerStatus(
        epoch="e.1", started_at=1.0, updated_at=2.0, model_name="m", max_model_len=256,
        vocab_size=258, block_size=16, num_gpu_blocks=63, capacity_line="", hash_algo="sha256",
        num_workers=1, num_cpu_blocks=32,
        shared_tier=SharedTierStatus("fleet-a", "dir", "REMOTE", blocks=7, max_bytes=1 << 30),
        costs=RoutingCosts(prefill_tokens_per_s=2000.0,
                           load_s_per_block={TIER_CPU: 4.5e-5, TIER_SHARED: 2e-3}),
    )  # fmt: skip
    back = decode(encode(status), LedgerStatus)
    assert back.costs is not None
    assert back.costs.load_s_per_block == {TIER_CPU: 4.5e-5, TIER_SHARED: 2e-3}
    assert back.num_cpu_blocks == 32 and back.shared_tier == status.shared_tier
    old = raw(status)
    for name in ("num_cpu_blocks", "shared_tier"):
        del old[name]
    del old["costs"]["load_s_per_block"]  # a ledger of an earlier release
    back = decode(msgpack.packb(old), LedgerStatus)
    assert back.costs is not None and back.costs.load_s_per_block is None
    assert (back.num_cpu_blocks, back.shared_tier) == (0, None)
