"""vLLM's scheduler-level side: runs *inside vLLM 0.33's venv* (KVLEDGER_VLLM_ORACLE).

Usage: python vllm_sched_driver.py IN.json OUT.json. IN is {"workloads": [...]} from
sched_trace.generate_workload; each runs through vLLM's own v1 Scheduler, built offline from a
config.json-only model directory, and OUT gets one list of step records per workload.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # no accelerator: vLLM's CPU platform

import msgspec
import vllm
from vllm.config import (
    CacheConfig,
    KVEventsConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_events import KVEventBatch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
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
EOS = 7
SAMPLE_VOCAB = 50


def sampled_token(index: int, position: int, seed: int) -> int:
    # The same function as sched_trace.sampled_token (which this venv cannot import).
    return (index * 7919 + position * 104729 + seed * 31) % SAMPLE_VOCAB


class Recorder:
    """Stands in for the event publisher: keeps each step's batch instead of sending it."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, batch: KVEventBatch) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


def make_scheduler(config: dict, model_dir: str) -> tuple[Scheduler, Recorder]:
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
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        policy=config["policy"],
        long_prefill_token_threshold=config["long_prefill_token_threshold"],
        watermark=config["watermark"],
    )
    cache = CacheConfig(block_size=config["block_size"], enable_prefix_caching=True)
    cache.num_gpu_blocks = config["num_blocks"]
    vllm_config = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )
    scheduler = Scheduler(
        vllm_config,
        kv_cache_config(config["num_blocks"], config["block_size"]),
        StructuredOutputManager(vllm_config),
        block_size=config["block_size"],
    )
    scheduler.kv_event_publisher = recorder = Recorder()
    return scheduler, recorder


def run_workload(workload: dict, model_dir: str, max_steps: int = 5000) -> list[dict]:
    config = workload["config"]
    init_none_hash(config)
    hasher = kv_cache_utils.get_request_block_hasher(
        config["block_size"], get_hash_fn_by_name(config["hash_algo"])
    )
    scheduler, recorder = make_scheduler(config, model_dir)
    manager = scheduler.kv_cache_manager
    pending = list(workload["requests"])
    index = {r["rid"]: i for i, r in enumerate(workload["requests"])}
    requests: dict[str, Request] = {}
    records = []
    for step in range(max_steps):
        while pending and pending[0]["arrival_step"] <= step:
            spec = pending.pop(0)
            params = SamplingParams(
                max_tokens=spec["max_tokens"], min_tokens=spec.get("min_tokens", 0)
            )
            params.update_from_generation_config({}, eos_token_id=EOS)
            request = Request(
                request_id=spec["rid"],
                prompt_token_ids=spec["prompt"],
                sampling_params=params,
                pooling_params=None,
                arrival_time=float(index[spec["rid"]]),
                cache_salt=spec["salt"],
                block_hasher=hasher,
                priority=spec["priority"],
            )
            requests[spec["rid"]] = request
            scheduler.add_request(request)
        if not pending and not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = requests[rid]
            done_prefill = request.num_computed_tokens >= request.num_tokens
            token = sampled_token(index[rid], request.num_tokens, config["seed"])
            sampled.append([token] if done_prefill else [])
        running_before = {r.request_id for r in scheduler.running}
        scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                sampled_token_ids=sampled,
            ),
        )
        done = sorted(running_before - {r.request_id for r in scheduler.running})
        records.append(record(out, done, recorder, manager, step))
        recorder.events = []
    return records


def record(out, done: list[str], recorder: Recorder, manager, step: int) -> dict:
    cached = out.scheduled_cached_reqs
    full = {n.req_id: n.block_ids[0] for n in out.scheduled_new_reqs}
    new_blocks = {}
    for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
        if rid in cached.resumed_req_ids:
            full[rid] = ids[0]
        else:
            new_blocks[rid] = ids[0] if ids is not None else []
    events = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=float(step), events=recorder.events))
    return {
        "scheduled": [[rid, n] for rid, n in out.num_scheduled_tokens.items()],
        "full_tables": dict(sorted(full.items())),
        "new_blocks": dict(sorted(new_blocks.items())),
        "preempted": sorted(out.preempted_req_ids or ()),
        "finished": sorted(out.finished_req_ids),
        "done": done,
        "events": events.hex(),
        "free_queue": [
            b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()
        ],
    }


def main(argv: list[str]) -> int:
    source, target = argv[1:3]
    with open(source) as f:
        workloads = json.load(f)["workloads"]
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(TINY_LLAMA, f)
        results = [run_workload(w, model_dir) for w in workloads]
    with open(target, "w") as f:
        json.dump({"vllm": vllm.__version__, "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
