"""A burst past max_queue: how fast the gateway refuses, and whether /health keeps answering.

    python benchmarks/burst.py [--requests 2000] [--concurrency 1000] [--json benchmarks/results/burst.json]

Starts a private redis-server, a ledger and a worker (the tiny seeded Llama on the CPU) and a
real gateway (`kvledger gateway`, default max_queue 512, JSON logs), then sends --requests
completions at --concurrency at once. Past max_queue the gateway answers 429; each 429 is timed
in the gateway (`elapsed_s` of its `request_rejected` log line: from the handler's start to the
error) and by the client. Meanwhile a probe on its own connection asks /health every 50 ms; its
answers are reported over the whole burst and over its arrival (from the burst's start until
the client has its last 429: when the gateway takes in the 2,000 requests).

The named baseline, in the same run on the same gateway: /health asked the same way while the
gateway is idle, and a 429 from a full but quiet gateway (--quiet-probes requests sent one at a
time while max_queue sequences are held).

Targets (issue 22): 429 p99 <= 100 ms timed in the gateway; /health within 100 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvledger.report import format_table, now_stamp, write_json  # noqa: E402
from services.transport.redis_server import RedisServer, free_port  # noqa: E402

PROBE_EVERY_S = 0.05


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))]


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


class Services:
    """redis-server, ledger, worker and gateway as separate processes, logs in a folder."""

    def __init__(self, max_queue: int, logs: Path) -> None:
        self.redis = RedisServer().__enter__()
        self.port = free_port()
        self.logs = logs
        common = ["--redis-url", self.redis.url, "--max-model-len", "256"]
        self.procs = {
            "worker": self._start("worker", ["worker", *common, "--device", "cpu"]),
            "ledger": self._start("ledger", ["ledger", *common, "--metrics-port", "0"]),
            "gateway": self._start(
                "gateway",
                ["gateway", *common, "--port", str(self.port), "--max-queue", str(max_queue)],
            ),
        }
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while not self._healthy():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"the {name} exited:\n{self.tail(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not become healthy:\n" + self.tail("gateway"))
            time.sleep(0.5)

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
        env.update(KVLEDGER_LOG_FORMAT="json", PYTHONUNBUFFERED="1")
        out = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 - the child owns it
        return subprocess.Popen(
            [sys.executable, "-m", "kvledger.cli", *args], cwd=ROOT, env=env,
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def tail(self, name: str) -> str:
        return "\n".join((self.logs / f"{name}.log").read_text().splitlines()[-20:])

    def gateway_rejections(self, since_line: int) -> tuple[list[float], int]:
        """elapsed_s of every 429 the gateway logged after line `since_line`; the line count."""
        lines = (self.logs / "gateway.log").read_text().splitlines()
        found = []
        for line in lines[since_line:]:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == "request_rejected" and record.get("status") == 429:
                found.append(float(record["elapsed_s"]))
        return found, len(lines)

    def cpu_s(self, name: str) -> float:
        """CPU seconds (user + system) the process has used so far."""
        fields = Path(f"/proc/{self.procs[name].pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.redis.__exit__(None, None, None)


def probe_process(url: str, out: Path) -> subprocess.Popen:
    """The /health probe in a process of its own: the burst's client, 1,000 connections in one
    Python loop, would otherwise delay the probe's own replies."""
    return subprocess.Popen([sys.executable, __file__, "--probe", url, "--probe-out", str(out)])


def stop_probe(proc: subprocess.Popen, out: Path) -> list[tuple[float, float]]:
    """(wall-clock time the probe was sent, its latency) of every probe."""
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    return [(sent, latency) for sent, latency in json.loads(out.read_text())]


def run_probe(url: str, out: Path) -> None:
    stop = asyncio.Event()

    async def main() -> list[tuple[float, float]]:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, stop.set)
        return await probe_health(url, stop)

    out.write_text(json.dumps(asyncio.run(main())))


async def probe_health(url: str, stop: asyncio.Event) -> list[tuple[float, float]]:
    import aiohttp

    latencies = []
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            sent, started = time.time(), time.perf_counter()
            try:
                async with session.get(f"{url}/health") as resp:
                    await resp.read()
            except aiohttp.ClientError:
                pass
            latencies.append((sent, time.perf_counter() - started))
            await asyncio.sleep(PROBE_EVERY_S)
    return latencies


async def burst(url: str, requests: int, concurrency: int, max_tokens: int):
    import aiohttp

    statuses: Counter[int | str] = Counter()
    latency: dict[int, list[float]] = {}
    last_429 = 0.0  # wall clock
    semaphore = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(i: int) -> None:
            body = {"prompt": f"burst {i}: the KV cache", "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            async with semaphore:
                started = time.perf_counter()
                try:
                    async with session.post(f"{url}/v1/completions", json=body) as resp:
                        await resp.read()
                        status: int | str = resp.status
                except (aiohttp.ClientError, OSError) as exc:
                    status = type(exc).__name__
                statuses[status] += 1
                if isinstance(status, int):
                    latency.setdefault(status, []).append(time.perf_counter() - started)
                if status == 429:
                    nonlocal last_429
                    last_429 = time.time()

        began, started = time.time(), time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        return statuses, latency, time.perf_counter() - started, (began, last_429 or time.time())


async def quiet_full(url: str, max_queue: int, probes: int) -> list[float]:
    """Fill the gateway with one request of max_queue sequences (n), then send `probes`
    requests one at a time: each is a 429 from a full gateway with nothing else going on."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        body = {"prompt": "hold", "n": max_queue, "max_tokens": 200, "ignore_eos": True}
        holder = asyncio.create_task(session.post(f"{url}/v1/completions", json=body))
        client = []
        for _ in range(200):  # until the gateway is full
            async with session.get(f"{url}/health") as resp:
                if (await resp.json())["in_flight"] >= max_queue:
                    break
            await asyncio.sleep(0.05)
        for i in range(probes):
            started = time.perf_counter()
            async with session.post(
                f"{url}/v1/completions", json={"prompt": f"probe {i}", "max_tokens": 1}
            ) as resp:
                await resp.read()
                assert resp.status == 429, resp.status
            client.append(time.perf_counter() - started)
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)
    return client


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--max-queue", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--quiet-probes", type=int, default=50)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # internal: the /health probe
    parser.add_argument("--probe-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        run_probe(args.probe, args.probe_out)
        return 0

    logs = Path(tempfile.mkdtemp(prefix="kvledger-burst-"))
    services = Services(args.max_queue, logs)
    try:
        probe = probe_process(services.url, logs / "idle.json")
        time.sleep(3.0)
        idle_health = [latency for _, latency in stop_probe(probe, logs / "idle.json")]
        _, mark = services.gateway_rejections(0)
        quiet_client = (
            asyncio.run(quiet_full(services.url, args.max_queue, args.quiet_probes))
            if args.quiet_probes
            else []
        )
        quiet_gateway, mark = services.gateway_rejections(mark)
        time.sleep(2)  # the holder's sequences are aborted and freed
        probe = probe_process(services.url, logs / "health.json")
        time.sleep(1.0)  # the probe is up
        cpu_before = services.cpu_s("gateway")
        statuses, latency, wall, arrival = asyncio.run(
            burst(services.url, args.requests, args.concurrency, args.max_tokens)
        )
        gateway_cpu_s = services.cpu_s("gateway") - cpu_before
        probes = stop_probe(probe, logs / "health.json")
        health = [latency for _, latency in probes]
        arriving = [latency for sent, latency in probes if arrival[0] <= sent <= arrival[1]]
        burst_gateway, _ = services.gateway_rejections(mark)
        load = os.getloadavg()[0]
    finally:
        services.stop()

    rows = [
        ["baseline: /health, gateway idle", "-", ms(pct(idle_health, 50)),
         ms(pct(idle_health, 99)), ms(max(idle_health) * 1000), len(idle_health)],
        ["baseline: 429 from a full, quiet gateway (gateway)", "-", ms(pct(quiet_gateway, 50)),
         ms(pct(quiet_gateway, 99)), ms(max(quiet_gateway, default=0) * 1000), len(quiet_gateway)],
        ["baseline: 429 from a full, quiet gateway (client)", "-", ms(pct(quiet_client, 50)),
         ms(pct(quiet_client, 99)), ms(max(quiet_client, default=0) * 1000), len(quiet_client)],
        ["burst: 429 (gateway)", "<= 100 p99", ms(pct(burst_gateway, 50)),
         ms(pct(burst_gateway, 99)), ms(max(burst_gateway, default=0) * 1000), len(burst_gateway)],
        ["burst: 429 (client)", "-", ms(pct(latency.get(429, []), 50)),
         ms(pct(latency.get(429, []), 99)), ms(max(latency.get(429, [0])) * 1000),
         len(latency.get(429, []))],
        ["burst: 200 (client)", "-", ms(pct(latency.get(200, []), 50)),
         ms(pct(latency.get(200, []), 99)), ms(max(latency.get(200, [0])) * 1000),
         len(latency.get(200, []))],
        ["burst: /health during it", "<= 100", ms(pct(health, 50)), ms(pct(health, 99)),
         ms(max(health) * 1000), len(health)],
        ["burst: /health while it arrives (to the last 429)", "<= 100", ms(pct(arriving, 50)),
         ms(pct(arriving, 99)), ms(max(arriving, default=0) * 1000), len(arriving)],
    ]  # fmt: skip
    title = (
        f"burst of {args.requests} at {args.concurrency} concurrent, max_queue {args.max_queue}: "
        f"{dict(statuses)} in {wall:.1f}s (the last 429 after {arrival[1] - arrival[0]:.1f}s), the gateway busy {gateway_cpu_s:.1f} CPU-s of it; "
        f"load average {load:.1f} ({now_stamp()})"
    )
    print(format_table(["measure", "target ms", "p50 ms", "p99 ms", "max ms", "n"], rows, title))
    if args.json:
        write_json(args.json, {"title": title, "rows": rows, "statuses": dict(statuses),
                               "gateway_cpu_s": gateway_cpu_s, "wall_s": wall,
                               "args": vars(args) | {"json": str(args.json)}})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
