"""vLLM's side of the offloading differential: runs *inside vLLM 0.33's venv*.

Usage: python vllm_offload_driver.py IN.json OUT.json. IN is {"traces": [...]}; each trace is
replayed by offload_replay.py against vLLM's own CPUOffloadingManager, its events turned into KV
events by vLLM's OffloadingEventsTracker as the OffloadingConnector does (self-describing off).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import msgspec
import vllm
from offload_replay import key_bytes, replay
from vllm.distributed.kv_events import KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
)
from vllm.v1.kv_offload.base import OffloadingKVEventsConfig, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy

_ENCODE = msgspec.msgpack.Encoder().encode


class VllmOffloadBackend:
    def __init__(self, config: dict[str, Any]) -> None:
        self.manager = CPUOffloadingManager(
            num_chunks=config["num_chunks"],
            cache_policy=config["policy"],
            enable_events=True,
            store_threshold=config["store_threshold"],
            max_tracker_size=config["max_tracker_size"],
        )
        self.tracker = OffloadingEventsTracker(
            OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=False),
            {0: OffloadingEventGroupSpec("full_attention", None)},
        )
        self.contexts: dict[str, ReqContext] = {}
        self.number: dict[bytes, int] = {}

    def _keys(self, keys: list[int]) -> list[bytes]:
        out = []
        for key in keys:
            raw = key_bytes(key)
            self.number[raw] = key
            out.append(raw)
        return out

    def _ints(self, keys) -> list[int]:
        return [self.number[key] for key in keys]

    def new(self, rid: str, keys: list[int], positions: list[int] | None) -> None:
        context = self.contexts[rid] = ReqContext(req_id=rid)
        if positions is not None:
            for key, position in zip(self._keys(keys), positions, strict=True):
                context.set_offload_key_position(key, position)
        self.manager.on_new_request(context)

    def lookup(self, rid: str, key: int) -> str:
        return self.manager.lookup(self._keys([key])[0], self.contexts[rid]).name

    def prepare_load(self, rid: str, keys: list[int]) -> list[int]:
        spec = self.manager.prepare_load(self._keys(keys), self.contexts[rid])
        return [int(x) for x in spec.block_ids]

    def complete_load(self, rid: str, keys: list[int]) -> None:
        self.manager.complete_load(self._keys(keys), self.contexts[rid])

    def touch(self, rid: str, keys: list[int]) -> None:
        self.manager.touch(self._keys(keys), self.contexts[rid])

    def prepare_store(self, rid: str, keys: list[int]) -> list | None:
        out = self.manager.prepare_store(self._keys(keys), self.contexts[rid])
        if out is None:
            return None
        chunk_ids = [int(x) for x in out.store_spec.block_ids]
        return [self._ints(out.keys_to_store), chunk_ids, self._ints(out.evicted_keys)]

    def complete_store(self, rid: str, keys: list[int], success: bool) -> None:
        self.manager.complete_store(self._keys(keys), self.contexts[rid], success)

    def finish(self, rid: str) -> None:
        self.manager.on_request_finished(self.contexts[rid])

    def reset(self) -> None:
        self.manager.reset_cache()
        self.tracker.reset()

    def take_events(self) -> tuple[list, str]:
        events = list(self.manager.take_events())
        raw = [[e.removed, e.metadata_only, e.medium.value, self._ints(e.keys)] for e in events]
        kv = list(self.tracker.take_events(events))
        return raw, _ENCODE(KVEventBatch(ts=0.0, events=kv)).hex() if kv else ""

    def probe(self) -> dict[str, Any]:
        manager, policy = self.manager, self.manager._policy
        chunks = sorted(
            [self.number[key], chunk.ref_cnt, chunk.chunk_id]
            for key in self.number
            if (chunk := policy.get(key)) is not None
        )
        if isinstance(policy, ARCCachePolicy):
            order: list = [
                self._ints(list(keys)) for keys in (policy.t1, policy.t2, policy.b1, policy.b2)
            ]
            order.append(policy.target_t1_size)
        else:
            ranked = sorted(policy._evictable, key=lambda k: (policy._ranks[k], k))
            order = self._ints(ranked)
        counts = [
            manager._num_evictable_cache_chunks,
            manager._num_write_pending_chunks,
            manager._get_num_free_chunks(),
        ]
        return {"chunks": chunks, "counts": counts, "order": order}


def main() -> None:
    source, target = sys.argv[1], sys.argv[2]
    with open(source) as f:
        traces = json.load(f)["traces"]
    results = [replay(VllmOffloadBackend(trace["config"]), trace) for trace in traces]
    with open(target, "w") as f:
        json.dump({"vllm": vllm.__version__, "results": results}, f)


if __name__ == "__main__":
    main()
