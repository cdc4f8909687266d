"""Tests marked `slow` (over ~10 s each, each with a shorter sibling in every run) run only when
asked for: `scripts/test -m slow`, or `-m "slow or not slow"` for everything the default run
holds and them."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "slow" in (config.getoption("markexpr") or ""):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
