"""Finding vLLM 0.33's venv (KVLEDGER_VLLM_ORACLE) and running a driver inside it."""

from __future__ import annotations

import atexit
import functools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ORACLE_ENV = "KVLEDGER_VLLM_ORACLE"
# Set by .ci/run, which builds the venv first: there an unusable oracle fails instead of skipping.
REQUIRED_ENV = "KVLEDGER_ORACLE_REQUIRED"
HERE = Path(__file__).resolve().parent
BUILD_HINT = (
    "build one with `bash scripts/vllm-oracle-venv.sh DIR` and set "
    f"{ORACLE_ENV}=DIR to run the differential tests against vLLM"
)


@functools.cache
def oracle_python() -> tuple[Path | None, str]:
    """The venv's python, or None and why it cannot be used (probed once a session: importing
    vLLM takes seconds)."""
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


def require_vllm_python() -> Path:
    """The oracle venv's python; skips the test without one (fails where CI requires it)."""
    python, reason = oracle_python()
    if python is None:
        if os.environ.get(REQUIRED_ENV) == "1":
            pytest.fail(f"{REQUIRED_ENV}=1 but the oracle cannot run: {reason}")
        pytest.skip(reason)
    return python


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    return require_vllm_python()


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("oracle")


def first_difference(ours: list[dict], theirs: list[dict], what: list[Any]) -> str | None:
    """A readable account of the first op/step where the two sides part, or None."""
    for index, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            fields = {
                k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
            }
            lines = [f"#{index}: {json.dumps(what[index])[:300]}"]
            lines += [
                f"  {k}:\n    ours {str(x)[:400]}\n    vllm {str(y)[:400]}"
                for k, (x, y) in fields.items()
            ]
            return "\n".join(lines)
    if len(ours) != len(theirs):
        return f"ours ran {len(ours)} entries, vLLM {len(theirs)}"
    return None


# The drivers run forked from a zygote that holds vLLM's imports (tests/oracle/zygote.py: each
# of its profiles imports what its drivers import, short of deciding vLLM's platform); a run
# with a PYTHONHASHSEED or arguments of its own, and any other driver, in a process of its own.
ZYGOTE_PROFILES = {
    "vllm_serving_driver": "serving",
    "api_protocol_driver": "serving",
    "vllm_driver": "bare",
    "vllm_sched_driver": "bare",
    "vllm_offload_driver": "bare",
}


class Zygote:
    """One zygote process (a python of vLLM's venv, a profile), kept for the test session."""

    def __init__(self, python: Path, profile: str, env: dict[str, str], workdir: Path) -> None:
        self.errors = workdir / f"zygote-{profile}.err"
        with self.errors.open("w") as errors:
            self.process = subprocess.Popen(
                [str(python), str(HERE / "zygote.py"), profile],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True, env=env,
            )  # fmt: skip
        atexit.register(self.close)
        self._answer("start")

    def _answer(self, what: str) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(timeout=30)
            raise AssertionError(f"the oracle's zygote died ({what}):\n{self.errors.read_text()}")
        return json.loads(line)

    def run(self, driver: Path, argv: list[str], log: Path, timeout: float) -> int:
        assert self.process.stdin is not None
        job = {"driver": str(driver), "argv": argv, "log": str(log), "timeout": timeout}
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        return int(self._answer(driver.name)["rc"])

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()  # its end of input: it exits
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


_ZYGOTES: dict[tuple[Path, str], Zygote] = {}


def run_driver(
    python: Path,
    driver: str,
    payload: dict[str, Any],
    workdir: Path,
    timeout: float = 900,
    *,
    hash_seed: str | None = None,
    args: tuple[str, ...] = (),
    tag: str = "",
) -> dict:
    """One run of a driver for a whole batch of traces; vLLM's import costs seconds, not the ops.

    `hash_seed` sets PYTHONHASHSEED for a driver whose results depend on the iteration order of
    sets of str or bytes (as vLLM's offloading connector's do); `tag` names the files of a run.
    """
    name = f"{driver}{tag}"
    source, target = workdir / f"{name}.in.json", workdir / f"{name}.out.json"
    source.write_text(json.dumps(payload))
    # vLLM reads PYTHONHASHSEED for NONE_HASH; the driver sets it per trace, never inherits it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = hash_seed
    profile = ZYGOTE_PROFILES.get(driver)
    if profile is not None and hash_seed is None and not args:
        zygote = _ZYGOTES.get((python, profile))
        if zygote is None or zygote.process.poll() is not None:
            zygote = _ZYGOTES[python, profile] = Zygote(python, profile, env, workdir)
        log = workdir / f"{name}.log"
        code = zygote.run(HERE / f"{driver}.py", [str(source), str(target)], log, timeout)
        output = log.read_text() if code != 0 else ""
    else:
        done = subprocess.run(
            [str(python), str(HERE / f"{driver}.py"), str(source), str(target), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
        code, output = done.returncode, done.stderr
    if code != 0:
        raise AssertionError(f"{driver} failed ({code}) in {python}:\n{output[-4000:]}")
    return json.loads(target.read_text())
    done = subprocess.run(
        [str(python), str(HERE / f"{driver}.py"), str(source), str(target), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise AssertionError(f"{driver} failed in {python}:\n{done.stderr[-4000:]}")
    return json.loads(target.read_text())
