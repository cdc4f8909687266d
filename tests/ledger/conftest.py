from __future__ import annotations

import pytest

from ledger.hashing import BlockHasher
from ledger.kv_cache_manager import KVCacheManager
from ledger.request import Request


@pytest.fixture(params=["sha256", "sha256_cbor"])
def hasher(request) -> BlockHasher:
    return BlockHasher(request.param, seed="vllm-none-hash")


@pytest.fixture
def make_request(hasher):
    def make(request_id: str, token_ids, max_tokens: int = 17, **kwargs) -> Request:
        return Request(
            request_id, list(token_ids), max_tokens, block_hasher=hasher, eos_token_id=100, **kwargs
        )

    return make


def admit(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None):
    """get_computed_blocks + allocate_slots, as the scheduler's waiting pass does."""
    hits, num_hit = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit
    blocks = manager.allocate_slots(request, num_new_tokens, num_hit, hits)
    if blocks is not None:
        request.num_computed_tokens = num_hit
    return hits, num_hit, blocks


def free_order(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
