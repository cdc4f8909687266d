"""A request as the ledger sees it: token ids, progress, status and its block hashes.

The ledger never sees text or sampling knobs beyond the stop rules; whatever the I/O shell
needs to carry along (the wire sampling params, the trace context) rides in `payload`, typed
by the caller: `Request[Tracked]` in the ledger service.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import Generic, TypeVar

from ledger.block import BlockHash
from ledger.hashing import BlockHasher


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Waiting, its blocks allocated, while the CPU tier loads part of its prefix into them
    # (vLLM's WAITING_FOR_REMOTE_KVS; only with the offloading connector).
    WAITING_FOR_REMOTE_KVS = enum.auto()
    # Everything from here on is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


# What the caller keeps per request (the service: its wire message and stream entry).
P = TypeVar("P")


class Request(Generic[P]):
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        eos_token_id: int | None = None,
        stop_token_ids: Sequence[int] = (),
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        lora_id: int | None = None,
        block_hasher: BlockHasher | None = None,
        block_size: int = 16,
        skip_reading_prefix_cache: bool = False,
        payload: P = None,  # type: ignore[assignment]  # None when the caller keeps nothing
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: the prompt has no tokens")
        self.request_id = request_id
        # The prompt is stored once, as the head of all_token_ids: a full GC walks every item
        # of every live token list, and at 1,000 running requests a second copy doubled that.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.max_tokens = max_tokens
        self.eos_token_id = eos_token_id
        self.stop_token_ids = frozenset(stop_token_ids)
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.lora = lora  # (name, path): what the block hashes carry
        self.lora_id = lora_id  # the adapter's integer id: what BlockStored.lora_id carries
        self.payload = payload
        # Prompt logprobs need every prompt position computed: such a request reads no cached
        # blocks (vLLM's skip_reading_prefix_cache), though its own blocks are cached for others.
        self.skip_reading_prefix_cache = skip_reading_prefix_cache

        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.stop_reason: int | None = None
        # Prefix-cache hit at the first admission (-1 until admitted): usage.cached_tokens.
        self.num_cached_tokens = -1
        # How many of all_token_ids the workers have been sent (for CachedRequestData).
        self.num_tokens_sent = 0
        # Tokens the workers are sampling in steps still in flight (async scheduling only).
        self.num_output_placeholders = 0

        self.block_size = block_size
        self.block_hasher = block_hasher
        self.block_hashes: list[BlockHash] = []
        self.update_block_hashes()

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        if isinstance(token_ids, int):
            self.all_token_ids.append(token_ids)
        else:
            self.all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Hash every block that became full since the last call (chained from the last hash)."""
        hasher = self.block_hasher
        if hasher is None or (len(self.block_hashes) + 1) * self.block_size > len(
            self.all_token_ids
        ):
            return
        self.block_hashes.extend(
            hasher.hash_blocks(
                self.all_token_ids,
                self.block_size,
                start_block=len(self.block_hashes),
                parent=self.block_hashes[-1] if self.block_hashes else None,
                cache_salt=self.cache_salt,
                lora=self.lora,
            )
        )

    def __lt__(self, other: Request) -> bool:
        # The priority queue's order: lower priority value first, then earlier arrival.
        if self.priority != other.priority:
            return self.priority < other.priority
        if self.arrival_time != other.arrival_time:
            return self.arrival_time < other.arrival_time
        return self.request_id < other.request_id

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
