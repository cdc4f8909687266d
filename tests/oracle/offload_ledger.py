"""Our side of the offloading differential: ledger.offloading's manager behind offload_replay."""

from __future__ import annotations

from typing import Any

from ledger.events import KVEventBatch, encode_batch
from ledger.offloading.base import RequestContext
from ledger.offloading.events import to_kv_events
from ledger.offloading.manager import CPUOffloadingManager
from ledger.offloading.policies import ARCPolicy, LRUPolicy
from tests.oracle.offload_replay import key_bytes


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
