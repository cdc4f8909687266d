"""Manager-level differential: our KV cache manager against vLLM 0.33's own, op by op.

Seeded traces of manager-level ops (admissions through the full-sequence gate, growth,
preemption, frees, prefix-cache resets under pool pressure) are replayed here and, in one
subprocess, inside vLLM's venv (KVLEDGER_VLLM_ORACLE). Block ids, hit lengths, free-queue order,
ref counts, block hashes and KV-event bytes must match. The scheduler-level differential is in
test_sched_differential.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.oracle.conftest import first_difference, run_driver
from tests.oracle.ledger_backend import LedgerBackend
from tests.oracle.replay import replay
from tests.oracle.traces import TraceSpec, generate_trace

pytestmark = pytest.mark.oracle

TRACE_SPECS = {
    "s1-sha256-b16": TraceSpec(seed=1, hash_algo="sha256"),
    "s2-sha256_cbor-b16": TraceSpec(seed=2, hash_algo="sha256_cbor"),
    "s3-sha256-b4-tight": TraceSpec(seed=3, block_size=4, num_blocks=16, max_model_len=256),
    "s4-sha256_cbor-b4": TraceSpec(
        seed=4, hash_algo="sha256_cbor", block_size=4, num_blocks=40, max_model_len=256
    ),
    "s5-sha256-seeded": TraceSpec(seed=5, none_hash_seed="0", num_blocks=24),
    "s6-sha256_cbor-seeded": TraceSpec(seed=6, hash_algo="sha256_cbor", none_hash_seed="kvledger"),
    "s7-sha256-watermark": TraceSpec(seed=7, watermark=0.1, num_blocks=64, num_ops=800),
    "s8-sha256_cbor-watermark": TraceSpec(seed=8, hash_algo="sha256_cbor", watermark=0.1),
}
LORA = ["adapter", 3, "/loras/adapter"]
# A LoRA request, a second with the same adapter (a hit), a third without it (no hit).
LORA_TRACE = {
    "config": TraceSpec(seed=0, block_size=4, num_blocks=8, max_model_len=64).config(),
    "ops": [
        {"op": "add", "rid": "a", "prompt": list(range(9)), "salt": None, "lora": LORA},
        {"op": "admit", "rid": "a", "budget": 64, "has_scheduled": False},
        {"op": "add", "rid": "b", "prompt": list(range(9)), "salt": None, "lora": LORA},
        {"op": "admit", "rid": "b", "budget": 64, "has_scheduled": True},
        {"op": "add", "rid": "c", "prompt": list(range(9)), "salt": None},
        {"op": "admit", "rid": "c", "budget": 64, "has_scheduled": True},
    ],
}


@pytest.fixture(scope="session")
def manager_runs(vllm_python: Path, workdir: Path) -> dict[str, tuple[dict, list[dict]]]:
    traces = {name: generate_trace(spec) for name, spec in TRACE_SPECS.items()}
    traces["lora"] = LORA_TRACE
    out = run_driver(vllm_python, "vllm_driver", {"traces": list(traces.values())}, workdir)
    return dict(zip(traces, zip(traces.values(), out["results"], strict=True), strict=True))


@pytest.mark.parametrize("name", list(TRACE_SPECS))
def test_manager_trace_matches_vllm(name: str, manager_runs, workdir: Path) -> None:
    trace, theirs = manager_runs[name]
    ours = replay(LedgerBackend(trace["config"]), trace["ops"])
    difference = first_difference(ours, theirs, trace["ops"])
    if difference is not None:
        (workdir / f"{name}.trace.json").write_text(json.dumps(trace))
        pytest.fail(f"{name} differs from vLLM (trace in {workdir}):\n{difference}")
    # The trace must have exercised what it is for: pressure, hits, evictions, resets.
    kinds = [(r["op"], r.get("ok")) for r in ours]
    assert len(ours) >= TRACE_SPECS[name].num_ops
    assert kinds.count(("admit", False)) > 0 and kinds.count(("admit", True)) > 0
    assert kinds.count(("reset", True)) > 0
    assert sum(1 for r in ours if r.get("hit", 0) > 0) > 0
    removed = sum(bytes.fromhex(r["events"]).count(b"BlockRemoved") for r in ours)
    assert removed > 0


def test_lora_block_hashes_and_hits_match_vllm(manager_runs) -> None:
    trace, theirs = manager_runs["lora"]
    ours = replay(LedgerBackend(trace["config"]), trace["ops"])
    strip = [{k: v for k, v in r.items() if k != "events"} for r in ours]
    assert strip == [{k: v for k, v in r.items() if k != "events"} for r in theirs]
    assert [r.get("hit") for r in ours] == [None, 0, None, 8, None, 0]


def test_lora_block_stored_events_match_vllm(manager_runs) -> None:
    trace, theirs = manager_runs["lora"]
    ours = replay(LedgerBackend(trace["config"]), trace["ops"])
    assert [r["events"] for r in ours] == [r["events"] for r in theirs]
