"""Megatron-style tensor-parallel layers with Hugging Face parameter names.

A column-parallel linear holds a slice of the output rows (q/k/v, gate/up: no communication); a
row-parallel linear holds the matching slice of the input columns and sums the partial outputs
with one all-reduce (o, down). The embedding and the LM head split the vocabulary: each rank
embeds the ids it owns (zeros elsewhere, then all-reduce) and computes its slice of the logits
(all-gathered). At size 1 each layer computes exactly what `nn.Linear`/`nn.Embedding` compute.

Every layer knows which part of the full checkpoint tensor it holds (`full_slices`), so the
loader reads only that part from safetensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.parallel import TensorParallel
from ledger.capacity import cdiv

Slices = tuple[slice, ...]


class ParallelLinear(nn.Module):
    """Shared by the column and row variants: a [out, in] weight and an optional [out] bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def full_slices(self, param: str) -> Slices:
        raise NotImplementedError


class ColumnParallelLinear(ParallelLinear):
    """Rows `start .. start + size` of a full [out_full, in] linear (the slice's bias too)."""

    def __init__(
        self, in_features: int, start: int, size: int, bias: bool, tp: TensorParallel
    ) -> None:
        super().__init__(in_features, size, bias, tp)
        self.start = start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def full_slices(self, param: str) -> Slices:
        rows = slice(self.start, self.start + self.weight.shape[0])
        return (rows,) if param == "bias" else (rows, slice(None))


class RowParallelLinear(ParallelLinear):
    """Columns `start .. start + size` of a full [out, in_full] linear; the bias is added once,
    after the all-reduce."""

    def __init__(
        self, start: int, size: int, out_features: int, bias: bool, tp: TensorParallel
    ) -> None:
        super().__init__(size, out_features, bias, tp)
        self.start = start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def full_slices(self, param: str) -> Slices:
        if param == "bias":
            return (slice(None),)
        return (slice(None), slice(self.start, self.start + self.weight.shape[1]))


def vocab_range(vocab_size: int, tp: TensorParallel) -> tuple[int, int, int]:
    """(first id, ids held from the checkpoint, padded rows per rank): the vocabulary is split
    into equal padded parts, the last rank's padding rows stay zero."""
    per_rank = cdiv(vocab_size, tp.size)
    start = min(tp.rank * per_rank, vocab_size)
    return start, min(per_rank, vocab_size - start), per_rank


class _VocabShard(nn.Module):
    """This rank's rows of a (vocab, hidden) weight: the embedding's or the LM head's."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.start, self.num_held, per_rank = vocab_range(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size))

    def full_slices(self, param: str) -> Slices:
        return (slice(self.start, self.start + self.num_held), slice(None))


class VocabParallelEmbedding(_VocabShard):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_held)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(_VocabShard):
    """The vocab-parallel LM head: each rank's logits slice, all-gathered and unpadded."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last(logits)[..., : self.vocab_size]


def load_shard(param: torch.Tensor, part: torch.Tensor) -> None:
    """Copy a rank's part of a checkpoint tensor into `param` (vocab padding rows get zeros)."""
    with torch.no_grad():
        if tuple(part.shape) == tuple(param.shape):
            param.copy_(part)
            return
        param.zero_()
        param[: part.shape[0]].copy_(part)
