"""Stop strings matched on text that arrives in pieces: the output is cut before the first stop
string to complete, and a tail that could still grow into one is held back until the next
piece decides.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed text with `push`; what it returns is safe to show. After a match it returns nothing.

    Invariant: no stop string starts inside text already returned, because any tail that is a
    prefix of a stop string stays pending until it either completes one or stops matching.
    """

    def __init__(self, stops: Sequence[str], include_stop_str: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_stop_str = include_stop_str  # vLLM's include_stop_str_in_output
        self.matched: str | None = None
        self._pending = ""

    def push(self, text: str, final: bool = False, check: bool = True) -> str:
        """Text safe to emit. `final` releases the held tail; `check=False` (before min_tokens,
        as vLLM) passes text through unexamined."""
        if self.matched is not None:
            return ""
        if not self.stops or (not check and not self._pending):
            return text
        self._pending += text
        hit = self._first_hit()
        if hit is not None:
            index, self.matched = hit
            end = index + len(self.matched) if self.include_stop_str else index
            out, self._pending = self._pending[:end], ""
            return out
        keep = 0 if final else self._partial_tail()
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def _first_hit(self) -> tuple[int, str] | None:
        """The stop string that completes first (then the longest), as a token-by-token check
        finds it; this makes the cut independent of how the text was split into pieces."""
        hits = [(i, s) for s in self.stops if (i := self._pending.find(s)) >= 0]
        return min(hits, key=lambda hit: (hit[0] + len(hit[1]), hit[0])) if hits else None

    def _partial_tail(self) -> int:
        """Length of the longest tail of the pending text that starts some stop string."""
        longest = max(len(s) for s in self.stops) - 1
        for size in range(min(longest, len(self._pending)), 0, -1):
            tail = self._pending[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0
