"""What a service does once it is built, before it serves: move start-up's objects out of GC
(and `StartupError`, what a role raises when it cannot start).

Everything alive after start-up (modules, the model's Python objects, the block pool's
KVCacheBlocks, the tokenizer) lives as long as the process. Left in the oldest generation it
is walked by every full collection, and it sets how often those come; `gc.freeze()` moves it to
the permanent generation (as vLLM's engine does after start-up), so a full collection walks only
what serving made. The collector stays on for everything allocated afterwards.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any, TypeVar

from services.environment import env

T = TypeVar("T")


class StartupError(RuntimeError):
    """A role cannot start with what it was given or found (the message says what to change).
    `kvledger ROLE` prints the message alone on one line and exits with `exit_code`: 2 for a
    setting that cannot work, 3 for what the machine or the other services make impossible."""

    def __init__(self, message: str, exit_code: int = 3) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def freeze_after_startup() -> int:
    """Collect start-up's garbage, then freeze what is left; returns how many objects froze."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on uvloop's loop where it is installed (KVLEDGER_EVENT_LOOP=asyncio: the
    standard one): every Redis round trip and socket wake-up costs the services less on it."""
    if env("KVLEDGER_EVENT_LOOP", "uvloop") == "asyncio":
        return asyncio.run(main)
    try:
        import uvloop
    except ImportError:  # a platform without uvloop (Windows): the standard loop
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
