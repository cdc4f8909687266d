"""vLLM's scheduler-level side: runs *inside vLLM 0.33's venv* (KVLEDGER_VLLM_ORACLE).

Usage: python vllm_sched_driver.py IN.json OUT.json. IN is {"workloads": [...]}
(sched_workloads); each runs through sched_harness.drive against vLLM's own v1 Scheduler (its
AsyncScheduler under async scheduling), built offline from a config.json-only model directory.
OUT gets, per workload, the digest of every step record and, for a workload that asks for them
("full_records"), the records.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # no accelerator: vLLM's CPU platform

import msgspec
import vllm
from sched_harness import EOS, digest, drive
from vllm.config import CacheConfig, KVEventsConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_events import KVEventBatch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm_driver import init_none_hash, kv_cache_config

# The scheduler reads the model's shape only through config.json; no weights, no tokenizer.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_ENCODE = msgspec.msgpack.Encoder().encode


class Recorder:
    """Stands in for the event publisher: keeps each published batch instead of sending it."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, batch: KVEventBatch) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


class VllmScheduler:
    """sched_harness.Backend over vLLM's Scheduler."""

    def __init__(self, config: dict[str, Any], model_dir: str) -> None:
        init_none_hash(config)
        self.hasher = kv_cache_utils.get_request_block_hasher(
            config["block_size"], get_hash_fn_by_name(config["hash_algo"])
        )
        model = ModelConfig(
            model=model_dir,
            skip_tokenizer_init=True,
            max_model_len=config["max_model_len"],
            dtype="float32",
        )
        sched = SchedulerConfig(
            max_num_seqs=config["max_num_seqs"],
            max_num_batched_tokens=config["max_num_batched_tokens"],
            max_model_len=config["max_model_len"],
            enable_chunked_prefill=config["enable_chunked_prefill"],
            is_encoder_decoder=False,
            policy=config["policy"],
            long_prefill_token_threshold=config["long_prefill_token_threshold"],
            watermark=config["watermark"],
            async_scheduling=config["async_scheduling"],
        )
        cache = CacheConfig(
            block_size=config["block_size"], enable_prefix_caching=config["enable_prefix_caching"]
        )
        cache.num_gpu_blocks = config["num_blocks"]
        vllm_config = VllmConfig(
            model_config=model,
            scheduler_config=sched,
            cache_config=cache,
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        )
        cls = AsyncScheduler if config["async_scheduling"] else Scheduler
        self.scheduler = cls(
            vllm_config,
            kv_cache_config(config["num_blocks"], config["block_size"]),
            StructuredOutputManager(vllm_config),
            block_size=config["block_size"],
        )
        self.scheduler.kv_event_publisher = self.recorder = Recorder()
        self.manager = self.scheduler.kv_cache_manager

    def add(self, spec: dict[str, Any], index: int) -> None:
        params = SamplingParams(
            max_tokens=spec["max_tokens"],
            min_tokens=spec["min_tokens"],
            stop_token_ids=spec["stop_token_ids"],
        )
        params.update_from_generation_config({}, eos_token_id=EOS)
        self.scheduler.add_request(
            Request(
                request_id=spec["rid"],
                prompt_token_ids=spec["prompt"],
                sampling_params=params,
                pooling_params=None,
                arrival_time=float(index),
                cache_salt=spec["salt"],
                block_hasher=self.hasher,
                priority=spec["priority"],
            )
        )

    def abort(self, rids: list[str]) -> list[str]:
        finished = self.scheduler.finish_requests(rids, RequestStatus.FINISHED_ABORTED)
        return sorted(r.request_id for r in finished)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def schedule(self) -> tuple[SchedulerOutput, dict[str, Any], list[str]]:
        out = self.scheduler.schedule()
        requests = self.scheduler.requests
        full = {n.req_id: n.block_ids[0] for n in out.scheduled_new_reqs}
        computed = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        new_blocks = {}
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            computed[rid] = cached.num_computed_tokens[i]
            if rid in cached.resumed_req_ids:
                full[rid] = ids[0]
            else:
                new_blocks[rid] = ids[0] if ids is not None else []
        record = {
            "scheduled": [[rid, n, computed[rid]] for rid, n in out.num_scheduled_tokens.items()],
            "full_tables": dict(sorted(full.items())),
            "new_blocks": dict(sorted(new_blocks.items())),
            "preempted": sorted(out.preempted_req_ids or ()),
            "finished": sorted(out.finished_req_ids),
        }
        # A request samples in a step when the step reaches its end (not a prefill chunk).
        sampling = sorted(
            rid for rid in out.num_scheduled_tokens if not requests[rid].is_prefill_chunk
        )
        return out, record, sampling

    def update(self, step: SchedulerOutput, sampled: dict[str, int]) -> list[list[Any]]:
        req_ids = list(step.num_scheduled_tokens)
        outputs = self.scheduler.update_from_output(
            step,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                sampled_token_ids=[[sampled[rid]] if rid in sampled else [] for rid in req_ids],
            ),
        )
        return [
            [
                o.request_id,
                list(o.new_token_ids),
                None if o.finish_reason is None else str(o.finish_reason),
            ]
            for client in outputs.values()
            for o in client.outputs
        ]

    def num_tokens(self, rid: str) -> int | None:
        request = self.scheduler.requests.get(rid)
        return None if request is None or request.is_finished() else request.num_tokens

    def state(self, ts: float) -> dict[str, Any]:
        # Events published by update_from_output, then any it has not taken yet.
        events = self.recorder.events + self.manager.take_events()
        self.recorder.events = []
        pool = self.manager.block_pool
        return {
            "events": _ENCODE(KVEventBatch(ts=ts, events=events)).hex(),
            "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            "ref_cnts": [b.ref_cnt for b in pool.blocks],
        }


def main(argv: list[str]) -> int:
    source, target = argv[1:3]
    with open(source) as f:
        payload = json.load(f)
    results = []
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(TINY_LLAMA, f)
        for workload in payload["workloads"]:
            try:
                records = drive(workload, VllmScheduler(workload["config"], model_dir))
            except Exception as exc:  # a crash in vLLM is a finding too: report, go on
                results.append({"error": f"{type(exc).__name__}: {exc}"})
                continue
            results.append(
                {
                    "digests": [digest(r) for r in records],
                    "records": records if workload.get("full_records") else None,
                }
            )
    with open(target, "w") as f:
        json.dump({"vllm": vllm.__version__, "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
