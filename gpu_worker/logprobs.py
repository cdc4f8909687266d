"""Logprobs as vLLM 0.33 computes them in its default `raw_logprobs` mode: the log-softmax of the
model's raw logits (before penalties, masks and temperature), one batched pass per step.

For each row it gathers the chosen token's logprob and rank and the top-k tokens, the shape of
vLLM's `gather_logprobs`: the chosen token first, then the k most likely in rank order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.wire.messages import TokenLogprobs


def gather_logprobs(
    logits: torch.Tensor, chosen: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """One entry per row of raw logits [rows, vocab]: `chosen[i]` and its `num_top[i]` top tokens."""
    if not chosen:
        return []
    logprobs = logits.float().log_softmax(dim=-1)
    ids = torch.as_tensor(list(chosen), dtype=torch.long, device=logits.device)[:, None]
    chosen_logprobs = logprobs.gather(-1, ids)
    # vLLM's batched_count_greater_than: ties count, so the rank is never better than it looks.
    ranks = (logprobs >= chosen_logprobs).sum(dim=-1)
    k = min(max(num_top), logprobs.shape[-1])
    top_logprobs, top_ids = (
        torch.topk(logprobs, k, dim=-1) if k > 0 else (logprobs[:, :0], ids[:, :0])
    )
    rows_ids = torch.cat((ids, top_ids), dim=1).tolist()
    rows_logprobs = torch.cat((chosen_logprobs, top_logprobs), dim=1).tolist()
    return [
        TokenLogprobs(
            token_ids=rows_ids[i][: 1 + n], logprobs=rows_logprobs[i][: 1 + n], rank=int(rank)
        )
        for i, (n, rank) in enumerate(zip(num_top, ranks.tolist(), strict=True))
    ]
