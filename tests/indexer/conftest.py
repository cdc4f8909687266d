"""Fixtures: a real redis-server and the seeded tiny model (tests/harness/fixtures.py)."""

from tests.harness.fixtures import redis_url, tiny_model

__all__ = ["redis_url", "tiny_model"]
