"""A leader paused past its lease and resumed, with a standby, under a steady stream of requests:
is any request left unanswered? (issue 22's probe)

    python benchmarks/leader_pause.py [--cycles 8] [--rate 150] [--pause-s 8]

Real processes on a private redis-server: a worker (the tiny seeded Llama on the CPU) and two
ledgers (lease TTL 2 s). Each cycle sends requests (max_tokens 4) at --rate per second, sends
SIGSTOP to the leader, waits --pause-s (the standby takes over), sends SIGCONT (the resumed
ledger finds its lease gone and exits), stops sending a second later, and waits up to
--answer-s for every request's final output; a new standby is started for the next cycle.
Before issue 22's fix the resumed ledger could take one request off the stream before it
exited, and that request waited for the next leader change. Every answer is also compared with
the model's own greedy tokens for its prompt (`inexact`): a takeover must not change an answer.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpu_worker.checkpoint import load_model  # noqa: E402
from kvledger.report import format_table, now_stamp  # noqa: E402
from services.transport.redis_server import RedisServer  # noqa: E402
from tests.engine.test_leadership import PROMPTS, Replica  # noqa: E402
from tests.harness.stack import dense_greedy  # noqa: E402

MAX_TOKENS = 4


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cycles", type=int, default=8)
    parser.add_argument("--rate", type=float, default=150.0, help="requests per second")
    parser.add_argument("--pause-s", type=float, default=8.0)
    parser.add_argument("--answer-s", type=float, default=120.0)
    args = parser.parse_args()

    # The worker serves the tiny model with seed 0 (the environment's KVLEDGER_SEED is not passed).
    model = load_model("tiny", seed=0)
    expected = {name: dense_greedy(model, prompt, MAX_TOKENS) for name, prompt in PROMPTS.items()}
    rows = []
    with RedisServer() as server:
        replica = Replica(server.url, Path(tempfile.mkdtemp(prefix="kvledger-pause-")))
        try:
            replica.worker()
            leader = replica.ledger("ledger-0")
            leader.wait_for("leader_elected", 120)
            standby = replica.ledger("ledger-1")
            standby.wait_for("standing_by", 60)
            for cycle in range(args.cycles):
                sent: list[str] = []
                stop = threading.Event()

                def feed(
                    cycle: int = cycle, sent: list[str] = sent, stop: threading.Event = stop
                ) -> None:
                    i = 0
                    while not stop.is_set():
                        req_id = f"c{cycle}-{i}"
                        replica.submit(req_id, PROMPTS[f"r{i % 6}"], MAX_TOKENS)
                        sent.append(req_id)
                        i += 1
                        time.sleep(1 / args.rate)

                feeder = threading.Thread(target=feed, daemon=True)
                feeder.start()
                time.sleep(1.0)
                leader.p.send_signal(signal.SIGSTOP)
                time.sleep(args.pause_s)
                leader.p.send_signal(signal.SIGCONT)
                time.sleep(1.0)
                stop.set()
                feeder.join()
                leader.p.wait(timeout=30)
                started = time.monotonic()
                deadline = started + args.answer_s
                while not set(sent) <= set(replica.finished) and time.monotonic() < deadline:
                    replica.read_outputs()
                unanswered = len(set(sent) - set(replica.finished))
                errors = sum(1 for r in sent if replica.finished.get(r))
                inexact = sum(
                    1
                    for i, r in enumerate(sent)
                    if r in replica.finished
                    and not replica.finished[r]
                    and replica.tokens[r] != expected[f"r{i % 6}"]
                )
                claims = len(standby.events("requests_claimed"))
                rows.append([cycle, len(sent), unanswered, errors, inexact, claims])
                print(f"cycle {cycle}: {rows[-1]}", flush=True)
                leader, standby = standby, replica.ledger(f"ledger-{cycle + 2}")
                standby.wait_for("standing_by", 60)
        finally:
            replica.close()
    title = (
        f"leader paused {args.pause_s:g}s and resumed with a standby, {args.cycles} cycles at "
        f"~{args.rate:g} requests/s ({now_stamp()})"
    )
    headers = ["cycle", "requests", "unanswered", "errors", "inexact", "claims by the new leader"]
    print(format_table(headers, rows, title))
    print(
        f"unanswered in all: {sum(r[2] for r in rows)}; errors: {sum(r[3] for r in rows)}; "
        f"answers that differ from the model's greedy tokens: {sum(r[4] for r in rows)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
