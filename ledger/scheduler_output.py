"""What one scheduler step decides (vLLM's SchedulerOutput) and what a step's tokens change.

Plain data: the ledger service turns it into wire messages, traces and metrics.

What a step makes per running request (CachedRequestData, RequestUpdate) lives until the step's
tokens are back, two steps later under async scheduling: long enough to survive young
collections and be promoted, so that at 1,000 running requests a full collection came every
~20 steps. These are msgspec Structs with gc=False (never part of a cycle: nothing points back
at them) holding tuples of ints (untracked at their first collection), as vLLM's
EngineCoreOutput is, so a step leaves almost nothing for the collector.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic

import msgspec

from ledger.block_pool import Eviction
from ledger.request import P, Request

if TYPE_CHECKING:
    from ledger.offloading.base import ConnectorMeta


@dataclass(slots=True)
class NewRequestData(Generic[P]):
    """A request the workers have not seen (new, or resumed after preemption): all its blocks."""

    request: Request[P]
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct, Generic[P], gc=False):
    """A running request: only the tokens and blocks appended since its last step."""

    request: Request[P]
    new_token_ids: Sequence[int]  # a tuple; () when the workers know every token
    new_block_ids: Sequence[int]  # a tuple; () when no block was appended
    num_computed_tokens: int


@dataclass(slots=True)
class Admission:
    request_id: str
    resumed: bool
    num_hit_tokens: int
    num_hit_blocks: int
    num_new_blocks: int
    num_free_blocks_after: int
    watermark_applied: bool
    num_loaded_tokens: int = 0  # of its computed tokens, those the CPU tier loaded
    num_shared_blocks: int = 0  # of the blocks loaded, those promoted from the shared tier first
    shared_from: tuple[str, ...] = ()  # the replicas that wrote those ("": not known)


@dataclass(slots=True)
class Preemption:
    request_id: str
    caused_by: str  # the running request that could not grow
    num_blocks_freed: int
    reason: str = "kv_cache_full"


@dataclass(slots=True)
class WaitingHeld:
    """Why the head of `waiting` was not admitted in a step (the rest wait behind it).

    `reason`: "preemption" (a request was preempted this step, so none is admitted, as in
    vLLM), "budget" (no token budget left), "seats" (max_num_seqs running), "blocks" (its
    blocks do not fit) or "watermark" (they fit, but not with the watermark kept free).
    """

    request_id: str
    reason: str


@dataclass(slots=True)
class SchedulerOutput(Generic[P]):
    step_id: int
    scheduled_new_reqs: list[NewRequestData[P]] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData[P]] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: list[str] = field(default_factory=list)
    # Requests whose chunk reaches their last token: each samples one token in this step.
    sampling_req_ids: set[str] = field(default_factory=set)
    # What happened to blocks this step, for traces and metrics.
    admissions: list[Admission] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    evictions: dict[str, list[Eviction]] = field(default_factory=dict)
    waiting_held: WaitingHeld | None = None  # None when nobody is left waiting
    # The CPU tier's copies for the workers (only with the offloading connector): loads before
    # the step's forward pass, stores after it (flushed ones before).
    kv_transfers: ConnectorMeta | None = None

    @property
    def has_transfers(self) -> bool:
        meta = self.kv_transfers
        return meta is not None and bool(meta.load_jobs or meta.store_jobs or meta.shared)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class RequestUpdate(msgspec.Struct, Generic[P], gc=False):
    """One request's result of a step: the token it got and whether it finished."""

    request: Request[P]
    new_token_ids: Sequence[int]  # a tuple
    finished: bool
    finish_reason: str | None = None
