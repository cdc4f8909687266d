"""`kvledger bridge` against vLLM 0.33's own ZmqEventPublisher: events per second from vLLM's
publisher into the replica's Redis stream, beside the publisher's own rate in the same run.

vLLM's publisher runs in vLLM's venv (KVLEDGER_VLLM_ORACLE; tests/oracle/vllm_zmq_driver.py's
`publish`: random batches of `--batch-events` events with LoRA names, extra keys and media, as
vLLM's KV cache manager fills them), as fast as it goes (`--rate 0`) or at a set rate; the
bridge is a real `kvledger bridge` process on a real redis-server. The publisher's rate is from
its first publish() to its queue drained; the bridge's from the first forwarded entry to the last
(their Redis ids are milliseconds), every batch checked there once, in order. Target (issue 26):
the bridge >= 80% of the publisher's rate.

    python benchmarks/kv_events_bridge.py [--batches 2000] [--rate 0] [--repeats 3]
        [--baseline-tree DIR]   # another commit's bridge, interleaved with this one's

Each run also reports the CPU per batch of the bridge, redis-server and vLLM's driver process
(/proc), from just before the publisher starts to the last entry: the driver's includes
building its batches, outside its rate's clock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import cast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvledger.bridge import SOURCE_SEQ_FIELD  # noqa: E402
from services.transport import redis_client  # noqa: E402
from services.transport.redis_server import RedisServer, free_port  # noqa: E402
from tests.harness.processes import ServiceProcess  # noqa: E402

Entry = tuple[bytes, dict[bytes, bytes]]
DRIVER = ROOT / "tests" / "oracle" / "vllm_zmq_driver.py"


def vllm_python() -> Path:
    root = os.environ.get("KVLEDGER_VLLM_ORACLE")
    if not root or not (Path(root) / "bin" / "python").exists():
        sys.exit("set KVLEDGER_VLLM_ORACLE to vLLM 0.33's venv (scripts/vllm-oracle-venv.sh)")
    return Path(root) / "bin" / "python"


class Driver:
    def __init__(self) -> None:
        self.process = subprocess.Popen([str(vllm_python()), str(DRIVER)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert self.next().get("ready")

    def next(self) -> dict:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        sys.exit("vLLM's driver exited")

    def call(self, cmd: dict) -> dict:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(cmd) + "\n")
        self.process.stdin.flush()
        answer = self.next()
        if "error" in answer:
            sys.exit(answer.get("trace") or answer["error"])
        return answer

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(60)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux: /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(
    server: RedisServer, driver: Driver, args: argparse.Namespace, rep: int, tree: Path
) -> dict:
    url = server.url
    ports = free_port(), free_port()
    prefix = f"bb{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
    env.update(
        KVLEDGER_REDIS_URL=url, KVLEDGER_STREAM_PREFIX=prefix, KVLEDGER_REPLICA="vllm-0",
        KVLEDGER_BRIDGE_ENDPOINT=f"tcp://127.0.0.1:{ports[0]}",
        KVLEDGER_BRIDGE_REPLAY_ENDPOINT=f"tcp://127.0.0.1:{ports[1]}",
        KVLEDGER_LOG_FORMAT="json", KVLEDGER_LOG_LEVEL="warning", PYTHONPATH=str(tree),
    )  # fmt: skip
    bridge = ServiceProcess("bridge", env, keep_lines=50, root=tree).start()
    client = redis_client.connect_sync(url)
    stream = f"{prefix}:{{vllm-0}}:kv-events"
    try:
        while not client.exists(f"{prefix}:{{vllm-0}}:ledger:status"):
            time.sleep(0.05)
        assert bridge.process is not None and server.process is not None
        assert driver.process is not None
        pids = {"bridge": bridge.process.pid, "redis": server.process.pid,
                "vllm_publisher": driver.process.pid}  # fmt: skip
        cpu_before = {name: cpu_s(pid) for name, pid in pids.items()}
        with tempfile.TemporaryDirectory() as tmp:
            published = driver.call({
                "cmd": "publish", "endpoint": f"tcp://*:{ports[0]}",
                "replay_endpoint": f"tcp://*:{ports[1]}", "batch_events": args.batch_events,
                "batches": args.batches, "rate": args.rate, "seed": rep, "linger_s": 0.0,
                "delay_s": 0.3, "out": str(Path(tmp) / "published.msgpack"),
            })  # fmt: skip
        deadline = time.monotonic() + 300
        while True:
            last = cast(list[Entry], client.xrevrange(stream, count=1))
            if last and last[0][1].get(SOURCE_SEQ_FIELD) == b"%d" % (args.batches - 1):
                break
            assert time.monotonic() < deadline, bridge.output()
            time.sleep(0.01)
        cpu = {name: cpu_s(pid) - cpu_before[name] for name, pid in pids.items()}
        entries = cast(list[Entry], client.xrange(stream))
        forwarded = [(i, f) for i, f in entries if SOURCE_SEQ_FIELD in f]
        seqs = [int(f[SOURCE_SEQ_FIELD]) for _, f in forwarded]
        assert seqs == list(range(args.batches)), "a lost or repeated batch"
        first_ms = int(forwarded[0][0].split(b"-")[0])
        last_ms = int(forwarded[-1][0].split(b"-")[0])
        events = args.batches * args.batch_events
        return {
            "vllm_events_per_s": published["events_per_s"],
            "bridge_events_per_s": events / max((last_ms - first_ms) / 1e3, 1e-3),
            "events": events,
            # CPU each process used from just before the publisher started to the last entry
            # (the publisher's includes building its batches, outside its rate's clock).
            "cpu_us_per_batch": {name: 1e6 * v / args.batches for name, v in cpu.items()},
        }
    finally:
        bridge.stop()
        client.delete(stream, f"{prefix}:{{vllm-0}}:kv-events:snapshot")
        client.close()


def summary(name: str, runs: list[dict]) -> None:
    vllm = [r["vllm_events_per_s"] for r in runs]
    bridge = [r["bridge_events_per_s"] for r in runs]
    ratio = [b / v for b, v in zip(bridge, vllm, strict=True)]
    cpu = {k: statistics.median(r["cpu_us_per_batch"][k] for r in runs)
           for k in runs[0]["cpu_us_per_batch"]}  # fmt: skip
    print(f"{name}:")
    for label, vals in (("vLLM's publisher", vllm), ("kvledger bridge", bridge)):
        print(f"  {label:<20}{statistics.median(vals) / 1e3:>10.1f}k events/s "
              f"({min(vals) / 1e3:.1f}k-{max(vals) / 1e3:.1f}k)")  # fmt: skip
    print(f"  bridge / publisher: {statistics.median(ratio):.0%} "
          f"({min(ratio):.0%}-{max(ratio):.0%}; target >= 80%)")  # fmt: skip
    print("  CPU us/batch (median): " + ", ".join(f"{k} {v:.0f}" for k, v in cpu.items()))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--batch-events", type=int, default=100)
    parser.add_argument("--rate", type=float, default=0.0,
                        help="events/s vLLM's publisher sends (0: as fast as it goes)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline-tree", type=Path,
                        help="a checkout of another commit whose bridge runs too, interleaved "
                             "with this one's (each rep runs both, in alternating order)")  # fmt: skip
    parser.add_argument("--baseline-name", help="what the baseline tree is, for the JSON")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    trees = {"now": ROOT} | ({"baseline": args.baseline_tree} if args.baseline_tree else {})
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    driver = Driver()
    try:
        with RedisServer() as server:
            for rep in range(args.repeats):
                order = list(trees) if rep % 2 == 0 else list(trees)[::-1]
                for name in order:
                    run = one_run(server, driver, args, rep, trees[name])
                    run["load"] = os.getloadavg()[0]
                    runs[name].append(run)
                    cpu = ", ".join(f"{k} {v:.0f}" for k, v in run["cpu_us_per_batch"].items())
                    print(f"rep {rep} {name}: vLLM publisher "
                          f"{run['vllm_events_per_s'] / 1e3:.1f}k events/s, bridge "
                          f"{run['bridge_events_per_s'] / 1e3:.1f}k events/s; CPU us/batch: "
                          f"{cpu}; load {run['load']:.1f}", flush=True)  # fmt: skip
    finally:
        driver.close()
    print(f"\n{args.batches:,} batches of {args.batch_events} events, "
          f"{'as fast as vLLM publishes' if not args.rate else f'{args.rate:,.0f} events/s'}; "
          f"median of {args.repeats} (min-max), load {os.getloadavg()}")  # fmt: skip
    for name in trees:
        summary(f"{name} ({trees[name]})", runs[name])
    if args.json:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True).stdout.strip()  # fmt: skip
        body: dict = {"runs": runs["now"], "commit": head, "args": vars(args) | {"json": None},
                      "load": os.getloadavg(), "cpus": os.cpu_count()}  # fmt: skip
        if args.baseline_tree:
            body |= {"baseline_runs": runs["baseline"],
                     "baseline": args.baseline_name or str(args.baseline_tree)}  # fmt: skip
            body["args"]["baseline_tree"] = str(args.baseline_tree)
        args.json.write_text(json.dumps(body, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
