"""Where tracing's CPU goes, per process: the thread CPU time spent inside the tracing code of each
service (`kvledger up`, the tiny model, the load of benchmarks/tracing.py), per request.

    python benchmarks/tracing_probe.py [--sampling 1.0|0.1|off] [--runs 4] [--tree DIR]

On a shared machine throughput and whole-process CPU swing by more than tracing costs; the CPU
of the calls that trace does not (the same calls, timed from inside). Each service gets a
`sitecustomize` that wraps the tracing entry points (span making, the exporter's encoding and
HTTP, the gateway's GenAI attributes and traceparent, the worker's step spans; the ledger's
telemetry hooks, which also keep metrics: compare them with `--sampling off`) with
`time.thread_time`, counting a nested call once, at the outermost wrapped call; and the time
the garbage collector takes, by generation (not tracing's alone either). `--tree` runs
another checkout (e.g. main) the same way, for a before and after. It measures what the
wrapped calls cost where they run (cold caches beside the model included), not what tracing
costs elsewhere (allocation, the export thread's wake-ups).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import benchmarks.tracing as bench  # noqa: E402
from kvledger.report import format_table  # noqa: E402

# (module, attribute path, category, roles): whatever a tree lacks is skipped.
TARGETS = [
    ("observability.lean_spans", "LeanTracer._start", "span start", "*"),
    *[
        ("observability.lean_spans", f"LeanSpan.{m}", f"span {m}", "*")
        for m in ("end", "set_attribute", "set_attributes", "add_event", "add_link")
    ],
    ("opentelemetry.sdk.trace", "Tracer.start_span", "span start", "*"),
    *[
        ("opentelemetry.sdk.trace", f"Span.{m}", f"span {m}", "*")
        for m in ("end", "set_attribute", "set_attributes", "add_event", "add_link")
    ],
    ("observability.otlp_encoding", "encode_spans", "export: encode", "*"),
    ("opentelemetry.exporter.otlp.common.http", "_OTLPHTTPClient.export", "export: http", "*"),
    ("gateway.inflight", "inject_traceparent", "traceparent", "gateway"),
    ("gateway.genai", "request_attributes", "GenAI attributes", "gateway"),
    ("gateway.genai", "response_attributes", "GenAI attributes", "gateway"),
    ("engine.telemetry", "LedgerTelemetry.request_added", "telemetry hooks*", "ledger"),
    ("engine.telemetry", "LedgerTelemetry.on_schedule", "telemetry hooks*", "ledger"),
    ("engine.telemetry", "LedgerTelemetry.request_finished", "telemetry hooks*", "ledger"),
    ("gpu_worker.request_spans", "RequestSpans.step", "step spans", "worker"),
]
ROLES = ("gateway", "ledger", "worker")

SITECUSTOMIZE = """
import os, sys
_OUT = os.environ.get("KVLEDGER_TRACING_PROBE")
_ROLE = next((r for r in ("gateway", "ledger", "worker") if r in sys.argv), None)
if _OUT and _ROLE:
    import functools, json, threading, time
    _targets = json.loads(os.environ["KVLEDGER_TRACING_PROBE_TARGETS"])
    _totals, _local, _clock = {}, threading.local(), time.thread_time

    def _wrap(owner, name, category):
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if getattr(_local, "inside", False):
                return original(*args, **kwargs)
            _local.inside = True
            started = _clock()
            try:
                return original(*args, **kwargs)
            finally:
                _local.inside = False
                entry = _totals.setdefault(category, [0.0, 0])
                entry[0] += _clock() - started
                entry[1] += 1

        setattr(owner, name, timed)

    def _patch():
        pending = [t for t in _targets if t[3] in ("*", _ROLE)]
        deadline = time.monotonic() + 120
        while pending and time.monotonic() < deadline:
            for target in list(pending):
                module = sys.modules.get(target[0])
                if module is None:
                    continue
                owner, path = module, target[1].split(".")
                try:  # a module still importing lacks its names yet: try again later
                    for part in path[:-1]:
                        owner = getattr(owner, part)
                    getattr(owner, path[-1])
                except AttributeError:
                    continue
                _wrap(owner, path[-1], target[2])
                pending.remove(target)
            time.sleep(0.02)

    def _dump():
        path = os.path.join(_OUT, f"{_ROLE}.json")
        while True:
            time.sleep(0.25)
            with open(path + ".tmp", "w") as out:
                json.dump(_totals, out)
            os.replace(path + ".tmp", path)

    import gc

    def _collecting(phase, info, _started=[0.0]):
        if phase == "start":
            _started[0] = time.perf_counter()
        else:
            entry = _totals.setdefault(f"gc gen{info['generation']}*", [0.0, 0])
            entry[0] += time.perf_counter() - _started[0]
            entry[1] += 1

    gc.callbacks.append(_collecting)
    threading.Thread(target=_patch, daemon=True).start()
    threading.Thread(target=_dump, daemon=True).start()
"""


def read(out: Path) -> dict[str, dict[str, float]]:
    totals = {}
    for role in ROLES:
        path = out / f"{role}.json"
        totals[role] = (
            {k: v[0] for k, v in json.loads(path.read_text()).items()} if path.exists() else {}
        )
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sampling", default="1.0", help="1.0, a ratio (0.1), or off")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout to run")
    args = parser.parse_args()
    load = argparse.Namespace(
        model="tiny", num_blocks=512, max_model_len=256, max_num_seqs=64, concurrency=48,
        requests=args.requests, prompt_len=64, prefix_len=32, max_tokens=32, seed=0,
    )  # fmt: skip
    env: dict[str, str] = {}
    if args.sampling not in ("off", "1.0", "1"):
        env = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
               "OTEL_TRACES_SAMPLER_ARG": args.sampling}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        site, out = Path(tmp, "site"), Path(tmp, "out")
        site.mkdir()
        out.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        tree = str(args.tree.resolve())
        os.environ.update(
            KVLEDGER_TRACING_PROBE=str(out),
            KVLEDGER_TRACING_PROBE_TARGETS=json.dumps(TARGETS),
            PYTHONPATH=os.pathsep.join([str(site), tree]),
        )
        bench.ROOT = Path(tree)  # the stack runs from the tree measured
        stack = bench.start_stack("off" if args.sampling == "off" else "on", load, env)
        try:
            prompts = bench.workload(load)
            asyncio.run(bench.drive(stack.url, prompts[: load.concurrency], load))  # warm up
            runs: list[dict[str, dict[str, float]]] = []
            for _ in range(args.runs):
                time.sleep(0.5)
                before = read(out)
                asyncio.run(bench.drive(stack.url, prompts, load))
                time.sleep(6.0)  # past the batch processors' 5 s schedule: the exports too
                after = read(out)
                runs.append(
                    {
                        role: {
                            k: 1e6 * (v - before[role].get(k, 0.0)) / args.requests
                            for k, v in after[role].items()
                        }
                        for role in ROLES
                    }
                )
        finally:
            stack.process.terminate()
            stack.process.wait(timeout=30)
            if stack.receiver is not None:
                stack.receiver.close()
    categories = sorted({k for run in runs for role in ROLES for k in run[role]})
    rows = []
    for role in ROLES:
        medians = {k: statistics.median(run[role].get(k, 0.0) for run in runs) for k in categories}
        tracing = sum(v for k, v in medians.items() if not k.endswith("*"))
        cells = [f"{medians[k]:.1f}" if medians[k] else "" for k in categories]
        rows.append([role, f"{tracing:.1f}", *cells])
    title = (
        f"thread CPU in tracing calls, us a request (median of {args.runs} runs of "
        f"{args.requests}; sampling {args.sampling}; tree {args.tree}). * not tracing alone: "
        "compare with --sampling off"
    )
    print(format_table(["process", "tracing us/request", *categories], rows, title=title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
