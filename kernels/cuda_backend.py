"""The CUDA attention backend: the kernels of `kernels/csrc` on one CUDA device, with decode
steps replayed from CUDA graphs (`kernels.graphs`)."""

from __future__ import annotations

import torch

from kernels import cuda
from kernels.backend import AttentionBackend, AttentionPlan, Forward, KVCache
from kernels.graphs import DecodeGraphs


class CudaKernels(AttentionBackend):
    """The kernels of `kernels/csrc` on one CUDA device: a step's work list planned on the device
    at its first layer, then one launch per layer (tensor cores for GQA, CUDA cores for MHA
    decodes), and decode steps replayed from CUDA graphs once `use_cuda_graphs` is called."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self._cuda = cuda
        self.device = device
        self.library = cuda.load()
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.graphs: DecodeGraphs | None = None  # once use_cuda_graphs is called

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, plan: AttentionPlan
    ) -> None:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self.library.reshape_and_cache(key, value, *kv_cache, plan.slot_mapping, stream)

    def attention(
        self, query: torch.Tensor, kv_cache: KVCache, plan: AttentionPlan, scale: float
    ) -> torch.Tensor:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        out, plan.prepared = self._cuda.paged_attention(
            self.library, query, *kv_cache, plan.block_tables, plan.seq_lens,
            plan.query_start_loc, scale, plan.prepared, stream, self.num_sms, plan.max_query_len,
        )  # fmt: skip
        return out

    def use_cuda_graphs(self, forward: Forward, block_size: int, max_blocks_per_seq: int) -> None:
        self.graphs = DecodeGraphs(self, forward, block_size, max_blocks_per_seq, self.device)

    def execute(
        self,
        forward: Forward,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        if self.graphs is None:
            return forward(input_ids, positions, plan)
        bucket = self.graphs.bucket_for(plan, input_ids.numel())
        if bucket is None:
            return forward(input_ids, positions, plan)
        return self.graphs.run(bucket, input_ids, positions, plan)
