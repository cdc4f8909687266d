"""Run one function on N spawned gloo ranks (a file store) and collect rank 0's tensors.

Results travel as safetensors files, never pickles; a rank's exception fails the run with its
traceback (the other ranks then fail on the broken group, bounded by the group timeout).
"""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

RankFn = Callable[..., dict[str, torch.Tensor]]


def _rank_main(fn: RankFn, rank: int, size: int, folder: str, args: tuple) -> None:
    import datetime

    import torch.distributed as dist

    from gpu_worker.parallel import TensorParallel

    out = Path(folder)
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(str(out / "store"), size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=size,
            timeout=datetime.timedelta(seconds=60),
        )  # fmt: skip
        tensors = fn(TensorParallel(rank, size), *args)
        if rank == 0:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "rank0.st"))
        dist.destroy_process_group()
    except BaseException:
        (out / f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def run_ranks(fn: RankFn, size: int, folder: Path, *args, timeout_s: float = 300) -> dict:
    from safetensors.torch import load_file

    folder.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, size, str(folder), args))
        for rank in range(size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
    errors = sorted(folder.glob("error*.txt"))
    if errors:
        raise AssertionError(errors[0].read_text())
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return load_file(str(folder / "rank0.st"))
