"""Tests marked `slow` (over ~10 s each, each with a shorter sibling in every run) run only when
asked for: `scripts/test -m slow`, or `-m "slow or not slow"` for everything the default run
holds and them. Tests marked `compose` likewise: `-m compose`."""

from __future__ import annotations

import pytest

# Each runs only when -m names it: `slow` (the slow siblings) and `compose` (the compose stack
# under podman, minutes and a container engine: tests/compose).
OPT_IN_MARKERS = ("slow", "compose")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    markexpr = config.getoption("markexpr") or ""
    for marker in OPT_IN_MARKERS:
        if marker in markexpr:
            continue
        opted = [item for item in items if item.get_closest_marker(marker)]
        if opted:
            config.hook.pytest_deselected(items=opted)
            items[:] = [item for item in items if not item.get_closest_marker(marker)]
