"""The ledger's offloaded tiers, built from the configuration: the CPU tier's books and decisions
(vLLM 0.33's OffloadingConnector, `ledger.offloading`) and, behind it, the shared tier's
(`TieringManager`) with the shell that keeps its catalog (`engine.shared_tier`)."""

from __future__ import annotations

import json

import redis.asyncio as aioredis

from engine.leadership import Leadership
from engine.shared_tier import SharedTierShell
from engine.workers import group_view
from ledger.hashing import BlockHasher
from ledger.offloading.connector import OffloadingConnectorScheduler
from ledger.offloading.manager import CPUOffloadingManager
from ledger.offloading.shared import TieringManager
from services.config import ConfigError, LedgerConfig, OffloadingConfig, SharedTierSpec
from services.tiers.namespace import namespace_fields, namespace_id
from services.wire.messages import WorkerHello


def build_connector(
    offloading: OffloadingConfig,
    num_cpu_chunks: int,
    block_size: int,
    shared: SharedTierSpec | None = None,
    locality: str | None = "REMOTE",
    replica: str = "",
    bytes_per_block: int = 0,
) -> OffloadingConnectorScheduler:
    """The CPU tier's books and decisions (ledger.offloading), configured as vLLM's, with the
    shared tier behind it when `shared` is given. Every worker of a step reports its copies
    with the step's result, and the step counts only once all of them did: the connector hears
    one report per copy. `bytes_per_block`: one GPU block's KV on one worker (the sync-load
    budget's unit, as vLLM's kv_bytes_per_token)."""
    cpu = CPUOffloadingManager(
        num_cpu_chunks,
        offloading.eviction_policy,
        enable_events=True,  # the ledger always publishes its KV events
        store_threshold=offloading.store_threshold,
        max_tracker_size=offloading.max_tracker_size,
    )
    manager: CPUOffloadingManager | TieringManager = cpu
    if shared is not None:
        manager = TieringManager(
            cpu, locality=locality, delete_evicted=shared.backend == "dir", replica=replica
        )
    return OffloadingConnectorScheduler(
        manager,
        block_size,
        num_workers=1,
        offload_prompt_only=offloading.offload_prompt_only,
        sync_load_budget_bytes=offloading.sync_load_budget_bytes,
        kv_bytes_per_token=bytes_per_block // block_size,
    )


def shared_tier_shell(
    config: LedgerConfig,
    r: aioredis.Redis,
    manager: TieringManager,
    hasher: BlockHasher | None,
    workers: dict[str, WorkerHello],
    leadership: Leadership,
) -> SharedTierShell:
    """The shared tier's namespace from the workers' KV identity and this ledger's hashing, and
    the shell that keeps its catalog. Refused when the two cannot be known (no prefix caching:
    no block hashes; workers that disagree on what their KV is)."""
    if hasher is None:
        raise ConfigError(
            "--kv-shared-tier needs prefix caching (blocks are found by their hashes): drop "
            "--no-enable-prefix-caching"
        )
    identities = {hello.kv_identity for hello in workers.values()}
    if len(identities) != 1 or "" in identities:
        raise ConfigError(
            "--kv-shared-tier: the workers do not agree on what their KV is (model, dtype, "
            f"layout): {sorted(identities)}"
        )
    fields = namespace_fields(
        json.loads(identities.pop()), config.hash_algo, hasher.none_hash, config.block_size
    )
    primary = group_view(workers)
    hello = next(iter(primary.values()))
    return SharedTierShell(
        config, r, manager, namespace_id(fields), fields, leadership,
        hello.bytes_per_block, hello.tp_size,
    )  # fmt: skip
