"""The emulated kernel library every CPU kernel test shares, and the `emulation_full` marker:
the whole shape matrix and the planted-bug builds run only when `-m` names them
(`./scripts/test tests/kernels -m emulation_full`); the default run takes a short matrix.
"""

from __future__ import annotations

import platform

import pytest

from kernels import build
from kernels.library import KernelLibrary

FAKE_SMS = 4  # a small "GPU", so the planner splits even the tests' short contexts


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.option.markexpr:  # -m given: pytest selects by it
        return
    full = [item for item in items if item.get_closest_marker("emulation_full")]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if not item.get_closest_marker("emulation_full")]


def emulated_library() -> KernelLibrary:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the emulator's fiber switch is x86-64 assembly")
    try:
        return KernelLibrary(build.build(emulated=True))
    except build.BuildError as exc:
        if build.find_nvcc() is None:
            pytest.skip("no nvcc, so no CUDA headers (cuda_fp16.h) to build the emulation with")
        raise AssertionError(str(exc)) from exc


@pytest.fixture(scope="session")
def library() -> KernelLibrary:
    return emulated_library()
