"""Scheduler-level differential: our Scheduler against vLLM 0.33's own, step by step.

Each workload runs through `sched_harness.drive` on both sides (vLLM's in one subprocess in its
venv, KVLEDGER_VLLM_ORACLE): async scheduling with two steps in flight and the same tokens fed
back on both sides, and lock-step with chunked prefill on and off. Every step must match: the
scheduled ids with their token and computed counts, whole block tables of new and resumed
requests, new block ids of running ones, preempted and finished ids, the outputs (tokens and
finish reasons), the KV-event bytes, the free-queue order and every block's ref count.

`NUM_RANDOM` random workloads per mode run every time; `-m oracle_sweep` runs `NUM_SWEEP` more
per mode (docs/testing.md).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest

from tests.oracle.conftest import first_difference, run_driver
from tests.oracle.sched_harness import EOS, digest
from tests.oracle.sched_trace import run_ledger
from tests.oracle.sched_workloads import MODES, generate_workload, random_workload, request_spec

pytestmark = pytest.mark.oracle

NUM_RANDOM = 100
NUM_SWEEP = 1000
SWEEP_SEEDS = range(NUM_RANDOM, NUM_RANDOM + NUM_SWEEP)


def _single(rid: str, prompt_len: int, max_tokens: int, **fields: Any) -> dict:
    return request_spec(rid, list(range(1000, 1000 + prompt_len)), max_tokens, **fields)


FIXED = {
    "fcfs": generate_workload(11, num_requests=50),
    "fcfs-sha256_cbor-tight": generate_workload(
        12, 50, hash_algo="sha256_cbor", num_blocks=33, max_num_seqs=16, max_num_batched_tokens=512
    ),
    "priority": generate_workload(13, 50, policy="priority", max_num_batched_tokens=64),
    "watermark": generate_workload(14, 50, num_blocks=64, watermark=0.1),
    "fcfs-async": generate_workload(15, 50, num_blocks=40, async_scheduling=True),
    # Repros of differences found earlier (now fixed, kept as regression tests).
    "long-prefill-single": generate_workload(0, 0, long_prefill_token_threshold=48),
    # With seed 0, request 0's first sampled token after a 33-token prompt is EOS (7).
    "eos-before-min-tokens": generate_workload(0, 0),
    # Chunked prefill off: the cap comes before the budget check, so both 16-token caps fit.
    "unchunked-long-prefill-cap": generate_workload(
        0,
        0,
        block_size=16,
        max_model_len=32,
        max_num_batched_tokens=32,
        enable_chunked_prefill=False,
        long_prefill_token_threshold=16,
    ),
    # Async: a's last full block [11, 12, 13, 4817] is stored as a's last token comes back.
    "async-last-block": generate_workload(
        0, 0, block_size=4, num_blocks=10, max_model_len=32, async_scheduling=True
    ),
}
FIXED["long-prefill-single"]["requests"] = [_single("a", 100, 2)]
FIXED["eos-before-min-tokens"]["requests"] = [_single("a", 33, 4, min_tokens=3)]
FIXED["unchunked-long-prefill-cap"]["requests"] = [
    _single("a", 20, 2),
    request_spec("b", list(range(2000, 2020)), 2),
]
# a samples sampled_token(0, 3, 0) == 37, then 16: b shares a's prompt and first output.
FIXED["async-last-block"]["requests"] = [
    request_spec("a", [11, 12, 13], 2),
    request_spec("b", [11, 12, 13, 37, 99], 1, arrival_step=10),
]
for _workload in FIXED.values():
    _workload["full_records"] = True


@pytest.fixture(scope="session")
def scheduler_runs(vllm_python: Path, workdir: Path) -> dict[Any, dict]:
    """vLLM's side of every fixed and random workload, from one subprocess (one import)."""
    workloads: dict[Any, dict] = {("fixed", name): w for name, w in FIXED.items()}
    for mode in MODES:
        for seed in range(NUM_RANDOM):
            workloads[(mode, seed)] = random_workload(seed, mode)
    out = run_driver(
        vllm_python, "vllm_sched_driver", {"workloads": list(workloads.values())}, workdir
    )
    return dict(zip(workloads, out["results"], strict=True))


def compare(
    workload: dict, theirs: dict, vllm_python: Path, workdir: Path
) -> tuple[list, str | None]:
    """Our records, and None or an account of the first step where vLLM's differ."""
    ours = run_ledger(workload)
    if "error" in theirs:
        return ours, f"vLLM failed on the workload: {theirs['error']}"
    if [digest(r) for r in ours] == theirs["digests"]:
        return ours, None
    records = theirs["records"]
    if records is None:  # only digests came back: fetch this one workload's records
        full = run_driver(
            vllm_python,
            "vllm_sched_driver",
            {"workloads": [dict(workload, full_records=True)]},
            workdir,
        )
        records = full["results"][0]["records"]
    return ours, first_difference(ours, records, ours) or "digests differ"


def coverage(records: list[dict]) -> collections.Counter:
    """What a batch of workloads exercised, so a generator change cannot hollow the test out."""
    seen: collections.Counter = collections.Counter(steps=len(records))
    for record in records:
        schedule = record.get("schedule")
        if schedule:
            seen["preemptions"] += len(schedule["preempted"])
            seen["prefix_hits"] += sum(
                1 for rid, _, computed in schedule["scheduled"]
                if computed and rid in schedule["full_tables"]
            )  # fmt: skip
        seen["aborts"] += len(record.get("aborted", ()))
        if "reset" in record:
            seen["resets_done" if record["reset"] else "resets_refused"] += 1
        for _, tokens, reason in record.get("outputs", ()):
            if reason == "stop":
                seen["eos" if tokens[-1] == EOS else "stop_tokens"] += 1
            elif reason == "length":
                seen["length"] += 1
        events = bytes.fromhex(record["events"])
        seen["evictions"] += events.count(b"BlockRemoved")
        seen["stored"] += events.count(b"BlockStored")
    return seen


def check_batch(
    mode: str, seeds: range, results: list[dict], vllm_python: Path, workdir: Path, capsys
) -> None:
    """Compare each workload of a batch with vLLM's results (in seed order), then report."""
    mismatches: list[tuple[int, str]] = []
    seen: collections.Counter = collections.Counter()
    policies: collections.Counter = collections.Counter()
    for seed, theirs in zip(seeds, results, strict=True):
        workload = random_workload(seed, mode)
        policies[workload["config"]["policy"]] += 1
        if mismatches:  # one readable account is enough; count the rest by digest
            ours = run_ledger(workload)
            if "error" in theirs or [digest(r) for r in ours] != theirs["digests"]:
                mismatches.append((seed, ""))
            seen += coverage(ours)
            continue
        ours, difference = compare(workload, theirs, vllm_python, workdir)
        if difference is not None:
            (workdir / f"{mode}-{seed}.workload.json").write_text(json.dumps(workload))
            mismatches.append((seed, difference))
        seen += coverage(ours)
    summary = (
        f"[oracle] {mode}: {len(seeds)} random workloads, {seen['steps']:,} steps compared, "
        f"{len(mismatches)} mismatches; "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(seen.items()) if k != "steps")
    )
    with capsys.disabled():
        print("\n" + summary)
    if mismatches:
        seed, difference = mismatches[0]
        pytest.fail(
            f"{len(mismatches)} of {len(seeds)} {mode} workloads differ from vLLM; the first, seed "
            f"{seed} (workload in {workdir}), at step {difference}"
        )
    # Every batch must have exercised what the differential is for.
    for kind in (
        "preemptions", "prefix_hits", "aborts", "resets_done", "resets_refused", "eos",
        "stop_tokens", "length", "evictions", "stored",
    ):  # fmt: skip
        assert seen[kind] > 0, f"no {kind} in {mode}'s workloads: {summary}"
    assert policies["priority"] > 0 and policies["fcfs"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_random_workloads_match_vllm_step_by_step(
    mode: str, scheduler_runs, vllm_python: Path, workdir: Path, capsys
) -> None:
    results = [scheduler_runs[(mode, seed)] for seed in range(NUM_RANDOM)]
    check_batch(mode, range(NUM_RANDOM), results, vllm_python, workdir, capsys)


@pytest.mark.oracle_sweep
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("mode", MODES)
def test_sweep_of_random_workloads_matches_vllm(
    mode: str, vllm_python: Path, workdir: Path, capsys
) -> None:
    workloads = [random_workload(seed, mode) for seed in SWEEP_SEEDS]
    out = run_driver(
        vllm_python, "vllm_sched_driver", {"workloads": workloads}, workdir, timeout=7000
    )
    check_batch(mode, SWEEP_SEEDS, out["results"], vllm_python, workdir, capsys)


@pytest.mark.parametrize(
    "name", ["fcfs", "fcfs-sha256_cbor-tight", "priority", "watermark", "fcfs-async"]
)
def test_fixed_workloads_match_vllm_step_by_step(
    name: str, scheduler_runs, vllm_python: Path, workdir: Path
) -> None:
    workload = FIXED[name]
    ours, difference = compare(workload, scheduler_runs[("fixed", name)], vllm_python, workdir)
    assert difference is None, f"{name} differs from vLLM at step {difference}"
    seen = coverage(ours)
    assert seen["steps"] > 100
    assert seen["eos"] + seen["stop_tokens"] + seen["length"] == len(workload["requests"])
    if name != "watermark":  # the watermark keeps enough room to never preempt here
        assert seen["preemptions"] > 0


def _scheduled(records: list[dict]) -> list[list]:
    return [r["schedule"]["scheduled"] for r in records if r.get("schedule")]


def _outputs(records: list[dict]) -> list[list]:
    return [out for r in records for out in r.get("outputs", ())]


def test_long_prefill_cap_with_one_request_matches_vllm(scheduler_runs) -> None:
    theirs = scheduler_runs[("fixed", "long-prefill-single")]["records"]
    assert _scheduled(theirs) == [[["a", 100, 0]], [["a", 1, 100]]]
    assert _scheduled(run_ledger(FIXED["long-prefill-single"])) == _scheduled(theirs)


def test_eos_before_min_tokens_matches_vllm(scheduler_runs) -> None:
    theirs = scheduler_runs[("fixed", "eos-before-min-tokens")]["records"]
    assert _outputs(theirs) == [["a", [EOS], "stop"]]
    assert _outputs(run_ledger(FIXED["eos-before-min-tokens"])) == _outputs(theirs)


def test_unchunked_long_prefill_cap_comes_before_the_budget_check_as_in_vllm(
    scheduler_runs,
) -> None:
    theirs = scheduler_runs[("fixed", "unchunked-long-prefill-cap")]["records"]
    assert _scheduled(theirs)[0] == [["a", 16, 0], ["b", 16, 0]]
    assert run_ledger(FIXED["unchunked-long-prefill-cap"]) == theirs


def test_async_last_full_block_is_stored_and_hit_as_in_vllm(scheduler_runs) -> None:
    theirs = scheduler_runs[("fixed", "async-last-block")]["records"]
    ours = run_ledger(FIXED["async-last-block"])
    assert ours == theirs
    stored_at = [i for i, r in enumerate(ours) if b"BlockStored" in bytes.fromhex(r["events"])]
    # Stored when a's last token comes back (an update with no step scheduled), then hit by b.
    assert (
        stored_at
        and "schedule" in ours[stored_at[0]]
        and not ours[stored_at[0]]["schedule"]["scheduled"]
    )
    assert ["b", 1, 4] in [item for step in _scheduled(ours) for item in step]
