"""Planted bugs: each one a mistake a kernel author could make, applied to a copy of
kernels/csrc; the emulated tests must catch every one (test_kernel_mutants.py)."""

from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import build, cuda, reference
from kernels.library import KernelLibrary
from tests.kernels.paged_cases import PagedBatch, make_batch


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    planted: str
    count: int = 1  # occurrences of `original`, all replaced


MUTANTS = [
    Mutant(  # V must be transposed into the B fragment; without .trans PV multiplies V^T
        "pv-without-ldmatrix-trans", "attention_tc.cuh",
        "ldmatrix_x4_trans(b, vs + swizzled<D>(key, n + (lane >> 4)));",
        "ldmatrix_x4(b, vs + swizzled<D>(key, n + (lane >> 4)));",
    ),
    Mutant(  # cp.async writes unswizzled rows that ldmatrix reads swizzled
        "copies-skip-the-swizzle", "attention_tc.cuh",
        "const int at = swizzled<D>(warp * kWarpKeys + key, c % L::kChunks);",
        "const int at = (warp * kWarpKeys + key) * D + (c % L::kChunks) * 8;",
    ),
    Mutant(  # P's A fragment: rows g+8 and columns 8.. swapped
        "p-fragment-registers-swapped", "attention_tc.cuh",
        "pack2(s[2 * kb][2], s[2 * kb][3], T()),\n"
        "                              pack2(s[2 * kb + 1][0], s[2 * kb + 1][1], T()),",
        "pack2(s[2 * kb + 1][0], s[2 * kb + 1][1], T()),\n"
        "                              pack2(s[2 * kb][2], s[2 * kb][3], T()),",
    ),
    Mutant(  # K's B fragment halves (dims 0-7 and 8-15 of a k-step) swapped
        "k-fragment-halves-swapped", "attention_tc.cuh",
        "mma_16816(s[n], qa[kk], b[0], b[1], T());",
        "mma_16816(s[n], qa[kk], b[1], b[0], T());",
    ),
    Mutant(  # warps read each other's keys (prefill) before those copies landed
        "no-barrier-after-the-wait", "attention_tc.cuh",
        "cp_async_wait<kStages - 2>();\n    __syncthreads();\n    issue(tile + kStages - 1, "
        "next_block, std::true_type());",
        "cp_async_wait<kStages - 2>();\n    issue(tile + kStages - 1, next_block, "
        "std::true_type());",
    ),
    Mutant(  # waits for one stage too few: computes on a tile still in flight
        "wait-leaves-one-stage-too-many", "attention_tc.cuh",
        "cp_async_wait<kStages - 2>();", "cp_async_wait<kStages - 1>();", count=2,
    ),
    Mutant(  # a query sees its own position? off by one in the causal mask
        "causal-mask-off-by-one", "attention_tc.cuh",
        "if (pos > limit[j / 2]) s[n][j] = kNegInf;",
        "if (pos >= limit[j / 2]) s[n][j] = kNegInf;",
    ),
    Mutant(  # keys past the end read instead of zero-filled (the NaN slots of the tests)
        "no-zero-fill-past-the-end", "attention_tc.cuh",
        "const bool valid = kFull || key < valid_keys;", "const bool valid = true;",
    ),
    Mutant(  # online softmax: the output is not rescaled when the running max grows
        "output-not-rescaled", "attention_tc.cuh",
        "        o[n][2 * h] *= alpha;\n        o[n][2 * h + 1] *= alpha;\n", "",
    ),
    Mutant(  # the cache read as NHD although it is HND
        "cache-addressed-as-nhd", "attention_common.cuh",
        "return ((static_cast<int64_t>(block) * num_kv_heads + kv_head) * BS + key_in_page) * D;",
        "return ((static_cast<int64_t>(block) * BS + key_in_page) * num_kv_heads + kv_head) * D;",
    ),
    Mutant(  # the merge weighs chunks by their sums only, ignoring their maxima
        "merge-ignores-chunk-maxima", "attention_common.cuh",
        "const float weight = ml.y * exp2f(ml.x - max_all);", "const float weight = ml.y;",
    ),
    Mutant(  # the merge counter is left set: the next layer's launch never merges
        "merge-counter-not-reset", "attention_common.cuh",
        "if (threadIdx.x == 0) store_global(counter, 0);", "",
    ),
    Mutant(  # every chunk of a split tile loses its last key
        "planner-chunk-drops-a-key", "attention_plan.cuh",
        "w.kv_end = min(extent, (c + 1) * size);", "w.kv_end = min(extent, (c + 1) * size - 1);",
    ),
    Mutant(  # MHA (CUDA cores): the causal mask lets a query see the next token
        "simt-causal-mask-off-by-one", "attention_simt.cuh",
        "if (pos >= k_end || pos > row_pos) s[i][r] = kNegInf;",
        "if (pos >= k_end || pos > row_pos + 1) s[i][r] = kNegInf;",
    ),
]  # fmt: skip


def plant(mutant: Mutant, folder: Path) -> Path:
    """A copy of kernels/csrc in `folder` with the bug planted."""
    csrc = folder / "csrc"
    shutil.copytree(build.CSRC, csrc)
    path = csrc / mutant.file
    text = path.read_text()
    if text.count(mutant.original) != mutant.count:
        raise AssertionError(
            f"{mutant.name}: its source line moved; update tests/kernels/mutants.py"
        )
    path.write_text(text.replace(mutant.original, mutant.planted))
    return csrc


def workloads() -> list[tuple[str, PagedBatch]]:
    """Batches that between them exercise every path: GQA decode (key-split), prefill and
    extend (row-split; the long prefix runs its steady-state loop), and MHA (CUDA cores)."""
    long = [1, 31, 33, 300, 1200, 64]
    prefill = make_batch(
        [170, 40, 80], [150, 40, 3], 8, 2, 64, 32, torch.float16, seed=2, padding_tokens=1
    )
    return [
        ("gqa decode", make_batch(long, [1] * 6, 8, 2, 128, 16, torch.bfloat16, seed=1)),
        ("prefill + extend", prefill),
        ("extend on a long prefix", make_batch([900], [40], 8, 2, 128, 16, torch.bfloat16, seed=5)),
        ("mha decode", make_batch(long, [1] * 6, 4, 4, 128, 16, torch.float16, seed=3)),
        ("mha extend", make_batch([90, 20], [7, 5], 4, 4, 64, 16, torch.bfloat16, seed=4)),
    ]


def caught(library: KernelLibrary) -> str | None:
    """Why the emulated kernels under `library` are wrong (None: nothing noticed). Each batch
    runs on a small GPU (long chunks) and a large one (split keys), twice on one work list (as
    two layers of a step), and under two thread schedules."""
    tolerance = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2}
    for (name, batch), num_sms, greedy in itertools.product(workloads(), (4, 132), (False, True)):
        expected = reference.paged_attention(*batch.attention_args())
        tol = tolerance[batch.query.dtype]
        library.configure_emulation(greedy=greedy)
        work = None
        try:
            for layer in range(2):
                out, work = cuda.paged_attention(
                    library, batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                    batch.seq_lens, batch.query_start_loc, batch.scale, work, 0, num_sms,
                    max(batch.q_lens),
                )  # fmt: skip
                if not torch.allclose(out.float(), expected.float(), atol=tol, rtol=tol):
                    return f"{name} ({num_sms} SMs): layer {layer} differs from the reference"
        except RuntimeError as exc:
            return f"{name} ({num_sms} SMs): {exc}"
        finally:
            library.configure_emulation()
    return None


def caught_in_subprocess(library_path: Path) -> str | None:
    """caught() on the library at `library_path`, in a process of its own (a planted bug may
    well crash the process it runs in; that counts as caught)."""
    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys; from pathlib import Path; from kernels.library import KernelLibrary; "
        "from tests.kernels.mutants import caught; "
        "print('CAUGHT:', caught(KernelLibrary(Path(sys.argv[1]))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(library_path)], cwd=root, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        return f"the process died ({done.returncode}): {done.stderr.strip()[-300:]}"
    verdict = done.stdout.strip().rsplit("CAUGHT: ", 1)[-1]
    return None if verdict == "None" else verdict
