"""A hypothesis state machine drives random admit/grow/finish/preempt/abort/reset sequences and
checks the pool's invariants after every step, including that the KV events replay to exactly
the cached hash set."""

from __future__ import annotations

from collections import Counter

import hypothesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ledger.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from ledger.hashing import BlockHasher, to_event_hash
from ledger.kv_cache_manager import KVCacheManager
from ledger.request import Request, RequestStatus
from ledger.scheduler import Scheduler, SchedulerConfig

BLOCK_SIZE = 4
NUM_BLOCKS = 12
PREFIXES = [tuple(range(100 * p, 100 * p + 12)) for p in range(3)]


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        manager = KVCacheManager(
            NUM_BLOCKS, BLOCK_SIZE, 44, enable_kv_cache_events=True, record_evictions=True
        )
        self.scheduler = Scheduler(
            SchedulerConfig(max_model_len=44, max_num_seqs=6, max_num_batched_tokens=24), manager
        )
        self.manager = manager
        self.hasher = BlockHasher("sha256_cbor", seed="machine")
        self.index: Counter[int] = Counter()  # what a subscriber replaying the events believes
        self.next_id = 0

    def _replay_events(self) -> None:
        # Through the wire format, as a subscriber would see them.
        batch = decode_batch(encode_batch(KVEventBatch(0.0, self.manager.take_events())))
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.index.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    assert self.index[h] > 0, "BlockRemoved for a hash the subscriber never saw"
                    self.index[h] -= 1
            elif isinstance(event, AllBlocksCleared):
                self.index.clear()
        self.index = +self.index

    @rule(
        prefix=st.sampled_from(PREFIXES),
        prefix_len=st.integers(0, 12),
        suffix=st.lists(st.integers(0, 3), max_size=10),
        max_tokens=st.integers(1, 20),
        salt=st.sampled_from([None, None, "t1"]),
        priority=st.integers(0, 2),
    )
    def add_request(self, prefix, prefix_len, suffix, max_tokens, salt, priority):
        tokens = list(prefix[:prefix_len]) + suffix
        if not tokens:
            tokens = [1]
        self.next_id += 1
        request = Request(
            f"r{self.next_id}",
            tokens,
            max_tokens,
            block_hasher=self.hasher,
            cache_salt=salt,
            priority=priority,
            eos_token_id=3,
            arrival_time=float(self.next_id),
        )
        self.scheduler.add_request(request)

    @rule(token=st.integers(0, 9), repeat=st.integers(1, 4))
    def steps(self, token, repeat):
        for _ in range(repeat):
            self.step(token)

    def step(self, token):
        out = self.scheduler.schedule()
        for new in out.scheduled_new_reqs:
            assert new.block_ids == self.manager.get_block_ids(new.request.request_id)
            assert 0 not in new.block_ids
        sampled = {
            rid: token
            for rid in out.num_scheduled_tokens
            if self.scheduler.requests[rid].num_computed_tokens
            >= self.scheduler.requests[rid].num_tokens
        }
        self.scheduler.update_from_output(out, sampled)
        if out.preemptions:
            hypothesis.event("preempted")
        if out.evictions:
            hypothesis.event("evicted")
        self._replay_events()

    @rule(data=st.data())
    def abort(self, data):
        if self.scheduler.requests:
            victim = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
            self.scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            self._replay_events()

    @rule()
    def reset_prefix_cache(self):
        held = any(self.manager.req_to_blocks.values())
        assert self.manager.reset_prefix_cache() is not held
        self._replay_events()

    @invariant()
    def blocks_are_free_xor_held_by_exactly_their_holders(self):
        pool = self.manager.block_pool
        holders: Counter[int] = Counter()
        for request_id, blocks in self.manager.req_to_blocks.items():
            assert request_id in self.scheduler.requests
            holders.update(b.block_id for b in blocks)
        free_ids = [b.block_id for b in pool.free_block_queue]
        assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
        assert 0 not in holders and 0 not in free_ids  # the null block is never lent
        for block in pool.blocks[1:]:
            if block.block_id in holders:
                assert block.ref_cnt == holders[block.block_id] and block.block_id not in free_ids
            else:
                assert block.ref_cnt == 0 and block.block_id in free_ids
        assert 0.0 <= self.manager.usage <= 1.0

    @invariant()
    def hash_map_and_block_hashes_agree(self):
        pool = self.manager.block_pool
        mapped = []
        for block_hash in list(pool.cached_block_hash_to_block.keys()):
            for block in pool.cached_block_hash_to_block.blocks_for(block_hash):
                assert block.block_hash == block_hash
                mapped.append(block.block_id)
        hashed = [b.block_id for b in pool.blocks if b.block_hash is not None]
        assert sorted(mapped) == sorted(hashed)

    @invariant()
    def events_replay_to_the_cached_hash_set(self):
        pool = self.manager.block_pool
        self._replay_events()
        cached = Counter(
            to_event_hash(b.block_hash) for b in pool.blocks if b.block_hash is not None
        )
        assert self.index == cached

    @invariant()
    def running_requests_hold_their_computed_tokens(self):
        for request in self.scheduler.running:
            blocks = self.manager.req_to_blocks.get(request.request_id, [])
            assert request.num_computed_tokens <= request.num_tokens
            assert len(blocks) * BLOCK_SIZE >= request.num_computed_tokens


LedgerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_ledger_state_machine = LedgerMachine.TestCase
