"""Fixtures: a real redis-server and the seeded tiny model (tests/harness/fixtures.py); the
Redis sizing fill (`redis_sizing`, over a gigabyte) runs only when -m names it."""

from tests.harness.fixtures import redis_url, tiny_model

__all__ = ["redis_url", "tiny_model"]
