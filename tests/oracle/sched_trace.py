"""Our side of the scheduler-level differential: the ledger's Scheduler behind the harness.

`run_ledger` drives a workload (sched_workloads) through `sched_harness.drive`, the loop that
`vllm_sched_driver.py` runs against vLLM's own scheduler.
"""

from __future__ import annotations

from typing import Any

from ledger.events import KVEventBatch, encode_batch
from ledger.hashing import BlockHasher
from ledger.kv_cache_manager import KVCacheManager
from ledger.request import Request, RequestStatus
from ledger.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tests.oracle.ledger_backend import none_hash_seed
from tests.oracle.sched_harness import EOS, drive


def step_record(
    scheduled: list[list[Any]],
    full_tables: dict[str, list[int]],
    new_blocks: dict[str, list[int]],
    preempted: list[str],
    finished: list[str],
) -> dict[str, Any]:
    """One schedule() call, side-neutral: vLLM sends resumed requests as cached ones, we as new
    ones, so each request's blocks are either its whole table or the blocks new this step."""
    return {
        "scheduled": scheduled,  # [rid, num_new_tokens, num_computed_tokens] in batch order
        "full_tables": dict(sorted(full_tables.items())),
        "new_blocks": dict(sorted(new_blocks.items())),
        "preempted": sorted(preempted),
        "finished": sorted(finished),
    }


class LedgerScheduler:
    """sched_harness.Backend over our Scheduler and KVCacheManager."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.block_size = config["block_size"]
        self.hasher = BlockHasher(config["hash_algo"], seed=none_hash_seed(config))
        self.manager = KVCacheManager(
            config["num_blocks"],
            self.block_size,
            config["max_model_len"],
            enable_caching=config["enable_prefix_caching"],
            enable_kv_cache_events=True,
            watermark=config["watermark"],
        )
        self.scheduler: Scheduler[None] = Scheduler(
            SchedulerConfig(
                max_model_len=config["max_model_len"],
                max_num_seqs=config["max_num_seqs"],
                max_num_batched_tokens=config["max_num_batched_tokens"],
                enable_chunked_prefill=config["enable_chunked_prefill"],
                policy=config["policy"],
                long_prefill_token_threshold=config["long_prefill_token_threshold"],
                async_scheduling=config["async_scheduling"],
            ),
            self.manager,
        )

    def add(self, spec: dict[str, Any], index: int) -> None:
        self.scheduler.add_request(
            Request(
                spec["rid"],
                spec["prompt"],
                spec["max_tokens"],
                eos_token_id=EOS,
                stop_token_ids=spec["stop_token_ids"],
                priority=spec["priority"],
                arrival_time=float(index),
                cache_salt=spec["salt"],
                block_hasher=self.hasher,
                block_size=self.block_size,
            )
        )

    def abort(self, rids: list[str]) -> list[str]:
        finished = self.scheduler.finish_requests(rids, RequestStatus.FINISHED_ABORTED)
        return sorted(r.request_id for r in finished)

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def schedule(self) -> tuple[SchedulerOutput, dict[str, Any], list[str]]:
        out = self.scheduler.schedule()
        computed = {n.request.request_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        for cached in out.scheduled_cached_reqs:
            computed[cached.request.request_id] = cached.num_computed_tokens
        record = step_record(
            scheduled=[[rid, n, computed[rid]] for rid, n in out.num_scheduled_tokens.items()],
            full_tables={n.request.request_id: n.block_ids for n in out.scheduled_new_reqs},
            new_blocks={
                c.request.request_id: list(c.new_block_ids) for c in out.scheduled_cached_reqs
            },
            preempted=out.preempted_req_ids,
            finished=list(out.finished_req_ids),
        )
        return out, record, sorted(out.sampling_req_ids)

    def update(self, step: SchedulerOutput, sampled: dict[str, int]) -> list[list[Any]]:
        return [
            [u.request.request_id, list(u.new_token_ids), u.finish_reason]
            for u in self.scheduler.update_from_output(step, sampled)
        ]

    def num_tokens(self, rid: str) -> int | None:
        request = self.scheduler.requests.get(rid)
        return None if request is None else request.num_tokens

    def state(self, ts: float) -> dict[str, Any]:
        pool = self.manager.block_pool
        return {
            "events": encode_batch(KVEventBatch(ts=ts, events=self.manager.take_events())).hex(),
            "free_queue": [b.block_id for b in pool.free_block_queue],
            "ref_cnts": [b.ref_cnt for b in pool.blocks],
        }


def run_ledger(workload: dict) -> list[dict]:
    backend = LedgerScheduler(workload["config"])
    records = drive(workload, backend)
    # Everything ends free: no request holds a block once the workload is done.
    assert not backend.manager.req_to_blocks, "blocks still held after the workload"
    return records
