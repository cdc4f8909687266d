"""Children that die with the process that started them: `kvledger up`'s private redis-server,
ledger, worker and gateway. A kill -9 of the launcher runs none of its clean-up, so each child
watches for its parent's death itself, two ways:

- on Linux, PR_SET_PDEATHSIG (prctl, set in the child between fork and exec, kept across exec):
  the kernel signals the child when its parent dies; the redis-server gets SIGKILL (it has
  nothing to save), a service SIGTERM (it stops as on Ctrl-C);
- everywhere, a pipe: the launcher holds its write end and never writes; each service child
  holds the read end (its number in KVLEDGER_PARENT_FD) and a thread blocks reading it. The read
  returns end-of-file once no write end is open, which the kernel ensures when the launcher dies
  however it dies; the child then stops as on SIGTERM, and exits hard GRACE_S later if it has not.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from services.environment import env

PARENT_FD_ENV = "KVLEDGER_PARENT_FD"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
GRACE_S = 3.0  # a child whose parent died stops within this, or is ended


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel for `sig` when this process's parent dies (Linux only); True if set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int) -> Callable[[], None]:
    """A `preexec_fn` for Popen: the child gets `sig` when this process dies (Linux), and at
    once if it died already (between the fork and the prctl)."""
    parent = os.getpid()

    def preexec() -> None:
        set_parent_death_signal(sig)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


class Lifeline:
    """The launcher's side: one pipe for all its children, open as long as the launcher lives."""

    def __init__(self) -> None:
        # Not inheritable (Python's default): only the children given it in pass_fds get the
        # read end; no child ever holds the write end, or its parent's death would go unseen.
        self._read, self._write = os.pipe()

    def popen_kwargs(self, child_env: dict[str, str]) -> dict[str, object]:
        """Popen's arguments for a service child that must die with this process."""
        return {
            "env": {**child_env, PARENT_FD_ENV: str(self._read)},
            "pass_fds": (self._read,),
            "preexec_fn": die_with_parent(signal.SIGTERM),
        }

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)


def watch_parent(say: Callable[[str], object] | None = None) -> threading.Thread | None:
    """The child's side, called once at start-up: when the launcher's pipe ends, stop this
    process as SIGTERM does and end it GRACE_S later if it is still running. Nothing to watch
    (None) when this process was not started by a launcher."""
    raw = env(PARENT_FD_ENV)
    os.environ.pop(PARENT_FD_ENV, None)  # not for this process's own children
    if raw is None:
        return None
    try:
        fd = int(raw)
        os.fstat(fd)
    except (ValueError, OSError):
        return None
    set_parent_death_signal(signal.SIGTERM)  # also when started by other means than Popen

    def wait() -> None:
        with contextlib.suppress(OSError):
            while os.read(fd, 1):  # nobody writes: b"" is the end of the launcher
                pass
        if say is not None:
            say(f"the launcher (parent {os.getppid()}) is gone: stopping")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(GRACE_S)
        os._exit(1)

    thread = threading.Thread(target=wait, name="parent-watch", daemon=True)
    thread.start()
    return thread
