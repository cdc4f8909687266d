"""Our side of the offloading differentials: ledger.offloading's manager behind offload_replay,
its connector behind offload_sim."""

from __future__ import annotations

from typing import Any

from ledger.block import KVCacheBlock
from ledger.events import KVEventBatch, encode_batch
from ledger.offloading.base import RequestContext
from ledger.offloading.connector import OffloadingConnectorScheduler
from ledger.offloading.events import to_kv_events
from ledger.offloading.manager import CPUOffloadingManager
from ledger.offloading.policies import ARCPolicy, LRUPolicy
from ledger.request import Request, RequestStatus
from ledger.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tests.oracle.offload_replay import key_bytes
from tests.oracle.offload_sim import KV_BYTES_PER_TOKEN


class LedgerOffloadBackend:
    def __init__(self, config: dict[str, Any]) -> None:
        self.manager = CPUOffloadingManager(
            config["num_chunks"],
            config["policy"],
            enable_events=True,
            store_threshold=config["store_threshold"],
            max_tracker_size=config["max_tracker_size"],
        )
        self.contexts: dict[str, RequestContext] = {}
        self.number: dict[bytes, int] = {}

    def _keys(self, keys: list[int]) -> list[bytes]:
        out = []
        for key in keys:
            raw = key_bytes(key)
            self.number[raw] = key
            out.append(raw)
        return out

    def _ints(self, keys: list[bytes]) -> list[int]:
        return [self.number[key] for key in keys]

    def new(self, rid: str, keys: list[int], positions: list[int] | None) -> None:
        context = self.contexts[rid] = RequestContext(rid)
        if positions is not None:
            for key, position in zip(self._keys(keys), positions, strict=True):
                context.set_position(key, position)
        self.manager.on_new_request(context)

    def lookup(self, rid: str, key: int) -> str:
        return self.manager.lookup(self._keys([key])[0], self.contexts[rid]).name

    def prepare_load(self, rid: str, keys: list[int]) -> list[int]:
        return self.manager.prepare_load(self._keys(keys), self.contexts[rid])

    def complete_load(self, rid: str, keys: list[int]) -> None:
        self.manager.complete_load(self._keys(keys), self.contexts[rid])

    def touch(self, rid: str, keys: list[int]) -> None:
        self.manager.touch(self._keys(keys), self.contexts[rid])

    def prepare_store(self, rid: str, keys: list[int]) -> list | None:
        out = self.manager.prepare_store(self._keys(keys), self.contexts[rid])
        if out is None:
            return None
        return [self._ints(out.keys_to_store), out.chunk_ids, self._ints(out.evicted_keys)]

    def complete_store(self, rid: str, keys: list[int], success: bool) -> None:
        self.manager.complete_store(self._keys(keys), self.contexts[rid], success)

    def finish(self, rid: str) -> None:
        self.manager.on_request_finished(self.contexts[rid])

    def reset(self) -> None:
        self.manager.reset_cache()

    def take_events(self) -> tuple[list, str]:
        events = self.manager.take_events()
        raw = [[e.removed, e.metadata_only, e.medium, self._ints(e.keys)] for e in events]
        kv = to_kv_events(events)
        return raw, encode_batch(KVEventBatch(ts=0.0, events=kv)).hex() if kv else ""

    def probe(self) -> dict[str, Any]:
        manager, policy = self.manager, self.manager.policy
        chunks = sorted(
            [self.number[key], chunk.ref_cnt, chunk.chunk_id]
            for key in self.number
            if (chunk := policy.get(key)) is not None
        )
        if isinstance(policy, LRUPolicy):
            order: list = sorted(policy.evictable, key=lambda k: (policy.ranks[k], k))
            order = self._ints(order)
        else:
            assert isinstance(policy, ARCPolicy)
            order = [
                self._ints(list(keys)) for keys in (policy.t1, policy.t2, policy.b1, policy.b2)
            ]
            order.append(policy.target_t1_size)
        counts = [manager.num_evictable, manager.num_write_pending, manager.num_free_chunks()]
        return {"chunks": chunks, "counts": counts, "order": order}


_STATUS = {
    "waiting_for_kvs": RequestStatus.WAITING,  # the ledger has no separate waiting-for-load
    "running": RequestStatus.RUNNING,
    "preempted": RequestStatus.PREEMPTED,
    "length": RequestStatus.FINISHED_LENGTH_CAPPED,
    "aborted": RequestStatus.FINISHED_ABORTED,
}


class LedgerConnectorBackend:
    """ledger.offloading.connector behind offload_sim.Backend."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.block_size = cfg["block_size"]
        manager = CPUOffloadingManager(cfg["num_chunks"], cfg["policy"], enable_events=True)
        self.sched = OffloadingConnectorScheduler(
            manager,
            self.block_size,
            num_workers=cfg["num_workers"],
            sync_load_budget_bytes=cfg.get("sync_load_budget_bytes", 0),
            kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        )
        self.reqs: dict[str, Request] = {}
        self.step = 0

    def add(self, rid: str, prompt: list[int], hashes: list[bytes]) -> None:
        request: Request = Request(rid, prompt, 1 << 20, block_size=self.block_size)
        request.block_hashes.extend(hashes)
        self.reqs[rid] = request
        self.sched.on_new_request(request)

    def append(self, rid: str, token: int, hashes: list[bytes]) -> None:
        request = self.reqs[rid]
        request.append_output_token_ids(token)
        request.block_hashes.extend(hashes[len(request.block_hashes) :])

    def set_state(self, rid: str, status: str, num_computed: int) -> None:
        self.reqs[rid].status = _STATUS[status]
        self.reqs[rid].num_computed_tokens = num_computed

    def matched(self, rid: str, num_local: int) -> list:
        return list(self.sched.get_num_new_matched_tokens(self.reqs[rid], num_local))

    def after_alloc(self, rid: str, blocks: list[list], num_external: int) -> None:
        table = []
        for block_id, hashed in blocks:
            block = KVCacheBlock(block_id)
            if hashed:
                block.block_hash = b"cached"
            table.append(block)
        self.sched.update_state_after_alloc(self.reqs[rid], table, num_external)

    def build_meta(self, new, cached, num_scheduled, finished, preempted) -> dict[str, Any]:
        output: SchedulerOutput = SchedulerOutput(
            step_id=self.step,
            scheduled_new_reqs=[
                NewRequestData(self.reqs[r], [], list(b), self.reqs[r].num_computed_tokens)
                for r, b in new
            ],
            scheduled_cached_reqs=[
                CachedRequestData(
                    request=self.reqs[r],
                    new_token_ids=(),
                    new_block_ids=tuple(b),
                    num_computed_tokens=self.reqs[r].num_computed_tokens,
                )
                for r, b in cached
            ],
            num_scheduled_tokens=dict(num_scheduled),
            finished_req_ids=set(finished),
            preempted_req_ids=list(preempted),
        )
        self.step += 1
        meta = self.sched.build_connector_meta(output)
        loads = [
            [job_id, job.req_id, job.src, job.dst, [job.first_block_index], job.sync]
            for job_id, job in meta.load_jobs.items()
        ]
        stores = [
            [job_id, job.req_id, job.src, job.dst, [job.first_block_index]]
            for job_id, job in meta.store_jobs.items()
        ]
        return {"loads": loads, "stores": stores, "flush": sorted(meta.jobs_to_flush)}

    def output(self, completed: list) -> None:
        self.sched.update_connector_output(dict(completed))

    def request_finished(self, rid: str) -> None:
        assert self.sched.request_finished(self.reqs[rid]) == (False, None)

    def reset(self) -> None:
        self.sched.reset_cache()

    def events(self) -> str:
        events = self.sched.take_events()
        return encode_batch(KVEventBatch(ts=0.0, events=events)).hex() if events else ""

    def probe(self) -> list:
        policy = self.sched.manager.policy
        chunks = policy.chunks if isinstance(policy, LRUPolicy) else {**policy.t1, **policy.t2}
        states = sorted([key.hex()[:16], c.ref_cnt, c.chunk_id] for key, c in chunks.items())
        return [states, sorted(self.sched.jobs), sorted(self.sched.requests)]
