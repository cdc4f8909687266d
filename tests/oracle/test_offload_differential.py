"""CPU-tier differential: ledger.offloading's manager against vLLM 0.33's CPUOffloadingManager.

Random op sequences (offload_replay.generate_trace: lookups, loads and their completions, stores
that succeed, fail or cannot evict, touches, request finishes, resets; `lru` and `arc`; 1 to 16
chunks; store thresholds) are replayed here and, in one subprocess, inside vLLM's venv
(KVLEDGER_VLLM_ORACLE). Every answer must match (hit kinds, chunk ids, keys stored and evicted),
every event (raw and as KV-event bytes) and a probe of the state after each op (each key's
ref count and chunk, the eviction order). Planted bugs must be caught. `-m oracle_sweep` runs
NUM_SWEEP more sequences.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ledger.offloading.base import Chunk, OffloadingEvent, OffloadKey, RequestContext
from ledger.offloading.manager import CPUOffloadingManager
from ledger.offloading.policies import ARCPolicy, LRUPolicy
from tests.oracle.conftest import first_difference, run_driver
from tests.oracle.offload_ledger import LedgerOffloadBackend
from tests.oracle.offload_replay import generate_trace, replay

pytestmark = pytest.mark.oracle

NUM_RANDOM = 30
NUM_SWEEP = 1000
OPS_PER_TRACE = 300


def _traces(seeds: range) -> list[dict[str, Any]]:
    return [generate_trace(seed, OPS_PER_TRACE) for seed in seeds]


def _ours(trace: dict[str, Any]) -> list[dict[str, Any]]:
    # Through JSON, as vLLM's side comes back.
    return json.loads(json.dumps(replay(LedgerOffloadBackend(trace["config"]), trace)))


def _compare(
    traces: list[dict], theirs: list[list[dict]], workdir: Path | None
) -> tuple[int, list[str]]:
    num_ops, mismatches = 0, []
    for index, (trace, vllm_results) in enumerate(zip(traces, theirs, strict=True)):
        ours = _ours(trace)
        num_ops += sum(1 for r in ours if not r.get("skipped"))
        difference = first_difference(ours, vllm_results, trace["ops"])
        if difference is not None:
            if workdir is not None:
                (workdir / f"offload-{index}.trace.json").write_text(json.dumps(trace))
            mismatches.append(f"trace {index} ({trace['config']}):\n{difference}")
    return num_ops, mismatches


@pytest.fixture(scope="session")
def offload_runs(vllm_python: Path, workdir: Path) -> tuple[list[dict], list[list[dict]]]:
    traces = _traces(range(NUM_RANDOM))
    out = run_driver(vllm_python, "vllm_offload_driver", {"traces": traces}, workdir)
    return traces, out["results"]


def test_offloading_manager_matches_vllm(offload_runs, workdir: Path) -> None:
    traces, theirs = offload_runs
    num_ops, mismatches = _compare(traces, theirs, workdir)
    print(
        f"\noffloading differential: {len(traces)} sequences, {num_ops} ops, "
        f"{len(mismatches)} mismatches"
    )
    assert not mismatches, mismatches[0]
    # The sequences exercised what they are for.
    results = [r for trace in theirs for r in trace]
    assert not any("error" in r for r in results)
    assert {t["config"]["policy"] for t in traces} == {"lru", "arc"}
    stores = [r["stored"] for r in results if r["op"] == "store" and "stored" in r]
    assert sum(s is None for s in stores) > 20, "stores refused for want of evictable chunks"
    assert sum(1 for s in stores if s and s[2]) > 100, "stores that evicted"
    found = [f for r in results if r["op"] == "lookup" for f in r.get("found", [])]
    assert {"HIT", "MISS", "HIT_PENDING"} <= set(found)
    raw = [e for r in results for e in r["events"]]
    assert any(e[1] for e in raw), "a failed store's release"
    assert sum(r["kv_events"].count("426c6f636b52656d6f766564") for r in results) > 100


@pytest.mark.oracle_sweep
def test_offloading_manager_sweep_matches_vllm(vllm_python: Path, workdir: Path) -> None:
    traces = _traces(range(NUM_RANDOM, NUM_RANDOM + NUM_SWEEP))
    out = run_driver(vllm_python, "vllm_offload_driver", {"traces": traces}, workdir, 3600)
    num_ops, mismatches = _compare(traces, out["results"], workdir)
    print(
        f"\noffloading sweep: {len(traces)} sequences, {num_ops} ops, {len(mismatches)} mismatches"
    )
    assert not mismatches, mismatches[0]


# --- planted bugs: each must make the differential report a mismatch ---


def _lru_evicts_most_recent(self: LRUPolicy, n: int, protected: set[OffloadKey]):
    order = sorted(
        (k for k in self.evictable if k not in protected),
        key=lambda k: (self.ranks[k], k),
        reverse=True,
    )
    if len(order) < n:
        return None
    evicted = []
    for key in order[:n]:
        self.evictable.remove(key)
        del self.ranks[key]
        evicted.append((key, self.chunks.pop(key)))
    self._rebuild_heap()
    return evicted


def _arc_never_promotes(self, keys, inserted_only, reused, context) -> None:
    _arc_on_request_finished(self, keys, inserted_only | reused, set(), context)


def _chunks_reused_oldest_first(self: CPUOffloadingManager, n: int) -> list[Chunk]:
    self.free_list.reverse()
    chunks = _allocate(self, n)
    self.free_list.reverse()
    return chunks


def _failed_store_announced(self, keys, context: RequestContext, success: bool = True) -> None:
    _complete_store(self, keys, context, success)
    if self.events and self.events[-1].metadata_only:
        last = self.events[-1]
        self.events[-1] = OffloadingEvent(last.keys, removed=True, medium=last.medium)


_allocate = CPUOffloadingManager._allocate
_complete_store = CPUOffloadingManager.complete_store
_arc_on_request_finished = ARCPolicy.on_request_finished

PLANTED = {
    "lru-evicts-most-recent": (LRUPolicy, "evict", _lru_evicts_most_recent),
    "arc-never-promotes": (ARCPolicy, "on_request_finished", _arc_never_promotes),
    "chunks-reused-oldest-first": (CPUOffloadingManager, "_allocate", _chunks_reused_oldest_first),
    "failed-store-announced": (CPUOffloadingManager, "complete_store", _failed_store_announced),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_bug_is_caught(bug: str, offload_runs, monkeypatch) -> None:
    owner, name, planted = PLANTED[bug]
    monkeypatch.setattr(owner, name, planted)
    traces, theirs = offload_runs
    num_ops, mismatches = _compare(traces, theirs, None)
    print(f"\nplanted {bug}: {len(traces)} sequences, {num_ops} ops, {len(mismatches)} mismatches")
    assert mismatches, f"{bug} went unnoticed"
