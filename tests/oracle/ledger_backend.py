"""Our side of the differential: the ledger's KVCacheManager behind replay.Backend."""

from __future__ import annotations

from typing import Any

from ledger.block import KVCacheBlock
from ledger.events import KVEventBatch, encode_batch
from ledger.hashing import BlockHasher, resolve_none_hash_seed
from ledger.kv_cache_manager import KVCacheManager
from ledger.request import Request, RequestStatus

_STATUS = {"running": RequestStatus.RUNNING, "preempted": RequestStatus.PREEMPTED}


def none_hash_seed(config: dict[str, Any]) -> str:
    """The seed vLLM derives NONE_HASH from, for a trace that may set PYTHONHASHSEED."""
    seed = config["none_hash_seed"]
    environ = {} if seed is None else {"PYTHONHASHSEED": seed}
    return resolve_none_hash_seed(config["hash_algo"], environ)


class LedgerBackend:
    def __init__(self, config: dict[str, Any]) -> None:
        self.block_size = config["block_size"]
        self.hasher = BlockHasher(config["hash_algo"], seed=none_hash_seed(config))
        self.manager = KVCacheManager(
            config["num_blocks"],
            self.block_size,
            config["max_model_len"],
            enable_kv_cache_events=True,
            watermark=config["watermark"],
        )

    def new_request(
        self, rid: str, prompt: list[int], salt: str | None, lora: list | None
    ) -> Request:
        return Request(
            rid,
            prompt,
            max_tokens=1 << 20,
            cache_salt=salt,
            lora=None if lora is None else (lora[0], lora[2]),
            lora_id=None if lora is None else lora[1],
            block_hasher=self.hasher,
            block_size=self.block_size,
        )

    def request_hashes(self, request: Request) -> list[str]:
        return [h.hex() for h in request.block_hashes]

    def computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], list[int], int]:
        hit, num_hit = self.manager.get_computed_blocks(request)
        return hit, [b.block_id for b in hit], num_hit

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        num_hit_tokens: int = 0,
        hit: list[KVCacheBlock] | None = None,
        *,
        admission: bool = False,
        has_scheduled: bool = True,
    ) -> list[int] | None:
        blocks = self.manager.allocate_slots(
            request,
            num_new_tokens,
            num_hit_tokens,
            hit or (),
            full_sequence_must_fit=admission,
            has_scheduled_reqs=has_scheduled,
        )
        return None if blocks is None else [b.block_id for b in blocks]

    def append(self, request: Request, tokens: list[int]) -> None:
        request.append_output_token_ids(tokens)

    def set_status(self, request: Request, status: str) -> None:
        request.status = _STATUS[status]

    def free(self, request: Request) -> None:
        self.manager.free(request)

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()

    def events(self, ts: float) -> bytes:
        return encode_batch(KVEventBatch(ts=ts, events=self.manager.take_events()))

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.manager.block_pool.free_block_queue]

    def ref_cnts(self) -> list[int]:
        return [b.ref_cnt for b in self.manager.block_pool.blocks]

    def block_hashes(self) -> list[str | None]:
        # The last 8 bytes: what events publish, and enough to tell blocks apart.
        return [
            None if b.block_hash is None else b.block_hash[-8:].hex()
            for b in self.manager.block_pool.blocks
        ]

    def block_ids(self, rid: str) -> list[int]:
        return self.manager.get_block_ids(rid)
