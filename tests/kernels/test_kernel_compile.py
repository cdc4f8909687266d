"""CI gate: every `kernels/csrc/*.cu` compiles with this machine's nvcc for sm_80 and sm_90.

Nothing runs (no GPU needed); a kernel that does not compile cannot land.
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kernels import build

NVCC = build.find_nvcc()


@pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine: nothing can compile the .cu")
def test_every_cuda_source_compiles_for_sm80_and_sm90(tmp_path: Path):
    assert NVCC is not None
    assert {"-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"} <= set(
        build.gencode_flags()
    )
    sources = build.sources()
    assert sources, "no .cu files under kernels/csrc"

    def compile_one(source: Path) -> subprocess.CompletedProcess:
        command = build.nvcc_command(NVCC, [source], tmp_path / f"{source.stem}.o", shared=False)
        return subprocess.run(command, capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        results = list(pool.map(compile_one, sources))
    failures = [
        f"--- {source.name} ---\n{' '.join(r.args)}\n{r.stdout}{r.stderr}"
        for source, r in zip(sources, results, strict=True)
        if r.returncode != 0
    ]
    assert not failures, "nvcc rejected:\n" + "\n".join(failures)
    assert all((tmp_path / f"{s.stem}.o").stat().st_size > 0 for s in sources)
