"""Fixtures: a real redis-server and the seeded tiny model (tests/harness/fixtures.py); the
Redis sizing fill (`redis_sizing`, over a gigabyte) runs only when -m names it."""

import pytest

from tests.harness.fixtures import redis_url, tiny_model

__all__ = ["redis_url", "tiny_model"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "redis_sizing" in (config.getoption("markexpr") or ""):
        return
    sizing = [item for item in items if item.get_closest_marker("redis_sizing")]
    if sizing:
        config.hook.pytest_deselected(items=sizing)
        items[:] = [item for item in items if not item.get_closest_marker("redis_sizing")]
