"""The static check's SASS reading (benchmarks/kernels_static.py) on a listing made up here:
loops are found from backward branches, and the decode loop is told from the boundary loop."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "kernels_static", Path(__file__).resolve().parents[2] / "benchmarks" / "kernels_static.py"
)
assert SPEC and SPEC.loader
static = importlib.util.module_from_spec(SPEC)
sys.modules["kernels_static"] = static  # its dataclasses look their module up
SPEC.loader.exec_module(static)


def listing(*bodies: list[str]) -> str:
    """SASS as cuobjdump prints it, each body a loop closed by a backward branch."""
    lines, address = [], 0
    for body in bodies:
        head = address
        for text in [*body, f"@!P0 BRA 0x{head:x}"]:
            lines.append(f"        /*{address:04x}*/      {text} ;   /* 0x000000000000 */")
            address += 16
        lines.append(f"        /*{address:04x}*/      EXIT ;   /* 0x000000000000 */")
        address += 16
    return "\n".join(lines)


def test_loops_are_backward_branches_with_their_opcodes():
    sass = listing(["HMMA.16816.F32.BF16 R4, R8, R12, R4", "@P1 LDGSTS.E.BYPASS.128 [R2], [R4.64]"])
    (loop,) = static.loops(sass)
    assert (loop.begin, loop.end, loop.instructions) == (0, 0x20, 3)
    assert loop.ops == {"HMMA": 1, "LDGSTS": 1, "BRA": 1}


def test_decode_loop_is_the_shorter_one_with_the_decode_hmma_count():
    hmmas = ["HMMA.16816.F32.BF16 R4, R8, R12, R4"] * 32
    masked = hmmas + ["ISETP.GT.AND P2, PT, R3, R5, PT", "FSEL R6, R6, -INF, !P2"] * 8
    prefill = ["HMMA.16816.F32.BF16 R4, R8, R12, R4"] * 128
    loop = static.decode_loop(listing(prefill, masked, hmmas + ["FMUL R1, R1, R2"]), 128)
    assert loop.instructions == 34 and loop.ops["FMUL"] == 1


def test_a_stage_of_bf16_head_dim_128_is_32_kib_and_the_h200_streams_it_in_1784_cycles():
    loop = static.decode_loop(listing(["HMMA.16816.F32.BF16 R4, R8, R12, R4"] * 32), 128)
    figures = static.stage_figures(loop, 128, 2, static.GPUS["H200"])
    assert figures["stage_bytes"] == 32768
    assert figures["hbm_cycles_per_tile"] == 1784.2
    assert figures["issue_cycles_per_tile"] == 4 * 33 / 4 and figures["memory_bound"]
