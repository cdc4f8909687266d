"""Static check, no GPU needed: is the decode kernel bound by memory, not by instructions?

Compiles csrc/paged_attention.cu for sm_90 (H100 and H200), disassembles the tensor-core
kernel with cuobjdump, finds the steady-state loop of its key-split mode (decode: every warp
computes the group's rows over its own 16 keys of a 64-key stage) and counts its instructions.
Per stage of one KV head (64 keys of K and V) the SM must issue 4 warps x that loop, at 4
warp-instructions per cycle; HBM must deliver the stage's bytes at the GPU's bandwidth shared
by its SMs. The kernel is memory-bound when the issue cycles (and the tensor and MUFU pipes'
cycles) per stage are at most the HBM cycles. Writes benchmarks/results/kernels-static.json.

    python benchmarks/kernels_static.py [--out FILE]      (exit 1: instruction-bound)
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]
sys.path.insert(0, str(ROOT))

from kernels import build  # noqa: E402

# Datasheet figures (SXM parts), the SM clock under load as seen on this workplace's H200.
GPUS = {
    "H100": {"sms": 132, "clock_ghz": 1.98, "hbm_tbps": 3.35},
    "H200": {"sms": 132, "clock_ghz": 1.98, "hbm_tbps": 4.8},
}
ISSUE_PER_CYCLE = 4  # warp-instructions an SM issues per cycle (one per scheduler)
HMMA_CYCLES = 8  # cycles one HMMA.16816 (f32 accumulate) holds a sub-core's tensor pipe
MUFU_CYCLES = 8  # a warp's MUFU.EX2: 16 lanes per cycle per SM, 4 per sub-core
WARPS, STAGE_KEYS, WARP_KEYS = 4, 64, 16  # tc::kWarps, kTileKeys, kWarpKeys
CONFIGS = [(gqa, 128, "bfloat16") for gqa in (4, 8)]
MANGLED_TYPES = {"bfloat16": "13__nv_bfloat16", "float16": "6__half"}


@dataclass
class Loop:
    begin: int  # address of the loop head
    end: int  # address of the backward branch
    ops: collections.Counter[str]

    @property
    def instructions(self) -> int:
        return sum(self.ops.values())


def find_tool(name: str) -> str | None:
    """`name` on PATH, under CUDA_HOME, next to nvcc, or from the nvidia-cuda-* pip wheels."""
    found = shutil.which(name)
    if found:
        return found
    nvcc = build.find_nvcc()
    homes = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    if nvcc:
        homes.append(str(Path(nvcc).resolve().parent.parent))
    candidates = [Path(h) / "bin" / name for h in homes if h]
    for entry in sys.path:
        candidates += sorted(Path(entry or ".").glob(f"nvidia/cu*/bin/{name}"))
    return next((str(c) for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


# What the copies would be in an NHD cache ([blocks, block_size, kv_heads, dim]): a warp's 16
# keys are 16 rows num_kv_heads * dim apart instead of one contiguous run (--compare-nhd).
NHD_COPIES = {
    "const int64_t page = hnd_offset<D, BS>(block, p.num_kv_heads, kv_head, warp_key_in_page);":
    "const int64_t page = ((static_cast<int64_t>(block) * BS + warp_key_in_page) * "
    "p.num_kv_heads + kv_head) * D;",
    "cp_async_16(k_dst + at, valid ? k_cache + page + c * 8 : k_cache, valid ? 16 : 0);":
    "const int64_t src = page + static_cast<int64_t>(key) * p.num_kv_heads * D + c % L::kChunks "
    "* 8;\n      cp_async_16(k_dst + at, valid ? k_cache + src : k_cache, valid ? 16 : 0);",
    "cp_async_16(v_dst + at, valid ? v_cache + page + c * 8 : v_cache, valid ? 16 : 0);":
    "cp_async_16(v_dst + at, valid ? v_cache + src : v_cache, valid ? 16 : 0);",
}  # fmt: skip


def nhd_sources(folder: Path) -> Path:
    """A copy of kernels/csrc whose tensor-core kernel copies from an NHD cache."""
    csrc = folder / "csrc"
    shutil.copytree(build.CSRC, csrc)
    path = csrc / "attention_tc.cuh"
    text = path.read_text()
    for hnd, nhd in NHD_COPIES.items():
        if text.count(hnd) != 1:
            raise RuntimeError(f"attention_tc.cuh changed: update NHD_COPIES ({hnd})")
        text = text.replace(hnd, nhd)
    path.write_text(text)
    return csrc


def compile_cubin(nvcc: str, arch: str = "90", csrc: Path = build.CSRC) -> Path:
    """The sm_XX cubin of paged_attention.cu, cached by the hash of the sources and command."""
    source = csrc / "paged_attention.cu"
    command = [nvcc, "-std=c++17", "-O3", f"-arch=sm_{arch}", "-cubin", "-o", "OUT", str(source)]
    digest = hashlib.sha256(" ".join(command[:-1]).encode())
    for path in build.sources(csrc) + build.headers(csrc):
        digest.update(path.read_bytes())
    target = build.cache_root() / f"static-{digest.hexdigest()[:16]}" / f"sm_{arch}.cubin"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        out = Path(work) / target.name
        command[command.index("OUT")] = str(out)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}\n{done.stderr}")
        out.rename(target)
    return target


def kernel_name(dtype: str, head_dim: int, block_size: int) -> str:
    return (
        f"_ZN3kvl2tc16attention_kernelI{MANGLED_TYPES[dtype]}Li{head_dim}ELi{block_size}EEEvNS_"
        "15AttentionParamsE"
    )


def disassemble(cuobjdump: str, nvdisasm: str, cubin: Path, function: str) -> str:
    env = {**os.environ, "NVDISASM_PATH": str(Path(nvdisasm).parent)}  # cuobjdump calls it
    done = subprocess.run(
        [cuobjdump, "-sass", "-fun", function, str(cubin)], capture_output=True, text=True, env=env
    )
    if done.returncode != 0 or "Function" not in done.stdout:
        raise RuntimeError(f"cuobjdump found no {function} in {cubin}: {done.stderr}")
    return done.stdout


INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def opcode(text: str) -> str:
    """`@!P0 HMMA.16816.F32.BF16 R4, ...` -> `HMMA`."""
    words = text.split()
    if words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0]


def loops(sass: str) -> list[Loop]:
    """Every backward branch's range [target, branch], with the opcodes it holds."""
    code = [
        (int(m.group(1), 16), m.group(2)) for m in map(INSTRUCTION.match, sass.splitlines()) if m
    ]
    index = {address: i for i, (address, _) in enumerate(code)}
    found = []
    for i, (address, text) in enumerate(code):
        branch = re.search(r"\bBRA\s+0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) <= address:
            body = code[index[int(branch.group(1), 16)] : i + 1]
            ops = collections.Counter(opcode(t) for _, t in body)
            found.append(Loop(int(branch.group(1), 16), address, ops))
    return found


def decode_loop(sass: str, head_dim: int) -> Loop:
    """The key-split mode's steady-state loop: per warp and stage, S = Q K^T is 2 key tiles x
    head_dim/16 k-steps and O += P V is head_dim/8 tiles, so 2 * head_dim/8 HMMAs; of the two
    loops with that count (full tiles, boundary tiles) the shorter one, without masks."""
    hmmas = (WARP_KEYS // 8) * (head_dim // 16) + (head_dim // 8) * (WARP_KEYS // 16)
    candidates = [loop for loop in loops(sass) if loop.ops["HMMA"] == hmmas]
    if not candidates:
        raise RuntimeError(f"no loop with {hmmas} HMMA: the kernel's structure changed")
    return min(candidates, key=lambda loop: loop.instructions)


def stage_figures(loop: Loop, head_dim: int, element_bytes: int, gpu: dict[str, float]) -> dict:
    stage_bytes = STAGE_KEYS * 2 * head_dim * element_bytes  # K and V of one KV head
    per_sm_bytes_per_cycle = gpu["hbm_tbps"] * 1e12 / (gpu["sms"] * gpu["clock_ghz"] * 1e9)
    issue = WARPS * loop.instructions / ISSUE_PER_CYCLE
    tensor = WARPS * loop.ops["HMMA"] * HMMA_CYCLES / ISSUE_PER_CYCLE
    mufu = WARPS * loop.ops["MUFU"] * MUFU_CYCLES / ISSUE_PER_CYCLE
    hbm = stage_bytes / per_sm_bytes_per_cycle
    return {
        "stage_bytes": stage_bytes,
        "issue_cycles_per_tile": round(issue, 1),
        "tensor_cycles_per_tile": round(tensor, 1),
        "mufu_cycles_per_tile": round(mufu, 1),
        "hbm_cycles_per_tile": round(hbm, 1),
        "memory_bound": max(issue, tensor, mufu) <= hbm,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/kernels-static.json")
    parser.add_argument(
        "--compare-nhd", action="store_true", help="also count the loop with NHD-cache copies"
    )
    args = parser.parse_args(argv)
    tools = {"nvcc": build.find_nvcc(), "cuobjdump": find_tool("cuobjdump")}
    tools["nvdisasm"] = find_tool("nvdisasm")
    missing = [name for name, path in tools.items() if path is None]
    if missing:  # the test extras install cuobjdump and nvdisasm; nvcc comes with CUDA
        print(f"kernels static check skipped: no {', '.join(missing)} on this machine")
        return 0
    nvcc, cuobjdump, nvdisasm = tools["nvcc"], tools["cuobjdump"], tools["nvdisasm"]
    assert nvcc and cuobjdump and nvdisasm
    cubin = compile_cubin(nvcc)
    records, ok = [], True
    print(f"{'gpu':5} {'gqa':>3} {'dim':>3} {'dtype':8} | {'instr/warp':>10} {'HMMA':>4} "
          f"{'LDSM':>4} {'LDGSTS':>6} {'MUFU':>4} | {'issue':>6} {'tensor':>6} {'mufu':>5} "
          f"{'HBM':>6} cycles/tile | bound")  # fmt: skip
    for gqa, head_dim, dtype in CONFIGS:
        sass = disassemble(cuobjdump, nvdisasm, cubin, kernel_name(dtype, head_dim, 16))
        loop = decode_loop(sass, head_dim)
        for name, gpu in GPUS.items():
            figures = stage_figures(loop, head_dim, 2, gpu)
            ok &= figures["memory_bound"]
            records.append({
                "gpu": name, "gqa": gqa, "head_dim": head_dim, "dtype": dtype, "block_size": 16,
                "kernel": "tensor cores, key-split (decode)", "loop_instructions_per_warp":
                loop.instructions, "loop_ops": dict(loop.ops.most_common()), **figures,
            })  # fmt: skip
            f = figures
            print(f"{name:5} {gqa:>3} {head_dim:>3} {dtype:8} | {loop.instructions:>10} "
                  f"{loop.ops['HMMA']:>4} {loop.ops['LDSM']:>4} {loop.ops['LDGSTS']:>6} "
                  f"{loop.ops['MUFU']:>4} | {f['issue_cycles_per_tile']:>6} "
                  f"{f['tensor_cycles_per_tile']:>6} {f['mufu_cycles_per_tile']:>5} "
                  f"{f['hbm_cycles_per_tile']:>6}             | "
                  f"{'memory' if f['memory_bound'] else 'INSTRUCTIONS'}")  # fmt: skip
    if args.compare_nhd:
        with tempfile.TemporaryDirectory() as folder:
            nhd_cubin = compile_cubin(nvcc, csrc=nhd_sources(Path(folder)))
            for _, head_dim, dtype in CONFIGS[:1]:
                name = kernel_name(dtype, head_dim, 16)
                hnd = decode_loop(disassemble(cuobjdump, nvdisasm, cubin, name), head_dim)
                nhd = decode_loop(disassemble(cuobjdump, nvdisasm, nhd_cubin, name), head_dim)
                print(
                    f"copies from an NHD cache: {nhd.instructions} instructions per warp and "
                    f"stage ({dict(nhd.ops.most_common(6))}); HND: {hnd.instructions}"
                )
        return 0 if ok else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model = {
        "tile": f"one 64-key stage of one KV head: {WARPS} warps x the loop",
        "issue_per_cycle": ISSUE_PER_CYCLE, "hmma_cycles": HMMA_CYCLES,
        "mufu_cycles": MUFU_CYCLES, "gpus": GPUS, "nvcc": build._tool_version(nvcc).strip()
        .splitlines()[-1],
    }  # fmt: skip
    args.out.write_text(json.dumps({"model": model, "records": records}, indent=1) + "\n")
    print(f"wrote {args.out}" + ("" if ok else ": the decode kernel is instruction-bound"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
