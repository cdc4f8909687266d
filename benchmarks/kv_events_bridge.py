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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvledger.bridge import SOURCE_SEQ_FIELD  # noqa: E402
from services.transport import redis_client  # noqa: E402
from services.transport.redis_server import RedisServer, free_port  # noqa: E402
from tests.harness.processes import ServiceProcess  # noqa: E402

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


def one_run(url: str, driver: Driver, args: argparse.Namespace, rep: int) -> dict:
    ports = free_port(), free_port()
    prefix = f"bb{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
    env.update(
        KVLEDGER_REDIS_URL=url, KVLEDGER_STREAM_PREFIX=prefix, KVLEDGER_REPLICA="vllm-0",
        KVLEDGER_BRIDGE_ENDPOINT=f"tcp://127.0.0.1:{ports[0]}",
        KVLEDGER_BRIDGE_REPLAY_ENDPOINT=f"tcp://127.0.0.1:{ports[1]}",
        KVLEDGER_LOG_FORMAT="json", KVLEDGER_LOG_LEVEL="warning", PYTHONPATH=str(ROOT),
    )  # fmt: skip
    bridge = ServiceProcess("bridge", env, keep_lines=50).start()
    client = redis_client.connect_sync(url)
    stream = f"{prefix}:{{vllm-0}}:kv-events"
    try:
        while not client.exists(f"{prefix}:{{vllm-0}}:ledger:status"):
            time.sleep(0.05)
        with tempfile.TemporaryDirectory() as tmp:
            published = driver.call({
                "cmd": "publish", "endpoint": f"tcp://*:{ports[0]}",
                "replay_endpoint": f"tcp://*:{ports[1]}", "batch_events": args.batch_events,
                "batches": args.batches, "rate": args.rate, "seed": rep, "linger_s": 0.0,
                "delay_s": 0.3, "out": str(Path(tmp) / "published.msgpack"),
            })  # fmt: skip
        deadline = time.monotonic() + 300
        while True:
            last = client.xrevrange(stream, count=1)
            if last and last[0][1].get(SOURCE_SEQ_FIELD) == b"%d" % (args.batches - 1):
                break
            assert time.monotonic() < deadline, bridge.output()
            time.sleep(0.01)
        entries = client.xrange(stream)
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
        }
    finally:
        bridge.stop()
        client.delete(stream, f"{prefix}:{{vllm-0}}:kv-events:snapshot")
        client.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--batch-events", type=int, default=100)
    parser.add_argument("--rate", type=float, default=0.0,
                        help="events/s vLLM's publisher sends (0: as fast as it goes)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    runs = []
    driver = Driver()
    try:
        with RedisServer() as server:
            for rep in range(args.repeats):
                run = one_run(server.url, driver, args, rep)
                runs.append(run)
                print(f"rep {rep}: vLLM publisher {run['vllm_events_per_s'] / 1e3:.1f}k events/s, "
                      f"bridge {run['bridge_events_per_s'] / 1e3:.1f}k events/s", flush=True)  # fmt: skip
    finally:
        driver.close()
    vllm = [r["vllm_events_per_s"] for r in runs]
    bridge = [r["bridge_events_per_s"] for r in runs]
    ratio = [b / v for b, v in zip(bridge, vllm, strict=True)]
    print(f"\n{args.batches:,} batches of {args.batch_events} events, "
          f"{'as fast as vLLM publishes' if not args.rate else f'{args.rate:,.0f} events/s'}; "
          f"median of {args.repeats} (min-max), load {os.getloadavg()}")  # fmt: skip
    print(f"{'':<22}{'events/s':>26}")
    for name, vals in (("vLLM's publisher", vllm), ("kvledger bridge", bridge)):
        print(f"{name:<22}{statistics.median(vals) / 1e3:>10.1f}k "
              f"({min(vals) / 1e3:.1f}k-{max(vals) / 1e3:.1f}k)")  # fmt: skip
    print(f"bridge / publisher: {statistics.median(ratio):.0%} (target >= 80%)")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "args": vars(args) | {"json": None},
                                         "load": os.getloadavg()}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
