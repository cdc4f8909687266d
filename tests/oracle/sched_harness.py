"""The step loop of the scheduler-level differential, shared by both sides.

Stdlib only: vLLM's venv imports it in `vllm_sched_driver.py` and ours in `sched_trace.py`, so
both schedulers see the same calls in the same order by construction (arrivals, aborts,
prefix-cache resets, schedule, the sampled tokens of each step) and differ only in the
`Backend` that wraps a scheduler.

The loop is the ledger service's (`engine/engine.py`): with async scheduling two steps
are in flight, so step N+1 is scheduled before step N's tokens are back; an empty step is not
sent. Every sampled token is a fixed function of (request, position), so both sides feed back the
same tokens for as long as they agree, and EOS (7) in a 50-token vocabulary stops some requests.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from typing import Any, Protocol

EOS = 7
SAMPLE_VOCAB = 50


def sampled_token(index: int, position: int, seed: int) -> int:
    return (index * 7919 + position * 104729 + seed * 31) % SAMPLE_VOCAB


def digest(record: dict[str, Any]) -> str:
    """A step record's fingerprint: thousands of steps cross the process boundary as these."""
    return hashlib.sha1(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


class Backend(Protocol):
    """One scheduler (ours or vLLM's) behind the calls the loop makes."""

    def add(self, spec: dict[str, Any], index: int) -> None: ...
    def abort(self, rids: list[str]) -> list[str]: ...
    def reset_prefix_cache(self) -> bool: ...
    def has_unfinished(self) -> bool: ...
    def schedule(self) -> tuple[Any, dict[str, Any], list[str]]:
        """The step (handle), its side-neutral record, and the ids that sample in it."""
        ...

    def update(self, step: Any, sampled: dict[str, int]) -> list[list[Any]]:
        """Apply a step's tokens; per output [rid, new_token_ids, finish_reason or None]."""
        ...

    def num_tokens(self, rid: str) -> int | None: ...
    def state(self, ts: float) -> dict[str, Any]:
        """KV events since the last call (bytes, hex), free-queue order, ref counts."""
        ...


def drive(workload: dict[str, Any], backend: Backend, max_steps: int = 20_000) -> list[dict]:
    """Run a workload to the end; one record per loop iteration."""
    config = workload["config"]
    depth = 2 if config["async_scheduling"] else 1
    seed = config["seed"]
    pending = deque(sorted(workload["requests"], key=lambda r: r["arrival_step"]))
    index = {spec["rid"]: i for i, spec in enumerate(workload["requests"])}
    aborts: dict[tuple[int, str], list[str]] = {}
    for abort in workload.get("aborts", ()):
        aborts.setdefault((abort["step"], abort["phase"]), []).append(abort["rid"])
    resets = set(workload.get("resets", ()))
    in_flight: deque[tuple[Any, list[str]]] = deque()
    records: list[dict] = []
    step = 0
    while step < max_steps:
        record: dict[str, Any] = {"step": step}
        while pending and pending[0]["arrival_step"] <= step:
            spec = pending.popleft()
            backend.add(spec, index[spec["rid"]])
        if (step, "before") in aborts:
            record["aborted"] = backend.abort(aborts[(step, "before")])
        if step in resets:
            record["reset"] = backend.reset_prefix_cache()
        if not in_flight and not backend.has_unfinished():
            if not pending:
                break
            # Idle until the next arrival: the moment a prefix-cache reset can succeed.
            if config.get("reset_when_idle"):
                record["reset"] = backend.reset_prefix_cache()
            record.update(backend.state(float(step)))
            records.append(record)
            step = max(step + 1, pending[0]["arrival_step"])
            continue
        sent = False
        if len(in_flight) < depth and backend.has_unfinished():
            handle, scheduled, sampling = backend.schedule()
            record["schedule"] = scheduled
            if scheduled["scheduled"]:
                in_flight.append((handle, sampling))
                sent = True
        if in_flight and (len(in_flight) == depth or not sent):
            if (step, "between") in aborts:
                record["aborted"] = backend.abort(aborts[(step, "between")])
            handle, sampling = in_flight.popleft()
            sampled = {}
            for rid in sampling:
                num_tokens = backend.num_tokens(rid)
                if num_tokens is not None:
                    sampled[rid] = sampled_token(index[rid], num_tokens, seed)
            record["outputs"] = backend.update(handle, sampled)
        record.update(backend.state(float(step)))
        records.append(record)
        step += 1
    return records
