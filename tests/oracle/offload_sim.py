"""A small scheduler loop that drives an offloading connector's scheduler side, shared by both
sides of the connector differential (stdlib only: vLLM's venv runs it too).

It calls the connector the way vLLM 0.33's Scheduler does, step by step: workers' reports
(`update_connector_output`), finished requests (`request_finished`, then their blocks freed),
running requests grown (preempted when no block is free), waiting ones admitted with a GPU
prefix-cache hit and the connector's lookup (`get_num_new_matched_tokens`), loads issued
(`update_state_after_alloc`) and waited for, then `build_connector_meta`. A job issued in step N
is reported in step N+1, or later when the workload delays it (a flushed job never is); with
two workers each reports separately. A load the connector makes synchronous (a sync-load
budget: the lookup says not async) is copied before the step's forward pass: its request runs
in the step that loads it, and every worker reports the job with that step's result. The GPU prefix cache is a bounded set of block hashes (the
connector never sees it, only the hit it yields); block ids are reused first-freed-first, so a
finished request's blocks are reallocated while its stores are in flight.

Each side's Backend turns the plain calls into its own objects. Every connector answer, every
step's jobs and flushes, the KV-event bytes and the manager's state are recorded.
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from typing import Any, Protocol

# Request states of the loop (the connector sees vLLM's statuses through the backend).
WAITING, LOADING, RUNNING, FINISHED = "waiting", "loading", "running", "finished"
# One token's KV on a worker in vLLM's side (FullAttentionSpec: 1 layer, 1 head of size 1, K and
# V, float32): the sync-load budget's unit.
KV_BYTES_PER_TOKEN = 8


class Backend(Protocol):
    def add(self, rid: str, prompt: list[int], hashes: list[bytes]) -> None: ...
    def append(self, rid: str, token: int, hashes: list[bytes]) -> None: ...
    def set_state(self, rid: str, status: str, num_computed: int) -> None: ...
    def matched(self, rid: str, num_local: int) -> list: ...
    def after_alloc(self, rid: str, blocks: list[list], num_external: int) -> None: ...
    def build_meta(
        self,
        new: list[tuple[str, list[int]]],
        cached: list[tuple[str, list[int]]],
        num_scheduled: dict[str, int],
        finished: list[str],
        preempted: list[str],
    ) -> dict[str, Any]: ...
    def output(self, completed: list[tuple[int, int]]) -> None: ...
    def request_finished(self, rid: str) -> None: ...
    def reset(self) -> None: ...
    def events(self) -> str: ...
    def probe(self) -> list: ...


def block_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    hashes: list[bytes] = []
    parent = b"none"
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + repr(tokens[start : start + block_size]).encode()).digest()
        hashes.append(parent)
    return hashes


def generate_workload(seed: int, num_requests: int = 40, **config: Any) -> dict[str, Any]:
    rng = random.Random(seed)
    block_size = rng.choice([4, 8, 16])
    cfg = {
        "seed": seed,
        "block_size": block_size,
        "policy": rng.choice(["lru", "arc"]),
        "num_chunks": rng.choice([2, 4, 8, 16, 32, 64]),
        "num_gpu_blocks": rng.choice([18, 24, 48]),
        "num_workers": rng.choice([1, 1, 2]),
        "max_running": rng.choice([2, 4, 8]),
        "token_budget": rng.choice([16, 32, 64, 128]),
        "gpu_cache_blocks": rng.choice([0, 2, 8, 32]),  # the GPU prefix cache's size, in hashes
        "max_delay": rng.choice([0, 0, 1, 3]),  # extra steps before a job is reported
        "abort_rate": rng.choice([0.0, 0.02, 0.05]),
        "reset_rate": rng.choice([0.0, 0.0, 0.01]),
    }
    # The sync-load budget, in blocks, from a stream of its own (the other choices stay as they
    # were before it existed): none in 3 of 7 workloads, else from a block or two a step (tight
    # enough that two admissions in a step compete for it) to unbounded.
    sync_blocks = random.Random(seed * 104729 + 3).choice([0, 0, 0, 3, 8, 24, 1 << 20])
    cfg["sync_load_budget_bytes"] = sync_blocks * block_size * KV_BYTES_PER_TOKEN
    cfg.update(config)
    documents = [[rng.randrange(50) for _ in range(8 * block_size)] for _ in range(3)]
    requests = []
    for index in range(num_requests):
        document = rng.choice(documents)
        prompt = document[: rng.randint(1, len(document))]
        prompt = prompt + [rng.randrange(50) for _ in range(rng.randint(0, 2 * block_size))]
        requests.append(
            {
                "rid": f"r{index}",
                "prompt": prompt,
                "max_tokens": rng.randint(1, 3 * block_size),
                "arrival": rng.randint(0, 3 * num_requests),
            }
        )
    return {"config": cfg, "requests": requests}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Loop:
    def __init__(self, backend: Backend, workload: dict[str, Any]) -> None:
        self.backend = backend
        self.cfg = cfg = workload["config"]
        self.rng = random.Random(cfg["seed"] * 7919 + 1)
        self.bs = cfg["block_size"]
        self.pending = sorted(workload["requests"], key=lambda r: r["arrival"])
        self.reqs: dict[str, dict[str, Any]] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.free_blocks = deque(range(1, cfg["num_gpu_blocks"]))
        self.gpu_cache: dict[bytes, None] = {}
        self.reports: dict[int, list[tuple[int, int]]] = {}  # step -> (job id, workers)
        self.loads: dict[int, tuple[str, int]] = {}  # load job -> (request, workers to report)
        self.step = 0

    # --- bookkeeping of the loop itself ---

    def _free(self, rid: str) -> None:
        req = self.reqs[rid]
        self.free_blocks.extend(req["blocks"])
        req["blocks"] = []

    def _alloc(self, n: int) -> list[int] | None:
        if n > len(self.free_blocks):
            return None
        return [self.free_blocks.popleft() for _ in range(n)]

    def _cache(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.gpu_cache.pop(h, None)
            self.gpu_cache[h] = None
        while len(self.gpu_cache) > self.cfg["gpu_cache_blocks"]:
            del self.gpu_cache[next(iter(self.gpu_cache))]

    def _report(self, job_id: int, delay: int, together: bool = False) -> None:
        workers = self.cfg["num_workers"]
        if workers > 1 and not together and self.rng.random() < 0.5:
            self.reports.setdefault(self.step + delay, []).append((job_id, 1))
            self.reports.setdefault(self.step + delay + 1, []).append((job_id, workers - 1))
        else:
            self.reports.setdefault(self.step + delay, []).append((job_id, workers))

    def _finish(self, rid: str, status: str, finished: list[str]) -> None:
        req = self.reqs[rid]
        req["state"] = FINISHED
        self.backend.set_state(rid, status, req["computed"])
        self.backend.request_finished(rid)
        self._free(rid)
        finished.append(rid)

    # --- one step ---

    def run(self, max_steps: int = 400) -> list[dict[str, Any]]:
        records = []
        while self.step < max_steps and (
            self.pending or self.waiting or self.running or self.reports or self.loads
        ):
            records.append(self.one_step())
            self.step += 1
        return records

    def one_step(self) -> dict[str, Any]:
        backend, bs, rng, cfg = self.backend, self.bs, self.rng, self.cfg
        record: dict[str, Any] = {"step": self.step, "matched": []}
        # The workers' reports from the last step.
        completed: dict[int, int] = {}
        for job_id, workers in self.reports.pop(self.step, []):
            completed[job_id] = completed.get(job_id, 0) + workers
        if completed:
            backend.output(list(completed.items()))
            for job_id, workers in completed.items():
                if job_id not in self.loads:
                    continue
                rid, remaining = self.loads[job_id]
                if remaining > workers:
                    self.loads[job_id] = (rid, remaining - workers)
                    continue
                del self.loads[job_id]
                if self.reqs[rid]["state"] == LOADING:
                    self.reqs[rid]["state"] = WAITING  # loaded by every worker
        if cfg["reset_rate"] and rng.random() < cfg["reset_rate"]:
            backend.reset()
            record["reset"] = True
        # Arrivals.
        while self.pending and self.pending[0]["arrival"] <= self.step:
            spec = self.pending.pop(0)
            rid = spec["rid"]
            self.reqs[rid] = {
                "tokens": list(spec["prompt"]),
                "num_prompt": len(spec["prompt"]),
                "max_tokens": spec["max_tokens"],
                "computed": 0,
                "blocks": [],
                "state": WAITING,
                "done": False,
                "loaded": False,
            }
            backend.add(rid, spec["prompt"], block_hashes(spec["prompt"], bs))
            self.waiting.append(rid)
        # Requests that finished in the last step, and aborts.
        finished: list[str] = []
        for rid in list(self.running):
            req = self.reqs[rid]
            if req["done"]:
                self.running.remove(rid)
                self._finish(rid, "length", finished)
            elif cfg["abort_rate"] and rng.random() < cfg["abort_rate"]:
                self.running.remove(rid)
                self._finish(rid, "aborted", finished)
        for rid in list(self.waiting):
            if (
                self.reqs[rid]["state"] == WAITING
                and cfg["abort_rate"]
                and rng.random() < cfg["abort_rate"] / 4
            ):
                self.waiting.remove(rid)
                self._finish(rid, "aborted", finished)

        budget = cfg["token_budget"]
        new: list[tuple[str, list[int]]] = []
        cached: list[tuple[str, list[int]]] = []
        num_scheduled: dict[str, int] = {}
        preempted: list[str] = []
        # Running requests first, in admission order; the newest is preempted for blocks.
        for rid in list(self.running):
            if rid not in self.running or budget == 0:
                continue
            req = self.reqs[rid]
            n = min(len(req["tokens"]) - req["computed"], budget)
            need = _cdiv(req["computed"] + n, bs) - len(req["blocks"])
            blocks: list[int] | None = []
            while need > 0:
                blocks = self._alloc(need)
                if blocks is not None:
                    break
                victim = self.running.pop()
                vreq = self.reqs[victim]
                self._free(victim)
                vreq.update(computed=0, state=WAITING, loaded=False)
                backend.set_state(victim, "preempted", 0)
                self.waiting.insert(0, victim)
                preempted.append(victim)
                num_scheduled.pop(victim, None)
                cached[:] = [c for c in cached if c[0] != victim]
                if victim == rid:
                    break
            if rid not in self.running:
                continue
            assert blocks is not None
            req["blocks"].extend(blocks)
            cached.append((rid, blocks))
            num_scheduled[rid] = n
            budget -= n
        # Waiting requests, in order, while seats, budget and blocks last.
        for rid in list(self.waiting):
            req = self.reqs[rid]
            if budget == 0 or len(self.running) >= cfg["max_running"] or preempted:
                break
            if req["state"] == LOADING:
                continue
            num_external, load_async = 0, False
            if not req["loaded"]:
                hashes = block_hashes(req["tokens"], bs)
                local = 0
                limit = (len(req["tokens"]) - 1) // bs
                while local < limit and hashes[local] in self.gpu_cache:
                    local += 1
                hit, load_async = backend.matched(rid, local * bs)
                record["matched"].append([rid, local * bs, hit, load_async])
                if hit is None:
                    continue  # asked again next step
                req["computed"] = local * bs
                num_external = hit
            sync_load = bool(num_external) and not load_async
            if load_async:
                blocks = self._alloc(_cdiv(req["computed"] + num_external, bs) - len(req["blocks"]))
                if blocks is None:
                    req["computed"] = 0
                    break
                req["blocks"].extend(blocks)
                table = [[b, i < req["computed"] // bs] for i, b in enumerate(req["blocks"])]
                backend.after_alloc(rid, table, num_external)
                req["computed"] += num_external
                req["state"], req["loaded"] = LOADING, True
                backend.set_state(rid, "waiting_for_kvs", req["computed"])
                continue
            if sync_load:
                req["computed"] += num_external  # loaded before this step's forward pass
            n = min(len(req["tokens"]) - req["computed"], budget)
            blocks = self._alloc(_cdiv(req["computed"] + n, bs) - len(req["blocks"]))
            if blocks is None:
                if not req["loaded"]:
                    req["computed"] = 0
                break
            req["blocks"].extend(blocks)
            table = [[b, i < req["computed"] // bs] for i, b in enumerate(req["blocks"])]
            backend.after_alloc(rid, table, num_external if sync_load else 0)
            self.waiting.remove(rid)
            self.running.append(rid)
            req["state"] = RUNNING
            backend.set_state(rid, "running", req["computed"])
            new.append((rid, list(req["blocks"])))
            num_scheduled[rid] = n
            budget -= n

        meta = backend.build_meta(new, cached, num_scheduled, finished, preempted)
        record["meta"] = meta
        flushed = set(meta["flush"])
        for job in meta["loads"]:
            if job[5]:  # sync: copied before the forward pass, reported with this step
                self._report(job[0], 1, together=True)
            else:
                self.loads[job[0]] = (job[1], cfg["num_workers"])
        for job in [load for load in meta["loads"] if not load[5]] + meta["stores"]:
            self._report(job[0], 1 + rng.randint(0, cfg["max_delay"]))
        for job_id in flushed:
            for when in list(self.reports):
                entries = [e for e in self.reports[when] if e[0] == job_id]
                if entries and when > self.step + 1:
                    self.reports[when] = [e for e in self.reports[when] if e[0] != job_id]
                    self.reports.setdefault(self.step + 1, []).extend(entries)
            self.reports = {k: v for k, v in self.reports.items() if v}

        # The model runs: tokens computed, one sampled where a request reaches its end.
        for rid, n in num_scheduled.items():
            req = self.reqs[rid]
            req["computed"] += n
            full = req["computed"] // bs
            self._cache(block_hashes(req["tokens"][: full * bs], bs))
            if req["computed"] == len(req["tokens"]):
                token = rng.randrange(50)
                req["tokens"].append(token)
                backend.append(rid, token, block_hashes(req["tokens"], bs))
                if len(req["tokens"]) - req["num_prompt"] >= req["max_tokens"]:
                    req["done"] = True
            backend.set_state(rid, "running", req["computed"])
        record["events"] = backend.events()
        record["probe"] = backend.probe()
        return record
