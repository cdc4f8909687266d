"""The KV cache manager: the scheduler's one entry point to the pool (vLLM's KVCacheManager).

One full-attention KV cache group, so the coordinator and single-type manager of vLLM fold into
this class. `allocate_slots` counts first and changes nothing until it knows the blocks fit;
`free` returns a request's blocks tail first so the head of a shared prefix survives longest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from ledger.block import KVCacheBlock
from ledger.block_pool import BlockPool, Eviction
from ledger.capacity import cdiv
from ledger.events import AnyKVCacheEvent
from ledger.hashing import block_extra_keys, to_event_extra_keys
from ledger.request import Request, RequestStatus

_ADMITTING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
_RUNNING = RequestStatus.RUNNING


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache lookups, in tokens (vllm:prefix_cache_queries / _hits).

    Resumed (previously preempted) requests are counted apart, as vLLM does, so a preemption
    storm does not inflate the hit rate with the request's own recomputed blocks.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    resets: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        *,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        watermark: float = 0.0,
        record_evictions: bool = False,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(
            num_blocks, enable_caching, enable_kv_cache_events, record_evictions
        )
        # Minimum free blocks kept when admitting waiting/preempted requests, against thrash.
        self.watermark_blocks = int(watermark * num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks are already cached (hashed and findable).
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # Why the last allocate_slots returned None: "blocks", or "watermark" when the blocks
        # would have fit without it. Information only: set on the refusing path, read by no
        # decision.
        self.last_refusal = "blocks"

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks from the start of the request.

        Never the whole prompt: the last token is always recomputed to get its logits, so the
        hit stops at `num_tokens - 1` (which may cost a whole block, as the hit is block-aligned).
        """
        if not self.prefix_cache_lookup_enabled(request):
            return [], 0
        limit = (request.num_tokens - 1) // self.block_size
        get = self.block_pool.cached_block_hash_to_block.get_one_block
        hits: list[KVCacheBlock] = []
        for block_hash in islice(request.block_hashes, limit):
            block = get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if self.prefix_cache_lookup_enabled(request):  # as vLLM: a skipped lookup is no query
            self.prefix_cache_stats.record(
                request.num_tokens, num_hits, request.num_preemptions > 0
            )

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
        *,
        full_sequence_must_fit: bool = False,
        has_scheduled_reqs: bool = True,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        reserved_blocks: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Give the request slots for `num_new_tokens` more tokens; None if they do not fit.

        ```
        | comp | new_comp | ext_comp | new | lookahead |
          comp      = request.num_computed_tokens (blocks already held)
          new_comp  = num_new_computed_tokens (prefix-cache hit adopted by this call)
          ext_comp  = num_external_computed_tokens (the CPU tier loads them into new blocks)
          new       = num_new_tokens (computed this step)
        ```
        Allocated: everything after `comp + new_comp`. Cached afterwards: full blocks up to
        min(comp + new_comp + ext_comp + new, request.num_tokens), unless `delay_cache_blocks`
        (a load still to come: they are cached once it is done); `reserved_blocks` stay free
        for requests that hold blocks without running (loads). Nothing changes when it returns
        None.
        """
        if (
            num_new_tokens == 0
            and num_new_computed_tokens == 0
            and not num_external_computed_tokens
        ):
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt"
            )
        request_id = request.request_id
        held = self.req_to_blocks.get(request_id)
        block_size, max_model_len = self.block_size, self.max_model_len
        if (
            held is not None
            and request.status is _RUNNING
            and not new_computed_blocks
            and not num_new_computed_tokens
            and not num_lookahead_tokens
            and not full_sequence_must_fit
            and not num_external_computed_tokens
        ):
            # A running request that stays within the blocks it holds (most decode steps):
            # no watermark (it is not admitting), no block to take, so it always fits.
            num_computed = request.num_computed_tokens
            num_tokens = num_computed + num_new_tokens
            if num_computed <= max_model_len and num_tokens <= len(held) * block_size:
                if num_tokens > len(request.all_token_ids):
                    num_tokens = len(request.all_token_ids)
                if num_tokens // block_size > self.num_cached_block.get(request_id, 0):
                    self.cache_blocks(request, num_tokens)
                return []
        num_held = len(held) if held is not None else 0
        num_computed = (
            request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        )
        if num_computed > max_model_len:
            num_computed = max_model_len
        watermark = 0
        if has_scheduled_reqs and self.watermark_blocks and request.status in _ADMITTING:
            watermark = self.watermark_blocks
        num_free = self.block_pool.free_block_queue.num_free_blocks - reserved_blocks
        if new_computed_blocks:
            # Free hit blocks leave the free queue when touched, so they count against capacity.
            num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
            num_hits = len(new_computed_blocks)
        else:
            num_evictable_hits = num_hits = 0

        if full_sequence_must_fit:
            # The admission gate: the whole sequence must fit, not only this chunk.
            full = cdiv(min(request.num_tokens, max_model_len), block_size)
            needed = max(full - num_held - num_hits, 0) + num_evictable_hits
            if needed + watermark > num_free:
                self.last_refusal = "watermark" if needed <= num_free else "blocks"
                return None

        num_tokens_need_slot = num_computed + num_new_tokens + num_lookahead_tokens
        if num_tokens_need_slot > max_model_len:
            num_tokens_need_slot = max_model_len
        # cdiv(num_tokens_need_slot, block_size) inlined: once per request per step
        num_new_blocks = -(-num_tokens_need_slot // block_size) - num_held - num_hits
        if num_new_blocks < 0:
            num_new_blocks = 0
        if num_new_blocks + num_evictable_hits + watermark > num_free:
            self.last_refusal = (
                "watermark" if num_new_blocks + num_evictable_hits <= num_free else "blocks"
            )
            return None

        # It fits: from here on, change things.
        if held is None:
            held = self.req_to_blocks[request_id] = []
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            held.extend(new_computed_blocks)
            self.num_cached_block[request_id] = len(held)
        if num_new_blocks:
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
            held.extend(new_blocks)
        else:
            new_blocks = []
        if delay_cache_blocks:
            return new_blocks
        num_tokens = num_computed + num_new_tokens
        if num_tokens > len(request.all_token_ids):
            num_tokens = len(request.all_token_ids)
        # Most decode steps fill no block: skip the call when nothing can become cacheable.
        if num_tokens // block_size > self.num_cached_block.get(request_id, 0):
            self.cache_blocks(request, num_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash and publish the request's blocks that are full within its first `num_tokens`."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = min(num_tokens, len(request.block_hashes) * self.block_size) // self.block_size
        if num_cached >= num_full:
            return
        pool = self.block_pool
        extra = None
        if pool.enable_kv_cache_events:
            extra = [
                to_event_extra_keys(block_extra_keys(i, request.cache_salt, request.lora))
                for i in range(num_cached, num_full)
            ]
        pool.cache_full_blocks(
            self.req_to_blocks[request_id],
            request.block_hashes,
            num_cached,
            num_full,
            self.block_size,
            request.all_token_ids,
            request_id,
            event_extra_keys=extra,
            lora_name=request.lora[0] if request.lora else None,
            lora_id=request.lora_id,
        )
        self.num_cached_block[request_id] = num_full

    def free(self, request: Request) -> int:
        """Return the request's blocks, tail first, so the tail of a prefix is evicted first.

        Returns how many blocks the request held.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))
        return len(blocks)

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats.resets += 1
        return True

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def take_events(self) -> list[AnyKVCacheEvent]:
        return self.block_pool.take_events()

    def take_evictions(self) -> list[Eviction]:
        return self.block_pool.take_evictions()
