"""Runs inside vLLM 0.33's venv: imports vLLM once, then forks a child for each driver run, so
a test session pays vLLM's import (2-5 s) once per profile instead of once per run.

Usage: python zygote.py PROFILE. PROFILE names what is imported before forking (`PROFILES`).
Importing most of vLLM decides its platform (`vllm.platforms.current_platform`, from
VLLM_TARGET_DEVICE or what the machine has): a profile does so only when its drivers take the
platform from the environment as the zygote does (`DECIDES_PLATFORM`); the others import
nothing that decides it, so a driver that sets VLLM_TARGET_DEVICE before its own imports gets
the platform it would get in a process of its own.

Reads one JSON job a line on stdin: {"driver": path, "argv": [...], "log": path (the child's
stdout and stderr), "timeout": seconds}; answers {"rc": exit code} a line on stdout once the
child has ended (a negative code: killed by that signal; SIGALRM when it ran past its timeout).
Ends at the end of its stdin (the test session gone).
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import sys
import traceback

# What each profile imports before forking: the modules every driver of the profile imports.
PROFILES: dict[str, tuple[str, ...]] = {
    "bare": ("vllm", "msgspec"),  # drivers that choose the platform (the CPU's) themselves
    "serving": (
        "vllm",
        "vllm.entrypoints.openai.chat_completion.serving",
        "vllm.entrypoints.openai.completion.serving",
        "vllm.entrypoints.openai.responses.serving",
    ),  # drivers that set no VLLM_TARGET_DEVICE: the environment's platform, as here
}
DECIDES_PLATFORM = {"serving"}


def run(job: dict) -> int:
    """In the child: the driver as `python DRIVER ARGV...` would run it."""
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    signal.alarm(max(1, int(job["timeout"])))  # SIGALRM's default action ends the child
    driver = job["driver"]
    sys.argv = [driver, *job["argv"]]
    sys.path.insert(0, os.path.dirname(driver))  # its sibling modules, as for a script
    try:
        runpy.run_path(driver, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main(profile: str) -> None:
    for module in PROFILES[profile]:
        importlib.import_module(module)
    platforms = sys.modules.get("vllm.platforms")
    decided = platforms is not None and platforms._current_platform is not None
    if decided and profile not in DECIDES_PLATFORM:
        raise SystemExit(f"profile {profile} decided vLLM's platform: drivers could not choose it")
    answer = sys.stdout
    answer.write(json.dumps({"ready": profile}) + "\n")
    answer.flush()
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = run(job)
            finally:
                os._exit(code)  # never back into the loop, whatever happened
        _, status = os.waitpid(pid, 0)
        answer.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        answer.flush()


if __name__ == "__main__":
    main(sys.argv[1])
