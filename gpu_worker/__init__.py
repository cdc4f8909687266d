"""The GPU worker (a role): the model, the KV cache tensors, the memory profile that sizes the
pool, and one scheduler step at a time (write K/V into slots, paged attention, sample).
It decides nothing about blocks: the ledger's step message names every slot.
"""

from gpu_worker.worker import serve

__all__ = ["serve"]
