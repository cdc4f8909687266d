"""services/lifeline.py and the stale-directory clean-up of services/transport/redis_server.py:
a child started through a Lifeline ends when its launcher is killed with SIGKILL, through the
pipe alone (even one that ignores SIGTERM, the parent-death signal included), within GRACE_S;
a later launcher removes the private Redis directory of a dead one and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from services.lifeline import GRACE_S
from services.transport.redis_server import OWNED_PREFIX, OWNERS_FILE, remove_stale

ROOT = Path(__file__).resolve().parents[2]

# A launcher that starts one stubborn child and prints its pid; the child ignores SIGTERM, so
# only the pipe's hard exit can end it.
LAUNCHER = textwrap.dedent(
    """
    import subprocess, sys, time
    from services.lifeline import Lifeline
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], **Lifeline().popen_kwargs({"PYTHONPATH": sys.argv[1]})
    )
    print(child.pid, flush=True)
    time.sleep(600)
    """
)
CHILD = textwrap.dedent(
    """
    import signal, time
    from services.lifeline import watch_parent
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent()
    time.sleep(600)
    """
)


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_a_child_ignoring_sigterm_still_ends_when_its_launcher_is_killed():
    launcher = subprocess.Popen(
        [sys.executable, "-c", f"CHILD = {CHILD!r}\n{LAUNCHER}", str(ROOT)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert launcher.stdout is not None
    child = int(launcher.stdout.readline())
    try:
        time.sleep(1.0)  # the child is up and watching
        assert not _gone(child)
        launcher.kill()
        launcher.wait()
        killed_at = time.monotonic()
        while not _gone(child):
            assert time.monotonic() - killed_at < GRACE_S + 2, "the child outlived its launcher"
            time.sleep(0.05)
        assert time.monotonic() - killed_at >= GRACE_S - 0.5  # SIGTERM ignored: the hard exit
    finally:
        if not _gone(child):
            os.kill(child, 9)


def test_a_stale_private_redis_directory_goes_and_no_other():
    with tempfile.TemporaryDirectory() as tmp:
        dead = subprocess.Popen(["true"])
        dead.wait()  # a pid that no longer runs
        stale = Path(tmp, OWNED_PREFIX + "stale")
        live = Path(tmp, OWNED_PREFIX + "live")
        unknown = Path(tmp, OWNED_PREFIX + "no-owners-file")
        other = Path(tmp, "kvledger-redis-a-test")
        for folder, owners in ((stale, f"{dead.pid} {dead.pid}"),
                               (live, f"{os.getpid()} {dead.pid}"),
                               (unknown, None), (other, f"{dead.pid} {dead.pid}")):  # fmt: skip
            folder.mkdir()
            if owners is not None:
                (folder / OWNERS_FILE).write_text(owners)
        assert remove_stale(tmp) == [str(stale)]
        assert not stale.exists() and live.exists() and unknown.exists() and other.exists()
