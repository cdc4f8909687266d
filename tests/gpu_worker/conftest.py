"""Shared fixtures of the worker tests: the seeded default model and runners over it."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.checkpoint import load_model
from gpu_worker.model import LlamaForCausalLM
from gpu_worker.runner import ModelRunner
from tests.harness.fixtures import redis_url


@pytest.fixture(autouse=True)
def one_torch_thread():
    # The models here are tiny: one intra-op thread is faster and, on two shared cores, far
    # steadier (30x in practice) than two threads spinning against each other.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model() -> LlamaForCausalLM:
    return load_model("tiny", seed=0)


@pytest.fixture
def make_runner(tiny_model: LlamaForCausalLM):
    """A runner over the default model with a small cache (block size 4 crosses many blocks)."""

    def make(num_blocks: int = 64, block_size: int = 4, seed: int = 0) -> ModelRunner:
        return ModelRunner(tiny_model, num_blocks, block_size, seed=seed)

    return make


__all__ = ["redis_url"]  # the step loop's tests run over a real redis-server
