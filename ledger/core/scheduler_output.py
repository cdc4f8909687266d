"""What one scheduler step decides (vLLM's SchedulerOutput) and what a step's tokens change.

Plain data: the ledger service turns it into wire messages, traces and metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic

from ledger.core.block_pool import Eviction
from ledger.core.request import P, Request


@dataclass(slots=True)
class NewRequestData(Generic[P]):
    """A request the workers have not seen (new, or resumed after preemption): all its blocks."""

    request: Request[P]
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class CachedRequestData(Generic[P]):
    """A running request: only the tokens and blocks appended since its last step."""

    request: Request[P]
    new_token_ids: list[int]
    new_block_ids: list[int]
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


@dataclass(slots=True)
class Preemption:
    request_id: str
    caused_by: str  # the running request that could not grow
    num_blocks_freed: int
    reason: str = "kv_cache_full"


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

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass(slots=True)
class RequestUpdate(Generic[P]):
    """One request's result of a step: the token it got and whether it finished."""

    request: Request[P]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
