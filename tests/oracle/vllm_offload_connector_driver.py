"""vLLM's side of the connector differential: runs *inside vLLM 0.33's venv*, PYTHONHASHSEED=0.

Usage: python vllm_offload_connector_driver.py IN.json OUT.json. IN is {"workloads": [...]}
(offload_sim.generate_workload); each runs through offload_sim.Loop against the scheduler side
of vLLM's own OffloadingConnector (OffloadingConnectorScheduler, CPU backend), built from a
VllmConfig with kv_transfer_config set as `--kv-offloading-size` and `--kv-transfer-config` do.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import msgspec
import vllm
from offload_sim import KV_BYTES_PER_TOKEN, Loop
from vllm.config import (
    CacheConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_events import KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus
from vllm_driver import kv_cache_config
from vllm_sched_driver import TINY_LLAMA

_ENCODE = msgspec.msgpack.Encoder().encode
# The CPU tier's chunk of one block here (FullAttentionSpec(16, 1 head, size 1, float32): 8 bytes
# per token) rounds up to one page.
PAGE = 4096
STATUS = {
    "waiting_for_kvs": RequestStatus.WAITING_FOR_REMOTE_KVS,
    "running": RequestStatus.RUNNING,
    "preempted": RequestStatus.PREEMPTED,
    "length": RequestStatus.FINISHED_LENGTH_CAPPED,
    "aborted": RequestStatus.FINISHED_ABORTED,
}


class VllmConnectorBackend:
    def __init__(self, cfg: dict[str, Any], model_dir: str) -> None:
        bs = cfg["block_size"]
        model = ModelConfig(
            model=model_dir, skip_tokenizer_init=True, max_model_len=1024, dtype="float32"
        )
        cache = CacheConfig(block_size=bs, enable_prefix_caching=True)
        cache.num_gpu_blocks = cfg["num_gpu_blocks"]
        extra = {
            "cpu_bytes_to_use": cfg["num_chunks"] * PAGE,
            "eviction_policy": cfg["policy"],
            "sync_load_budget_bytes": cfg.get("sync_load_budget_bytes", 0),
        }
        vllm_config = VllmConfig(
            model_config=model,
            scheduler_config=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=1024,
                max_model_len=1024,
                is_encoder_decoder=False,
            ),
            cache_config=cache,
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config=extra,
            ),
        )
        # Each worker reports its own completions: num_workers is the world size.
        vllm_config.parallel_config.world_size = cfg["num_workers"]
        connector = OffloadingConnector(
            vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config(cfg["num_gpu_blocks"], bs)
        )
        self.sched = connector.connector_scheduler
        assert self.sched.manager._num_chunks == cfg["num_chunks"]
        assert self.sched.config.num_workers == cfg["num_workers"]
        assert self.sched.config.kv_bytes_per_token == KV_BYTES_PER_TOKEN
        self.reqs: dict[str, Request] = {}

    def add(self, rid: str, prompt: list[int], hashes: list[bytes]) -> None:
        request = Request(rid, list(prompt), SamplingParams(max_tokens=1 << 20), None)
        request.block_hashes.extend(hashes)
        self.reqs[rid] = request
        self.sched.on_new_request(request)

    def append(self, rid: str, token: int, hashes: list[bytes]) -> None:
        request = self.reqs[rid]
        request.append_output_token_ids(token)
        request.block_hashes.extend(hashes[len(request.block_hashes) :])

    def set_state(self, rid: str, status: str, num_computed: int) -> None:
        self.reqs[rid].status = STATUS[status]
        self.reqs[rid].num_computed_tokens = num_computed

    def matched(self, rid: str, num_local: int) -> list:
        return list(self.sched.get_num_new_matched_tokens(self.reqs[rid], num_local))

    def after_alloc(self, rid: str, blocks: list[list], num_external: int) -> None:
        table = []
        for block_id, hashed in blocks:
            block = KVCacheBlock(block_id)
            if hashed:
                block._block_hash = b"cached"
            table.append(block)
        self.sched.update_state_after_alloc(self.reqs[rid], KVCacheBlocks((table,)), num_external)

    def build_meta(self, new, cached, num_scheduled, finished, preempted) -> dict[str, Any]:
        output = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),)) for r, b in new],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[r for r, _ in cached],
                new_block_ids=[(list(b),) if b else None for _, b in cached],
                resumed_req_ids=set(),
            ),
            num_scheduled_tokens=dict(num_scheduled),
            finished_req_ids=set(finished),
            preempted_req_ids=set(preempted),
            kv_cache_block_copies=None,
            kv_connector_block_state=None,
        )
        meta = self.sched.build_connector_meta(output)
        loads = [
            [
                job_id,
                job.req_id,
                [int(x) for x in job.src_spec.block_ids],
                [int(x) for x in job.dst_spec.block_ids],
                list(job.dst_spec.block_indices),
                job.sync,
            ]
            for job_id, job in meta.load_jobs.items()
        ]
        stores = [
            [
                job_id,
                job.req_id,
                [int(x) for x in job.src_spec.block_ids],
                [int(x) for x in job.dst_spec.block_ids],
                list(job.src_spec.block_indices),
            ]
            for job_id, job in meta.store_jobs.items()
        ]
        return {"loads": loads, "stores": stores, "flush": sorted(meta.jobs_to_flush or ())}

    def output(self, completed: list) -> None:
        worker_meta = OffloadingWorkerMetadata(completed_jobs=dict(completed))
        self.sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker_meta))

    def request_finished(self, rid: str) -> None:
        assert self.sched.request_finished(self.reqs[rid]) == (False, None)

    def reset(self) -> None:
        self.sched.reset_cache()

    def events(self) -> str:
        events = list(self.sched.take_events())
        return _ENCODE(KVEventBatch(ts=0.0, events=events)).hex() if events else ""

    def probe(self) -> list:
        manager = self.sched.manager
        policy = manager._policy
        chunks = policy.chunks if hasattr(policy, "chunks") else {**policy.t1, **policy.t2}
        states = sorted([key.hex()[:16], c.ref_cnt, c.chunk_id] for key, c in chunks.items())
        return [states, sorted(self.sched._jobs), sorted(self.sched._req_status)]


def main() -> None:
    assert os.environ.get("PYTHONHASHSEED") == "0", "set orders must match the ledger's run"
    source, target = sys.argv[1], sys.argv[2]
    with open(source) as f:
        workloads = json.load(f)["workloads"]
    model_dir = tempfile.mkdtemp()
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    results = []
    for workload in workloads:
        results.append(Loop(VllmConnectorBackend(workload["config"], model_dir), workload).run())
    with open(target, "w") as f:
        json.dump({"vllm": vllm.__version__, "results": results}, f)


if __name__ == "__main__":
    main()
