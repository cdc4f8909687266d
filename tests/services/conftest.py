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
    return load_model("tiny", seed=0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The long fuzz runs only when asked for by name: `-m fuzz`."""
    if "fuzz" in (config.getoption("markexpr") or ""):
        return
    long_runs = [item for item in items if item.get_closest_marker("fuzz")]
    if long_runs:
        config.hook.pytest_deselected(items=long_runs)
        items[:] = [item for item in items if not item.get_closest_marker("fuzz")]
