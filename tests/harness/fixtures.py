"""Session fixtures shared by the test folders that run the services in process: a real
redis-server on a free loopback port and the seeded tiny model. A folder's conftest imports
them (each folder then gets its own server, as before the tests were sorted by source)."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.checkpoint import load_model
from services.transport.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_url():
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="session")
def tiny_model():
    torch.set_num_threads(1)
    return load_model("tiny", seed=0)
