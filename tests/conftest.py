"""Tests marked `slow` (over ~10 s each, each with a shorter sibling in every run) run only when
asked for: `scripts/test -m slow`, or `-m "slow or not slow"` for everything the default run
holds and them. Tests marked `compose` likewise: `-m compose`."""

from __future__ import annotations

import pytest

# Each runs only when -m names it: `slow` (the slow siblings), `compose` (the compose stack
# under podman, minutes and a container engine: tests/compose), `fuzz` (the long HTTP fuzz),
# `redis_sizing` (every stream filled to its cap) and `oracle_sweep` (the long vLLM sweep).
# (`faults` and `emulation_full` leave the run only when no -m is given: their conftests.)
OPT_IN_MARKERS = ("slow", "compose", "fuzz", "redis_sizing", "oracle_sweep")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    markexpr = config.getoption("markexpr") or ""
    for marker in OPT_IN_MARKERS:
        if marker in markexpr:
            continue
        opted = [item for item in items if item.get_closest_marker(marker)]
        if opted:
            config.hook.pytest_deselected(items=opted)
            items[:] = [item for item in items if not item.get_closest_marker(marker)]
