from __future__ import annotations

import pytest
import torch

from gpu_worker.checkpoint import load_model
from services.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_url():
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="session")
def tiny_model():
    torch.set_num_threads(1)
    return load_model("default", seed=0)
