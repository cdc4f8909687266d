"""The op-by-op replay of a manager-level trace, shared by both sides of the differential test.

Stdlib only: vLLM's venv imports it in `vllm_driver.py` and ours in the tests, so both sides run
the same call sequence by construction and differ only in the `Backend` that wraps a manager.
"""

from __future__ import annotations

from typing import Any, Protocol

# A trace is {"config": {...}, "ops": [...]}; each op is one of
#   {"op": "add", "rid", "prompt", "salt", "lora"?}     make a request (hashes its full blocks);
#                                                       lora is [name, int_id, path] or absent
#   {"op": "admit", "rid", "budget", "has_scheduled"}   the scheduler's waiting pass
#   {"op": "step", "rid", "append", "budget"}           append tokens, grow by what is uncomputed
#   {"op": "preempt", "rid"} / {"op": "free", "rid"}    free (preempt keeps the request)
#   {"op": "reset"}                                     reset_prefix_cache
Op = dict[str, Any]


class Backend(Protocol):
    """One KV cache manager (ours or vLLM's) behind the calls the replay makes."""

    def new_request(
        self, rid: str, prompt: list[int], salt: str | None, lora: list | None
    ) -> Any: ...
    def request_hashes(self, request: Any) -> list[str]: ...
    def computed_blocks(self, request: Any) -> tuple[Any, list[int], int]: ...
    def allocate(
        self,
        request: Any,
        num_new_tokens: int,
        num_hit_tokens: int = 0,
        hit: Any = None,
        *,
        admission: bool = False,
        has_scheduled: bool = True,
    ) -> list[int] | None: ...
    def append(self, request: Any, tokens: list[int]) -> None: ...
    def set_status(self, request: Any, status: str) -> None: ...
    def free(self, request: Any) -> None: ...
    def reset_prefix_cache(self) -> bool: ...
    def events(self, ts: float) -> bytes: ...
    def free_queue(self) -> list[int]: ...
    def ref_cnts(self) -> list[int]: ...
    def block_hashes(self) -> list[str | None]: ...
    def block_ids(self, rid: str) -> list[int]: ...


def apply(backend: Backend, requests: dict[str, Any], op: Op, index: int) -> dict[str, Any]:
    """Run one op and return what it did plus the pool's state after it (JSON-able)."""
    kind = op["op"]
    out: dict[str, Any] = {"op": kind}
    request = requests.get(op.get("rid", ""))
    if kind == "add":
        request = backend.new_request(op["rid"], op["prompt"], op["salt"], op.get("lora"))
        requests[op["rid"]] = request
        out["hashes"] = backend.request_hashes(request)
    elif kind == "admit":
        hit, out["hit_ids"], num_hit = backend.computed_blocks(request)
        num_new = min(request.num_tokens - num_hit, op["budget"])
        new_ids = backend.allocate(
            request, num_new, num_hit, hit, admission=True, has_scheduled=op["has_scheduled"]
        )
        out.update(hit=num_hit, ok=new_ids is not None, new_ids=new_ids)
        if new_ids is not None:
            backend.set_status(request, "running")
            request.num_computed_tokens = num_hit + num_new
    elif kind == "step":
        if op["append"]:
            backend.append(request, op["append"])
        num_new = min(request.num_tokens - request.num_computed_tokens, op["budget"])
        new_ids = backend.allocate(request, num_new)
        out.update(ok=new_ids is not None, new_ids=new_ids)
        if new_ids is not None:
            request.num_computed_tokens += num_new
    elif kind == "preempt":
        backend.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        backend.set_status(request, "preempted")
    elif kind == "free":
        backend.free(request)
        del requests[op["rid"]]
    elif kind == "reset":
        out["ok"] = backend.reset_prefix_cache()
    else:
        raise ValueError(f"unknown trace op {kind!r}")
    if "rid" in op:
        out["blocks"] = backend.block_ids(op["rid"])
    out["events"] = backend.events(float(index)).hex()
    out["free_queue"] = backend.free_queue()
    out["ref_cnt"] = backend.ref_cnts()
    out["block_hash"] = backend.block_hashes()
    return out


def replay(backend: Backend, ops: list[Op]) -> list[dict[str, Any]]:
    """Every op's result; an exception ends the replay with an {"error": ...} entry."""
    requests: dict[str, Any] = {}
    results = []
    for index, op in enumerate(ops):
        try:
            results.append(apply(backend, requests, op, index))
        except Exception as exc:  # the other side decides whether this is a difference
            results.append({"op": op["op"], "error": f"{type(exc).__name__}: {exc}"})
            break
    return results
