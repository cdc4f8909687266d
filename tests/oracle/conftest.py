"""Finding vLLM 0.33's venv (KVLEDGER_VLLM_ORACLE) and running a driver inside it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ORACLE_ENV = "KVLEDGER_VLLM_ORACLE"
HERE = Path(__file__).resolve().parent
BUILD_HINT = (
    "build one with `bash /work/shared/tools/vllm-oracle-venv.sh DIR` and set "
    f"{ORACLE_ENV}=DIR to run the differential tests against vLLM"
)


def oracle_python() -> tuple[Path | None, str]:
    """The venv's python, or None and why it cannot be used."""
    root = os.environ.get(ORACLE_ENV)
    if not root:
        return None, f"{ORACLE_ENV} is unset; {BUILD_HINT}"
    python = Path(root) / "bin" / "python"
    if not python.exists():
        return None, f"{ORACLE_ENV}={root} has no bin/python; {BUILD_HINT}"
    probe = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        return None, f"{python} cannot import vllm ({probe.stderr.strip()[-200:]}); {BUILD_HINT}"
    version = probe.stdout.strip().splitlines()[-1]
    if not version.startswith("0.33."):
        return None, f"{python} has vLLM {version}; the ledger re-implements 0.33"
    return python, ""


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    python, reason = oracle_python()
    if python is None:
        pytest.skip(reason)
    return python


def run_driver(python: Path, driver: str, payload: dict[str, Any], workdir: Path) -> dict:
    """One subprocess for a whole batch of traces; vLLM's import costs seconds, not the ops."""
    source, target = workdir / f"{driver}.in.json", workdir / f"{driver}.out.json"
    source.write_text(json.dumps(payload))
    # vLLM reads PYTHONHASHSEED for NONE_HASH; the driver sets it per trace, never inherits it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    done = subprocess.run(
        [str(python), str(HERE / f"{driver}.py"), str(source), str(target)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if done.returncode != 0:
        raise AssertionError(f"{driver} failed in vLLM's venv:\n{done.stderr[-4000:]}")
    return json.loads(target.read_text())
