"""Rate-limited logging for errors that repeat in storms (refused connections, accept() failing
with "Too many open files", clients that time out): the first occurrence of each key is logged,
later ones within `interval_s` are only counted, and the next record after the interval carries
`repeated=N`, the number held back. A storm of 20,000 errors costs a handful of lines.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from observability.logging import get_logger

DEFAULT_INTERVAL_S = 10.0


class RateLimitedLog:
    """One per service (or per kind of error); `key` groups occurrences, usually the event."""

    def __init__(
        self,
        logger: Any,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._last_logged: dict[str, float] = {}
        self._held_back: dict[str, int] = {}

    def log(self, level: str, event: str, key: str | None = None, **fields: Any) -> bool:
        """Log `event` at `level` unless the same key was logged less than interval_s ago;
        True when a line was written."""
        key = key or event
        now = self._clock()
        last = self._last_logged.get(key)
        if last is not None and now - last < self._interval_s:
            self._held_back[key] = self._held_back.get(key, 0) + 1
            return False
        self._last_logged[key] = now
        repeated = self._held_back.pop(key, 0)
        if repeated:
            fields["repeated"] = repeated
            fields["interval_s"] = self._interval_s
        getattr(self._logger, level)(event, **fields)
        return True

    def held_back(self, key: str) -> int:
        """Occurrences of `key` counted but not yet logged."""
        return self._held_back.get(key, 0)


def install_loop_exception_handler(
    loop: asyncio.AbstractEventLoop, interval_s: float = DEFAULT_INTERVAL_S
) -> RateLimitedLog:
    """Route the event loop's unhandled errors (accept() out of file descriptors, transports
    that fail) through a rate limit keyed by their message: asyncio's default handler writes
    one traceback per occurrence, which is what filled a disk in a minute under a
    slow-client flood."""
    limited = RateLimitedLog(get_logger("asyncio"), interval_s)

    def handle(_: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message") or "unhandled error in the event loop")
        exc = context.get("exception")
        key = f"{message}|{type(exc).__name__ if exc is not None else ''}"
        fields: dict[str, Any] = {"message": message}
        if exc is not None:
            fields["error"] = f"{type(exc).__name__}: {exc}"
        limited.log("error", "event_loop_error", key=key, **fields)

    loop.set_exception_handler(handle)
    return limited
