// Second pass of split-K attention: merges the splits' partial (max, sum, out) per row.
#pragma once

#include "paged_attention.cuh"

namespace kvl {

// Merges the splits of one (token, head): out = sum_s w_s * out_s / sum_s w_s with
// w_s = sum_s * 2^(max_s - max). Rows past query_start_loc[num_seqs] are padding: untouched.
// Launched with blockDim = head_dim (>= 32).
template <typename T>
__global__ void __launch_bounds__(128)
    split_reduce_kernel(const float* __restrict__ partial_out,
                        const float2* __restrict__ partial_ml, T* __restrict__ out,
                        const int* __restrict__ query_start_loc, int num_seqs, int num_splits,
                        int num_tokens, int num_heads, int head_dim) {
  __shared__ float weights[kMaxSplits];
  __shared__ float inverse_total;
  const int token = blockIdx.x;
  if (token >= load_global(query_start_loc + num_seqs)) return;  // uniform: whole CTA leaves
  const int64_t row = static_cast<int64_t>(token) * num_heads + blockIdx.y;
  const int64_t split_stride = static_cast<int64_t>(num_tokens) * num_heads;

  if (threadIdx.x < 32) {  // warp 0 turns the splits' (max, sum) into weights
    float max_all = kNegInf;
    for (int s = threadIdx.x; s < num_splits; s += 32) {
      const float2 ml = load_global(partial_ml + s * split_stride + row);
      if (ml.y > 0.f) max_all = fmaxf(max_all, ml.x);
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      max_all = fmaxf(max_all, warp_xor(max_all, offset));
    }
    float total = 0.f;
    for (int s = threadIdx.x; s < num_splits; s += 32) {
      const float2 ml = load_global(partial_ml + s * split_stride + row);
      weights[s] = ml.y > 0.f ? ml.y * exp2f(ml.x - max_all) : 0.f;
      total += weights[s];
    }
    for (int offset = 16; offset > 0; offset /= 2) total += warp_xor(total, offset);
    if (threadIdx.x == 0) inverse_total = total > 0.f ? 1.f / total : 0.f;
  }
  __syncthreads();

  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < num_splits; ++s) {
      if (weights[s] > 0.f) {  // an empty split wrote no output: never read it
        acc += weights[s] * load_global(partial_out + (s * split_stride + row) * head_dim + d);
      }
    }
    store_global(out + row * head_dim + d, from_float(acc * inverse_total, T()));
  }
}

}  // namespace kvl
