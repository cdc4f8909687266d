"""CPU-tier connector differential: ledger.offloading.connector against the scheduler side of vLLM
0.33's OffloadingConnector (OffloadingConnectorScheduler with its CPU backend, built from a
VllmConfig with kv_transfer_config set), driven directly by the same scheduler loop.

offload_sim.Loop runs each random workload (prefix-sharing prompts, tight GPU pools with
preemption, aborts, cache resets, one or two workers whose reports arrive a step or more later,
`lru` and `arc`, 2 to 64 chunks, with and without vLLM's sync-load budget) against each side in its own process with PYTHONHASHSEED=0
(vLLM orders finished requests and a store's keys by set iteration). Every step must match: each
lookup's hit tokens and whether the load is async, the load and store jobs (request, chunk ids,
GPU block ids, first block index, whether a load is done within its step), the jobs to flush, the KV-event bytes, each chunk's ref count
and slot, the jobs in flight and the requests tracked. Planted bugs must be caught.
`-m oracle_sweep` runs NUM_SWEEP more workloads.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from ledger.offloading import connector
from ledger.offloading.base import LookupResult
from ledger.offloading.connector import OffloadingConnectorScheduler
from ledger.offloading.manager import CPUOffloadingManager
from tests.oracle.conftest import first_difference, run_driver
from tests.oracle.offload_sim import generate_workload

pytestmark = pytest.mark.oracle

NUM_RANDOM = 25
NUM_SWEEP = 500
OURS = Path(sys.executable)


def _run(
    python: Path, driver: str, workloads: list, workdir: Path, bug: str = "", tag: str = ""
) -> list:
    args = (bug,) if bug else ()
    payload = {"workloads": workloads}
    out = run_driver(
        python,
        driver,
        payload,
        workdir,
        3600,
        hash_seed="0",
        args=args,
        tag=f"-{bug or tag}" if bug or tag else "",
    )
    return out["results"]


def _compare(workloads: list, ours: list, theirs: list) -> tuple[int, list[str]]:
    steps, mismatches = 0, []
    for workload, a, b in zip(workloads, ours, theirs, strict=True):
        steps += len(b)
        difference = first_difference(a, b, [{"step": r["step"]} for r in b])
        if difference is not None:
            mismatches.append(f"workload {workload['config']}:\n{difference}")
    return steps, mismatches


@pytest.fixture(scope="session")
def connector_runs(vllm_python: Path, workdir: Path) -> tuple[list, list]:
    workloads = [generate_workload(seed) for seed in range(NUM_RANDOM)]
    theirs = _run(vllm_python, "vllm_offload_connector_driver", workloads, workdir)
    return workloads, theirs


def test_offloading_connector_matches_vllm(connector_runs, workdir: Path) -> None:
    workloads, theirs = connector_runs
    ours = _run(OURS, "ledger_offload_connector_driver", workloads, workdir)
    steps, mismatches = _compare(workloads, ours, theirs)
    records = [r for run in theirs for r in run]
    loads = sum(len(r["meta"]["loads"]) for r in records)
    sync_loads = sum(1 for r in records for load in r["meta"]["loads"] if load[5])
    stores = sum(len(r["meta"]["stores"]) for r in records)
    flushed = sum(len(r["meta"]["flush"]) for r in records)
    deferred = sum(1 for r in records for m in r["matched"] if m[2] is None)
    print(
        f"\noffloading connector differential: {len(workloads)} workloads, {steps} steps, "
        f"{loads} loads ({sync_loads} within their step), {stores} stores, {flushed} flushes, {deferred} deferred lookups, "
        f"{len(mismatches)} mismatches"
    )
    assert not mismatches, mismatches[0]
    assert loads > 100 and stores > 500 and flushed > 5 and deferred > 20
    assert 20 < sync_loads < loads - 50  # both kinds of load, under budgets tight and loose
    assert any(r.get("reset") for r in records)
    assert sum(r["events"].count("426c6f636b52656d6f766564") for r in records) > 50


@pytest.mark.oracle_sweep
def test_offloading_connector_sweep_matches_vllm(vllm_python: Path, workdir: Path) -> None:
    workloads = [generate_workload(seed) for seed in range(NUM_RANDOM, NUM_RANDOM + NUM_SWEEP)]
    theirs = _run(vllm_python, "vllm_offload_connector_driver", workloads, workdir, tag="sweep")
    ours = _run(OURS, "ledger_offload_connector_driver", workloads, workdir, tag="sweep")
    steps, mismatches = _compare(workloads, ours, theirs)
    loads = [load for run in theirs for r in run for load in r["meta"]["loads"]]
    print(
        f"\noffloading connector sweep: {len(workloads)} workloads, {steps} steps, "
        f"{len(loads)} loads ({sum(1 for load in loads if load[5])} within their step), "
        f"{len(mismatches)} mismatches"
    )
    assert not mismatches, mismatches[0]


# --- planted bugs: each must make the differential report a mismatch ---


def _decode_blocks_stored(self: OffloadingConnectorScheduler, request, num_tokens: int) -> int:
    return min(num_tokens, request.num_tokens)


def _pending_hit_loaded(manager: CPUOffloadingManager, key, context=None) -> LookupResult:
    found = _lookup(manager, key, context)
    return LookupResult.HIT if found is LookupResult.HIT_PENDING else found


def _no_flush_on_reuse(self: OffloadingConnectorScheduler, output) -> Any:
    self.block_to_pending_jobs.clear()
    return _build_connector_meta(self, output)


def _finish_unsignaled(self: CPUOffloadingManager, context) -> None:
    return None


def _sync_budget_per_request(
    self: OffloadingConnectorScheduler, request, num_computed_tokens: int, num_hit_tokens
) -> bool:
    self._batch_sync_load_bytes = 0  # each request measured against the whole budget
    return _reserve_sync_load(self, request, num_computed_tokens, num_hit_tokens)


_lookup = CPUOffloadingManager.lookup
_build_connector_meta = OffloadingConnectorScheduler.build_connector_meta
_reserve_sync_load = OffloadingConnectorScheduler._reserve_sync_load

PLANTED: dict[str, tuple[Any, str, Any]] = {
    "decode-blocks-stored": (
        OffloadingConnectorScheduler,
        "_num_offloadable_tokens",
        _decode_blocks_stored,
    ),
    "pending-hit-loaded": (CPUOffloadingManager, "lookup", _pending_hit_loaded),
    "no-flush-on-reuse": (OffloadingConnectorScheduler, "build_connector_meta", _no_flush_on_reuse),
    "finish-unsignaled": (CPUOffloadingManager, "on_request_finished", _finish_unsignaled),
    "sync-budget-per-request": (
        OffloadingConnectorScheduler,
        "_reserve_sync_load",
        _sync_budget_per_request,
    ),
}


def plant(bug: str) -> None:
    """Called by ledger_offload_connector_driver.py in its own process."""
    owner, name, planted = PLANTED[bug]
    setattr(owner, name, planted)
    assert connector.OffloadingConnectorScheduler is OffloadingConnectorScheduler


@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_connector_bug_is_caught(bug: str, connector_runs, workdir: Path) -> None:
    workloads, theirs = connector_runs
    ours = _run(OURS, "ledger_offload_connector_driver", workloads, workdir, bug)
    steps, mismatches = _compare(workloads, ours, theirs)
    print(
        f"\nplanted {bug}: {len(workloads)} workloads, {steps} steps, {len(mismatches)} mismatches"
    )
    assert mismatches, f"{bug} went unnoticed"
