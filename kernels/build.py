"""Builds `kernels/csrc/*.cu` into one shared library, once per hash of sources and flags.

`build()` compiles with nvcc for sm_80 and sm_90; `build(emulated=True)` compiles the same
sources with the host C++ compiler (see csrc/host_emulation.cuh) so tests can run them on a CPU.
Each build happens in a private temporary folder renamed into place, so an interrupted or
concurrent build never leaves a lock or a half-written library behind.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
ARCHS = ("80", "90")
LIBRARY_NAME = "libkvledger_kernels.so"
CACHE_ENV = "KVLEDGER_KERNEL_CACHE"
NVCC_ENV = "KVLEDGER_NVCC"
PREBUILT_ENV = "KVLEDGER_KERNEL_LIB"


class BuildError(RuntimeError):
    """A compiler is missing or rejected the sources; the message carries its output."""


def sources(csrc: Path = CSRC) -> list[Path]:
    return sorted(csrc.glob("*.cu"))


def headers(csrc: Path = CSRC) -> list[Path]:
    return sorted(csrc.glob("*.cuh"))


def cache_root() -> Path:
    default = Path.home() / ".cache" / "kvledger" / "kernels"
    return Path(os.environ.get(CACHE_ENV, default))


def find_nvcc() -> str | None:
    """nvcc from $KVLEDGER_NVCC, $PATH, $CUDA_HOME or /usr/local/cuda, or None."""
    candidates = [os.environ.get(NVCC_ENV), shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(str(Path(home) / "bin" / "nvcc"))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def cuda_include_dir(nvcc: str) -> Path:
    """The CUDA headers nvcc uses (cuda_fp16.h etc.), for the host-compiled emulated build."""
    for home in (os.environ.get("CUDA_HOME"), str(Path(nvcc).resolve().parent.parent)):
        if home and (Path(home) / "include" / "cuda_fp16.h").exists():
            return Path(home) / "include"
    # nvcc may be a wrapper script: ask it where its headers are.
    dry = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull], capture_output=True)
    text = dry.stdout.decode() + dry.stderr.decode()
    for match in re.finditer(r'INCLUDES="([^"]*)"', text):
        for flag in match.group(1).split():
            path = Path(flag.removeprefix("-I").strip('"'))
            if (path / "cuda_fp16.h").exists():
                return path
    raise BuildError(f"cannot find cuda_fp16.h for {nvcc}; set CUDA_HOME")


def gencode_flags(archs: tuple[str, ...] = ARCHS) -> list[str]:
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    # PTX of the newest arch too, so a later GPU can JIT the kernels instead of failing.
    return [*flags, f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}"]


def nvcc_command(nvcc: str, inputs: list[Path], output: Path, *, shared: bool) -> list[str]:
    """nvcc invocation for a shared library (shared=True) or one object file (compile only)."""
    mode = ["-shared", "-Xcompiler", "-fPIC"] if shared else ["-c"]
    threads = ["--threads", "0"]  # one compiler process per target architecture
    return [nvcc, "-std=c++17", "-O3", *threads, *gencode_flags(), *mode, "-o", str(output)] + [
        str(p) for p in inputs
    ]


def host_command(compiler: str, include: Path, inputs: list[Path], output: Path) -> list[str]:
    return [
        # -fno-gnu-unique: a process may load several emulated builds (the planted-bug tests);
        # their inline functions' statics must stay their own, not be merged by the loader.
        compiler, "-std=c++17", "-O2", "-g", "-fPIC", "-fno-strict-aliasing", "-fno-gnu-unique",
        "-shared", "-DKVL_HOST_EMULATION",
        f"-I{include}", "-x", "c++", *[str(p) for p in inputs], "-o", str(output),
    ]  # fmt: skip


def _tool_version(tool: str) -> str:
    return subprocess.run([tool, "--version"], capture_output=True, text=True).stdout


def _digest(command: list[str], tool_version: str, csrc: Path) -> str:
    h = hashlib.sha256()
    for path in sources(csrc) + headers(csrc):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(" ".join(command).encode())
    h.update(tool_version.encode())
    return h.hexdigest()[:16]


def build(emulated: bool = False, csrc: Path = CSRC) -> Path:
    """Path of the built library, compiling it only when no cached copy matches the sources
    (`csrc`: another copy of the sources, e.g. one with a planted bug)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found: set KVLEDGER_NVCC, CUDA_HOME, or put nvcc on PATH")
    placeholder = Path("OUT")
    if emulated:
        compiler = os.environ.get("CXX", "g++")
        if shutil.which(compiler) is None:
            raise BuildError(f"host compiler {compiler!r} not found for the emulated build")
        command = host_command(compiler, cuda_include_dir(nvcc), sources(csrc), placeholder)
        tool = compiler
    else:
        command = nvcc_command(nvcc, sources(csrc), placeholder, shared=True)
        tool = nvcc
    kind = "emulated" if emulated else "cuda"
    final = cache_root() / f"{kind}-{_digest(command, _tool_version(tool), csrc)}"
    if (final / LIBRARY_NAME).exists():
        return final / LIBRARY_NAME

    cache_root().mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=cache_root()))
    try:
        output = work / LIBRARY_NAME
        command[command.index(str(placeholder))] = str(output)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise BuildError(f"{' '.join(command)}\n{done.stdout}{done.stderr}")
        try:
            work.rename(final)
        except OSError:  # another process finished the same build first: use theirs
            if not (final / LIBRARY_NAME).exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final / LIBRARY_NAME


if __name__ == "__main__":  # `python kernels/build.py DIR`: build ahead of time (Docker image)
    import sys

    if len(sys.argv) > 1:
        os.environ[CACHE_ENV] = sys.argv[1]
    built = build()
    target = cache_root() / LIBRARY_NAME
    shutil.copy2(built, target)
    print(target)
