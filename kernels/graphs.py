"""Decode steps replayed from CUDA graphs, one per batch-size bucket (vLLM's cudagraph capture).

A decode step (one new token per sequence) of b sequences runs as the graph of the smallest
bucket B >= b: the inputs are copied into static buffers, the B - b padding sequences get no
tokens and no keys (their slots are -1, so no K/V is written), and the first b rows of the
static output are the step's hidden states. The attention plan inside the graph is built from
the static buffers, so the planner kernel, its work list and every layer's launch are captured
(the CUDA kernels plan on the device and size their grids from the bucket alone). Other steps,
and batches past the largest bucket, run eagerly. A bucket is captured the first time it is
needed, after one eager warm-up on a side stream.
"""

from __future__ import annotations

import bisect

import torch

from kernels.backend import AttentionBackend, AttentionPlan, Forward

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def graph_bucket(
    num_seqs: int,
    num_tokens: int,
    max_query_len: int,
    table_width: int,
    max_blocks_per_seq: int,
    buckets: tuple[int, ...] = BUCKETS,
) -> int | None:
    """The smallest bucket >= num_seqs for a decode step (one token per sequence) whose block
    table fits the graphs' static one; None (run eagerly) for anything else."""
    decode = max_query_len == 1 and num_tokens == num_seqs
    if not decode or not 0 < num_seqs <= buckets[-1] or table_width > max_blocks_per_seq:
        return None
    return buckets[bisect.bisect_left(buckets, num_seqs)]


class DecodeGraphs:
    """The graphs of one model's decode steps on one device."""

    def __init__(
        self,
        backend: AttentionBackend,
        forward: Forward,
        block_size: int,
        max_blocks_per_seq: int,
        device: torch.device,
        buckets: tuple[int, ...] = BUCKETS,
    ) -> None:
        self.backend = backend
        self.forward = forward
        self.buckets = tuple(sorted(buckets))
        self.device = device
        largest = self.buckets[-1]
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(
            largest, max_blocks_per_seq, dtype=torch.int32, device=device
        )
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(largest + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.replays = 0  # decode steps served from a graph (tests and metrics read it)

    def bucket_for(self, plan: AttentionPlan, num_tokens: int) -> int | None:
        """The bucket that runs this step, or None when it must run eagerly."""
        return graph_bucket(
            plan.seq_lens.numel(), num_tokens, plan.max_query_len, plan.block_tables.shape[1],
            self.max_blocks_per_seq, self.buckets,
        )  # fmt: skip

    def run(
        self, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        """The step's hidden states [b, hidden] from the bucket's graph (captured if new)."""
        b = plan.seq_lens.numel()
        width = plan.block_tables.shape[1]
        self.input_ids[:b].copy_(input_ids)
        self.input_ids[b:bucket].zero_()
        self.positions[:b].copy_(positions)
        self.positions[b:bucket].zero_()
        self.slot_mapping[:b].copy_(plan.slot_mapping)
        self.slot_mapping[b:bucket].fill_(-1)  # padding tokens write no K/V
        self.block_tables[:b, :width].copy_(plan.block_tables)
        self.seq_lens[:b].copy_(plan.seq_lens)
        self.seq_lens[b:bucket].zero_()
        self.query_start_loc[: b + 1].copy_(plan.query_start_loc)
        self.query_start_loc[b + 1 : bucket + 1].fill_(b)  # padding sequences: no queries
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        graph, hidden = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        return hidden[:b]

    def _static_plan(self, bucket: int) -> AttentionPlan:
        return self.backend.plan(
            self.slot_mapping[:bucket],
            self.block_tables[:bucket],
            self.seq_lens[:bucket],
            self.query_start_loc[: bucket + 1],
            max_query_len=1,
            max_seq_len=self.max_blocks_per_seq * self.block_size,
        )

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, pos = self.input_ids[:bucket], self.positions[:bucket]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: lazy initialisation stays out of the graph
            self.forward(ids, pos, self._static_plan(bucket))
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            hidden = self.forward(ids, pos, self._static_plan(bucket))
        return graph, hidden
