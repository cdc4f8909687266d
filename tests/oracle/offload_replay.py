"""Random op sequences against a CPU offloading manager, shared by both sides of the differential.

Stdlib only: vLLM's venv imports it in `vllm_offload_driver.py` and ours in the tests, so both
sides make the same calls by construction. A trace holds intents ("load what request r hits from
its 3rd block on"); the replay turns each into manager calls using that manager's own answers,
and records every answer, the events each op produced and a probe of the manager's state.

A trace is {"config": {...}, "requests": {rid: {"keys": [int], "positions": bool}}, "ops": [...]}
with ops
  {"op": "new", "rid"}                               on_new_request (positions set if asked)
  {"op": "lookup", "rid", "start"}                   lookup keys[start:] up to the first MISS
  {"op": "load", "rid", "start", "max"}              prepare_load the HIT run from keys[start:]
  {"op": "complete_load", "pick"}                   complete one in-flight load (pick in [0, 1)
                                                     chooses which, oldest first)
  {"op": "store", "rid", "start", "end"}             prepare_store keys[start:end]
  {"op": "complete_store", "pick", "success", "whole"} complete one in-flight store (whole:
                                                      every key offered, not only those stored)
  {"op": "touch", "rid", "start", "end"}             touch keys[start:end]
  {"op": "finish", "rid"}                            on_request_finished (no submits after)
  {"op": "reset"}                                    reset_cache; in-flight jobs are dropped
Intents that cannot apply (a load of nothing, a completion with no job) are recorded as skipped.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Protocol

BLOCK_SIZE = 16
Op = dict[str, Any]


def key_bytes(key: int) -> bytes:
    """The OffloadKey of the trace's key number: a 32-byte block hash, then group 0."""
    return hashlib.sha256(b"block-%d" % key).digest() + bytes(4)


class Backend(Protocol):
    """One manager (ours or vLLM's), keys as the trace's ints."""

    def new(self, rid: str, keys: list[int], positions: list[int] | None) -> None: ...
    def lookup(self, rid: str, key: int) -> str: ...
    def prepare_load(self, rid: str, keys: list[int]) -> list[int]: ...
    def complete_load(self, rid: str, keys: list[int]) -> None: ...
    def touch(self, rid: str, keys: list[int]) -> None: ...
    def prepare_store(self, rid: str, keys: list[int]) -> list | None: ...
    def complete_store(self, rid: str, keys: list[int], success: bool) -> None: ...
    def finish(self, rid: str) -> None: ...
    def reset(self) -> None: ...
    def take_events(self) -> tuple[list, str]: ...
    def probe(self) -> dict[str, Any]: ...


def replay(backend: Backend, trace: dict[str, Any]) -> list[dict[str, Any]]:
    requests = trace["requests"]
    loads: list[tuple[str, list[int]]] = []
    stores: list[tuple[str, list[int], list[int]]] = []
    finished: set[str] = set()
    results: list[dict[str, Any]] = []
    for op in trace["ops"]:
        kind, rid = op["op"], op.get("rid", "")
        keys = requests[rid]["keys"] if rid else []
        out: dict[str, Any] = {"op": kind}
        submit = kind in ("lookup", "load", "store", "touch", "finish")
        try:
            if kind == "new":
                positions = (
                    [(i + 1) * BLOCK_SIZE for i in range(len(keys))]
                    if requests[rid]["positions"]
                    else None
                )
                backend.new(rid, keys, positions)
            elif kind == "reset":
                backend.reset()
                loads.clear()
                stores.clear()
            elif submit and rid in finished:
                out["skipped"] = True
            elif kind == "lookup":
                found = []
                for key in keys[op["start"] :]:
                    found.append(backend.lookup(rid, key))
                    if found[-1] == "MISS":
                        break
                out["found"] = found
            elif kind == "load":
                run: list[int] = []
                for key in keys[op["start"] :][: op["max"]]:
                    if backend.lookup(rid, key) != "HIT":
                        break
                    run.append(key)
                if run:
                    out["chunks"] = backend.prepare_load(rid, run)
                    loads.append((rid, run))
                else:
                    out["skipped"] = True
            elif kind == "complete_load":
                if loads:
                    backend.complete_load(*loads.pop(int(op["pick"] * len(loads))))
                else:
                    out["skipped"] = True
            elif kind == "store":
                offered = keys[op["start"] : op["end"]]
                stored = backend.prepare_store(rid, offered)
                out["stored"] = stored
                if stored is not None and stored[0]:
                    stores.append((rid, stored[0], offered))
            elif kind == "complete_store":
                if stores:
                    job_rid, to_store, offered = stores.pop(int(op["pick"] * len(stores)))
                    job = offered if op["whole"] else to_store
                    backend.complete_store(job_rid, job, op["success"])
                else:
                    out["skipped"] = True
            elif kind == "touch":
                backend.touch(rid, keys[op["start"] : op["end"]])
            elif kind == "finish":
                backend.finish(rid)
                finished.add(rid)
            else:
                raise ValueError(f"unknown op {kind!r}")
        except Exception as exc:  # both sides record where they broke, and stop there
            out["error"] = type(exc).__name__
            results.append(out)
            break
        out["events"], out["kv_events"] = backend.take_events()
        out["probe"] = backend.probe()
        results.append(out)
    return results


def generate_trace(seed: int, num_ops: int = 300, **config: Any) -> dict[str, Any]:
    """A random trace: a small key universe shared by prefix (tight capacity, many evictions)."""
    rng = random.Random(seed)
    cfg = {
        "policy": rng.choice(["lru", "arc"]),
        "num_chunks": rng.choice([1, 2, 3, 4, 6, 8, 12, 16]),
        "store_threshold": rng.choice([0, 0, 0, 0, 2, 3]),
        "max_tracker_size": rng.choice([4, 16, 64_000]),
    }
    cfg.update(config)
    # A few documents; a request is a prefix of one, then keys of its own or from elsewhere.
    num_keys = rng.choice([12, 24, 48])
    documents = [rng.sample(range(num_keys), min(num_keys, 12)) for _ in range(3)]
    requests: dict[str, dict[str, Any]] = {}
    live: list[str] = []
    ops: list[Op] = []
    weights = {
        "new": 8,
        "lookup": 12,
        "load": 14,
        "complete_load": 6,
        "store": 20,
        "complete_store": 11,
        "touch": 6,
        "finish": 7,
        "reset": 1,
    }
    kinds, kind_weights = list(weights), list(weights.values())
    while len(ops) < num_ops:
        kind = rng.choices(kinds, kind_weights)[0]
        if kind == "new" or not requests:
            rid = f"r{len(requests)}"
            document = rng.choice(documents)
            keys = document[: rng.randint(1, len(document))]
            keys = keys + [
                k for k in rng.sample(range(num_keys), rng.randint(0, 4)) if k not in keys
            ]
            requests[rid] = {"keys": keys, "positions": rng.random() < 0.85}
            live.append(rid)
            ops.append({"op": "new", "rid": rid})
            continue
        if kind == "reset":
            ops.append({"op": "reset"})
            continue
        # Mostly the oldest jobs first, as transfers finish in about the order they started.
        pick = rng.random() ** 3
        if kind == "complete_store":
            success = rng.random() < 0.85
            whole = rng.random() < 0.3
            ops.append({"op": kind, "pick": pick, "success": success, "whole": whole})
            continue
        if kind == "complete_load":
            ops.append({"op": kind, "pick": pick})
            continue
        rid = rng.choice(live or list(requests))
        n = len(requests[rid]["keys"])
        start = rng.randrange(n) if rng.random() < 0.4 else 0
        end = rng.randint(start + 1, n)
        if kind == "lookup":
            ops.append({"op": kind, "rid": rid, "start": start})
        elif kind == "load":
            ops.append({"op": kind, "rid": rid, "start": start, "max": rng.randint(1, n)})
        elif kind in ("store", "touch"):
            ops.append({"op": kind, "rid": rid, "start": start, "end": end})
        elif kind == "finish":
            ops.append({"op": kind, "rid": rid})
            if rid in live:
                live.remove(rid)
    return {"config": cfg, "requests": requests, "ops": ops}
