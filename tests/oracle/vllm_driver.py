"""vLLM's side of the differential: runs *inside vLLM 0.33's venv* (KVLEDGER_VLLM_ORACLE).

Usage: python vllm_driver.py IN.json OUT.json. IN is {"traces": [...]}; every trace is replayed
by replay.py against vLLM's own KVCacheManager and OUT gets {"vllm": version, "results": [...]}.
Results go to a file because vLLM logs to stdout.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import msgspec
import torch
import vllm
from replay import replay
from vllm.distributed.kv_events import KVEventBatch
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

_STATUS = {"running": RequestStatus.RUNNING, "preempted": RequestStatus.PREEMPTED}
_ENCODE = msgspec.msgpack.Encoder().encode


def init_none_hash(config: dict[str, Any]) -> None:
    # vLLM reads PYTHONHASHSEED when NONE_HASH is initialised; each trace brings its own.
    seed = config["none_hash_seed"]
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed
    kv_cache_utils.init_none_hash(get_hash_fn_by_name(config["hash_algo"]))


def kv_cache_config(num_blocks: int, block_size: int) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )


class VllmBackend:
    def __init__(self, config: dict[str, Any]) -> None:
        init_none_hash(config)
        self.block_size = bs = config["block_size"]
        self.hasher = kv_cache_utils.get_request_block_hasher(
            bs, get_hash_fn_by_name(config["hash_algo"])
        )
        self.params = SamplingParams(max_tokens=1 << 20)
        self.manager = KVCacheManager(
            kv_cache_config(config["num_blocks"], bs),
            max_model_len=config["max_model_len"],
            scheduler_block_size=bs,
            hash_block_size=bs,
            enable_caching=True,
            enable_kv_cache_events=True,
            watermark=config["watermark"],
        )
        self.pool = self.manager.block_pool

    def new_request(
        self, rid: str, prompt: list[int], salt: str | None, lora: list | None
    ) -> Request:
        return Request(
            request_id=rid,
            prompt_token_ids=list(prompt),
            sampling_params=self.params,
            pooling_params=None,
            cache_salt=salt,
            lora_request=None if lora is None else LoRARequest(*lora),
            block_hasher=self.hasher,
        )

    def request_hashes(self, request: Request) -> list[str]:
        return [bytes(h).hex() for h in request.block_hashes]

    def computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, list[int], int]:
        hit, num_hit, _ = self.manager.get_computed_blocks(request)
        return hit, hit.get_block_ids()[0], num_hit

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        num_hit_tokens: int = 0,
        hit: KVCacheBlocks | None = None,
        *,
        admission: bool = False,
        has_scheduled: bool = True,
    ) -> list[int] | None:
        blocks = self.manager.allocate_slots(
            request,
            num_new_tokens,
            num_hit_tokens,
            hit,
            full_sequence_must_fit=admission,
            has_scheduled_reqs=has_scheduled,
        )
        return None if blocks is None else blocks.get_block_ids()[0]

    def append(self, request: Request, tokens: list[int]) -> None:
        request.append_output_token_ids(tokens)

    def set_status(self, request: Request, status: str) -> None:
        request.status = _STATUS[status]

    def free(self, request: Request) -> None:
        self.manager.free(request)

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()

    def events(self, ts: float) -> bytes:
        return _ENCODE(KVEventBatch(ts=ts, events=self.manager.take_events()))

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]

    def ref_cnts(self) -> list[int]:
        return [b.ref_cnt for b in self.pool.blocks]

    def block_hashes(self) -> list[str | None]:
        return [
            None if b.block_hash is None else kv_cache_utils.get_block_hash(b.block_hash)[-8:].hex()
            for b in self.pool.blocks
        ]

    def block_ids(self, rid: str) -> list[int]:
        return self.manager.get_block_ids(rid)[0]


def main(argv: list[str]) -> int:
    source, target = argv[1:3]
    with open(source) as f:
        traces = json.load(f)["traces"]
    results = [replay(VllmBackend(trace["config"]), trace["ops"]) for trace in traces]
    with open(target, "w") as f:
        json.dump({"vllm": vllm.__version__, "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
