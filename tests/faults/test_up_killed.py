"""Issue 22: kill -9 of `kvledger up` leaves nothing behind. Its children (the private
redis-server, the ledger, the worker, the gateway) die with it within 5 s, found gone in /proc;
a new `kvledger up` on the same port then starts, serves, and removes the temporary directory
the killed one's redis-server left."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from services.transport.redis_server import free_port
from tests.e2e.conftest import launch
from tests.faults.conftest import complete

GONE_WITHIN_S = 5.0


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a live process, None once it is gone (a zombie counts as gone:
    it runs nothing and holds no port, and PID 1 in a container may never reap it)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, ppid = raw.rsplit(")", 1)[1].split()[:2]
    return None if state == "Z" else (state, int(ppid))


def _descendants(root: int) -> dict[int, str]:
    """Every live process below `root`, with its command line."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _proc_stat(int(entry))) is not None:
            parents[int(entry)] = stat[1]
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                with contextlib.suppress(OSError):
                    found[pid] = (
                        Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    )
                frontier.append(pid)
    return found


def _redis_dir(processes: dict[int, str]) -> Path:
    """The private redis-server's --dir: it works in it (it rewrites its command line)."""
    (pid,) = [pid for pid, c in processes.items() if "redis-server" in c.split(" ")[0]]
    return Path(os.readlink(f"/proc/{pid}/cwd"))


def test_kill9_of_up_leaves_no_process_and_a_new_up_starts_on_its_port():
    port = free_port()
    first = launch("tiny", num_gpu_blocks=64, max_model_len=128, port=port)
    second = None
    try:
        first.wait_until_serving()
        processes = _descendants(first.process.pid)
        roles = " ".join(processes.values())
        for role in ("redis-server", "kvledger.cli ledger", "kvledger.cli worker",
                     "kvledger.cli gateway"):  # fmt: skip
            assert role in roles, processes
        redis_dir = _redis_dir(processes)
        assert redis_dir.is_dir()

        os.kill(first.process.pid, signal.SIGKILL)
        first.process.wait()
        killed_at = time.monotonic()
        while left := {pid: c for pid, c in processes.items() if _proc_stat(pid) is not None}:
            assert time.monotonic() - killed_at < GONE_WITHIN_S, (
                f"still running {GONE_WITHIN_S:g}s after kill -9 of kvledger up: {left}"
            )
            time.sleep(0.1)
        print(f"every child gone {time.monotonic() - killed_at:.2f}s after kill -9")

        second = launch("tiny", num_gpu_blocks=64, max_model_len=128, port=port)
        second.wait_until_serving()
        out = complete(second.url, 0, stream=False, timeout=30)
        assert out.text is not None, out.error
        assert not redis_dir.exists(), f"the killed up's {redis_dir} is still there"
    finally:
        for served in (first, second):
            if served is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(served.process.pid, signal.SIGKILL)  # whatever a failure left
            served.process.wait(timeout=10)
            if served.pump is not None:
                served.pump.join(timeout=5)
        # A failing run must not leave a stale directory behind for later runs either.
        with contextlib.suppress(NameError):
            if redis_dir.exists():
                import shutil

                shutil.rmtree(redis_dir, ignore_errors=True)
