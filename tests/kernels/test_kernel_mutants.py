"""Planted bugs (tests/kernels/mutants.py) are caught by the emulated kernels: each one builds
its own emulated library (about half a minute each) and runs in a process of its own, so they
run with `-m emulation_full`; that every planted line still exists, and that the unmutated
kernels pass the same detector, is checked in the default run."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernels import build
from tests.kernels.mutants import MUTANTS, Mutant, caught, caught_in_subprocess, plant


def test_every_planted_bug_still_matches_the_sources(tmp_path: Path):
    for mutant in MUTANTS:
        plant(mutant, tmp_path / mutant.name)


def test_the_unmutated_kernels_pass_the_detector(library):
    assert caught(library) is None


@pytest.mark.emulation_full
@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_planted_bug_is_caught(library, mutant: Mutant, tmp_path: Path):
    del library  # the unmutated build must exist first (skips where emulation cannot run)
    reason = caught_in_subprocess(build.build(emulated=True, csrc=plant(mutant, tmp_path)))
    assert reason is not None, f"{mutant.name} went unnoticed"
    print(f"{mutant.name}: {reason}")
