"""The worker's CPU tier (gpu_worker/offload.py) inside a step: stores copy whole blocks out of
the paged cache after the forward pass (flushed ones before it), loads copy them back before
it, each reported done with the step; copies that do not fit are refused before anything runs."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.runner import StepError
from services.wire.messages import KVTransfer, KVTransfers
from tests.gpu_worker.test_runner_errors import new, step


def with_transfers(message, **transfers):
    message.kv_transfers = KVTransfers(num_cpu_chunks=transfers.pop("chunks", 8), **transfers)
    return message


def blocks(runner, ids: list[int]) -> list[torch.Tensor]:
    return [cache[ids].clone() for layer in runner.kv_caches for cache in layer]


def test_a_stored_block_is_loaded_back_into_another_block_bit_for_bit(make_runner):
    runner = make_runner(num_blocks=16, block_size=4)
    prompt = [256, 1, 2, 3, 4, 5, 6, 7, 8]
    # The prompt's blocks 1 and 2 are stored after the step that computes them.
    out = runner.run_step(
        with_transfers(
            step([new("a", prompt, [1, 2, 3])], scheduled={"a": 9}),
            stores=[KVTransfer(0, [1, 2], [5, 6])],
        )
    )
    assert out.transfers_done == [0] and "a" in out.sampled
    written = blocks(runner, [1, 2])
    # Another request reuses blocks 1 and 2 after a, which is finished: load its chunks into
    # blocks 9 and 10 before a step that computes nothing else.
    loaded = runner.run_step(
        with_transfers(step(finished=["a"]), loads=[KVTransfer(1, [5, 6], [9, 10])])
    )
    assert loaded.transfers_done == [1] and loaded.sampled == {}
    assert all(torch.equal(a, b) for a, b in zip(blocks(runner, [9, 10]), written, strict=True))
    # A request with the same prompt computes only its last token over the loaded blocks and
    # samples what a computed its first output to be.
    again = runner.run_step(step([new("b", prompt, [9, 10, 11], computed=8)], scheduled={"b": 1}))
    assert again.sampled == {"b": out.sampled["a"]}
    assert runner.host_tier is not None and runner.host_tier.blocks_loaded == 2


def test_a_flushed_store_reads_its_block_before_the_step_overwrites_it(make_runner):
    runner = make_runner(num_blocks=16, block_size=4)
    runner.run_step(step([new("a", [256, 1, 2, 3, 4], [1, 2])], scheduled={"a": 5}))
    before = blocks(runner, [1])
    # Block 1 goes to a new request in the same step that stores it: flushed, it keeps a's KV.
    out = runner.run_step(
        with_transfers(
            step([new("b", [256, 9, 9, 9, 9], [1, 3])], scheduled={"b": 5}, finished=["a"]),
            stores=[KVTransfer(4, [1], [0])],
            flush=[4],
        )
    )
    assert out.transfers_done == [4]
    assert not torch.equal(blocks(runner, [1])[0], before[0])  # b wrote over it
    assert runner.host_tier is not None
    stored = [buffer[[0]] for layer in runner.host_tier.buffers for buffer in layer]
    assert all(torch.equal(a, b) for a, b in zip(stored, before, strict=True))


@pytest.mark.parametrize(
    "transfers, named",
    [
        ({"loads": [KVTransfer(1, [8], [2])]}, "load job 1: id 8 is outside 0..7"),
        ({"loads": [KVTransfer(1, [0], [16])]}, r"load job 1: id 16 is outside 0\.\.15"),
        ({"stores": [KVTransfer(2, [1, 2], [3])]}, "store job 2: 2 sources, 1 targets"),
        ({"stores": [KVTransfer(2, [1], [3])], "flush": [5]}, "flush of job 5"),
    ],
)
def test_copies_that_do_not_fit_are_refused_before_anything_runs(make_runner, transfers, named):
    runner = make_runner(num_blocks=16, block_size=4)
    cache = runner.kv_caches[0][0].clone()
    with pytest.raises(StepError, match=f"CPU tier: {named}"):
        runner.run_step(
            with_transfers(step([new("a", [256, 1, 2], [1])], scheduled={"a": 3}), **transfers)
        )
    assert torch.equal(runner.kv_caches[0][0], cache) and not runner.requests


def test_the_buffer_is_made_at_the_tiers_size_and_kept(make_runner):
    runner = make_runner(num_blocks=16, block_size=4)
    assert runner.host_tier is None
    runner.run_step(with_transfers(step(), chunks=3))
    tier = runner.host_tier
    assert tier is not None and tier.num_chunks == 3
    bytes_per_block = sum(k[0].nbytes + v[0].nbytes for k, v in runner.kv_caches)
    assert tier.bytes_per_chunk == bytes_per_block
    runner.run_step(with_transfers(step(epoch="e2"), chunks=3))
    assert runner.host_tier is tier
