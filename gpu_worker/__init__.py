"""The GPU worker (a role): the model, the KV cache tensors, the memory profile that sizes the
pool, and one scheduler step at a time (write K/V into slots, paged attention, sample).
It decides nothing about blocks: the ledger's step message names every slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.config import WorkerConfig


async def serve(config: WorkerConfig) -> None:
    """`gpu_worker.worker.serve`, with OpenMP's wait policy set first: torch reads it once, as it
    loads, and threads that spin on a shared CPU slow every step (gpu_worker/threads.py)."""
    from gpu_worker.threads import prefer_passive_openmp_wait

    prefer_passive_openmp_wait()
    from gpu_worker.worker import serve as serve_worker

    await serve_worker(config)


__all__ = ["serve"]
