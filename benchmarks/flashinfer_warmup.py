"""Builds FlashInfer's JIT kernels for the benchmark's shapes ahead of it (run_on_device.sh
starts this beside the kernels' build and GPU tests, so the compile overlaps them): one tiny
plan and run of the batch decode wrapper with and without tensor cores, as kernels.py does."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).parent)]

import kernel_baselines as methods  # noqa: E402

from kernels import kv_cache_shape  # noqa: E402


def main() -> int:
    if not methods.flashinfer_available():
        print("flashinfer is not installed")
        return 1
    shape = kv_cache_shape(4, 16, 8, 128)
    inp = {
        "query": torch.randn(2, 32, 128, device="cuda", dtype=torch.bfloat16),
        "key_cache": torch.randn(shape, device="cuda", dtype=torch.bfloat16),
        "value_cache": torch.randn(shape, device="cuda", dtype=torch.bfloat16),
        "block_tables": torch.arange(4, device="cuda", dtype=torch.int32).view(2, 2),
        "seq_lens": torch.tensor([20, 32], device="cuda", dtype=torch.int32),
        "scale": 128**-0.5,
    }
    for tensor_cores in (True, False):
        started = time.perf_counter()
        methods.FlashInferDecode(torch.device("cuda"), tensor_cores).prepare(inp)()
        torch.cuda.synchronize()
        print(
            f"flashinfer tensor_cores={tensor_cores}: ready in {time.perf_counter() - started:.0f}s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
