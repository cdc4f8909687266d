"""Tensor parallelism: which rank of how many this worker is, and the collectives its layers use.

One `TensorParallel` is shared by every layer of a model; the worker swaps its process group when
the group re-forms (a new ledger epoch after a rank was lost), so layers never hold a group of
their own. With size 1 every collective is the identity and no `torch.distributed` is touched.

The process group is `torch.distributed`'s default one: gloo on the CPU, NCCL on CUDA. Rank 0
hosts a `TCPStore` on a free port and publishes its address (through Redis, see
gpu_worker/tp_group.py); the other ranks connect to it. Each formation is prefixed by its epoch,
so a rank still holding an old address cannot join a newer group by mistake.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


class TensorParallelError(ValueError):
    """A model or group this tensor-parallel size cannot serve; the text says what to change."""


@dataclass(slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    epoch: str | None = None  # the epoch the current process group was formed for
    store: Any = field(default=None, repr=False)  # rank 0's TCPStore: kept alive with the group

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise TensorParallelError(
                f"tp rank {self.rank} of size {self.size}: need size >= 1 and 0 <= rank < size"
            )

    @property
    def formed(self) -> bool:
        return self.size == 1 or (dist.is_initialized() and self.epoch is not None)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (Megatron's row-parallel reduction)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x concatenated along the last dim, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size > 1:
            dist.broadcast(x, src)
        return x


SINGLE = TensorParallel()


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def host_store(host: str, port: int, size: int, timeout_s: float) -> Any:
    """Rank 0's store (port 0: any free port; read it back from `.port`)."""
    return dist.TCPStore(
        host,
        port,
        size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def connect_store(host: str, port: int, size: int, timeout_s: float) -> Any:
    return dist.TCPStore(
        host, port, size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def form_group(
    tp: TensorParallel,
    store: Any,
    epoch: str,
    device: torch.device | str,
    timeout_s: float = 30.0,
) -> None:
    """(Re-)create the process group of `tp` for `epoch` over `store`; an older group goes first."""
    destroy_group(tp)
    dist.init_process_group(
        backend_for(device),
        store=dist.PrefixStore(f"kvledger/{epoch}/", store),
        rank=tp.rank,
        world_size=tp.size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    tp.epoch = epoch
    if tp.rank == 0:
        tp.store = store


def destroy_group(tp: TensorParallel) -> None:
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    tp.epoch = None
    tp.store = None


def local_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(query heads, KV heads) one rank holds; refuses what does not divide, as vLLM does.

    With more ranks than KV heads each KV head is replicated on size // num_kv_heads ranks."""
    n = tp.size
    if num_heads % n:
        raise TensorParallelError(
            f"num_attention_heads ({num_heads}) is not divisible by tensor_parallel_size ({n}): "
            f"choose a size that divides it"
        )
    if num_kv_heads >= n and num_kv_heads % n:
        raise TensorParallelError(
            f"num_key_value_heads ({num_kv_heads}) is not divisible by tensor_parallel_size ({n})"
        )
    if num_kv_heads < n and n % num_kv_heads:
        raise TensorParallelError(
            f"tensor_parallel_size ({n}) is not divisible by num_key_value_heads "
            f"({num_kv_heads}): KV heads can be replicated only a whole number of times"
        )
    return num_heads // n, max(1, num_kv_heads // n)


def kv_head_start(num_kv_heads: int, tp: TensorParallel) -> int:
    """The first KV head of this rank (with replication, the one head it shares)."""
    if num_kv_heads >= tp.size:
        return tp.rank * (num_kv_heads // tp.size)
    return tp.rank // (tp.size // num_kv_heads)
