// What both attention kernels share: their parameters, the HND cache addressing, and the
// epilogue that turns a CTA's per-row (max, sum, output) into the final rows, or into a split's
// partial rows that the tile's last chunk to finish merges (no second launch).
#pragma once

#include <cmath>
#include <type_traits>

#include "attention_plan.cuh"

namespace kvl {

constexpr float kNegInf = -INFINITY;

struct AttentionParams {
  const void* query;  // [num_tokens, num_heads, D], tokens q_stride elements apart
  const void* key_cache;  // [num_blocks, num_kv_heads, BS, D] (HND: a page of one head is
  const void* value_cache;  //  one contiguous BS * D run)
  const int* block_tables;  // [num_seqs, bt_stride]
  const int* seq_lens;  // [num_seqs], context including this step's tokens
  const int* query_start_loc;  // [num_seqs + 1]
  const WorkItem* items;  // the step's work list (attention_plan.cuh)
  const int* num_items;
  void* out;  // [num_tokens, num_heads, D]
  float* partial_out;  // [max_slots, num_kv_heads, slot_rows, D]
  float2* partial_ml;  // [max_slots, num_kv_heads, slot_rows]: (max in log2 units, sum)
  int* counters;  // [max_tiles, num_kv_heads]: chunks of a split tile done; zero between launches
  int64_t q_stride;
  int bt_stride;
  int num_seqs, num_tokens, num_heads, num_kv_heads;
  int slot_rows;
  float scale_log2;  // softmax scale * log2(e): scores live in the exp2 domain
};

// Element offset of key `key_in_page` of KV head `kv_head` in page `block` of an HND cache.
template <int D, int BS>
__device__ __forceinline__ int64_t hnd_offset(int block, int num_kv_heads, int kv_head,
                                              int key_in_page) {
  return ((static_cast<int64_t>(block) * num_kv_heads + kv_head) * BS + key_in_page) * D;
}

__device__ __forceinline__ WorkItem load_item(const WorkItem* item) {
  WorkItem w;
  const int* src = reinterpret_cast<const int*>(item);
  int* dst = reinterpret_cast<int*>(&w);
#pragma unroll
  for (int i = 0; i < 10; ++i) dst[i] = load_global(src + i);
  return w;
}

// The CTA in the grid's last column writes zeros to the rows of this KV head's query heads past
// query_start_loc[num_seqs] (padding tokens, e.g. of a CUDA-graph batch): no memset of `out`.
template <typename T, int D>
__device__ void zero_padding_rows(const AttentionParams& p, int kv_head) {
  const int group = p.num_heads / p.num_kv_heads;
  const int first = max(0, min(p.num_tokens, load_global(p.query_start_loc + p.num_seqs)));
  const int64_t count = static_cast<int64_t>(p.num_tokens - first) * group * D;
  for (int64_t idx = threadIdx.x; idx < count; idx += blockDim.x) {
    const int64_t token = first + idx / (group * D);
    const int head = kv_head * group + static_cast<int>(idx / D % group);
    store_global(static_cast<T*>(p.out) + (token * p.num_heads + head) * D + idx % D,
                 from_float(0.f, T()));
  }
}

// Finishes one item from `sources` partial results per row, each (max m, sum l, unnormalised
// output o) over a disjoint set of keys: o at o_rows[(s * row_stride + r) * D + d], m and l at
// [s * row_stride + r] (m = -inf: that source saw no key). Row r of the tile is query token
// q_begin + r / group and query head kv_head * group + r % group. Every thread of the CTA calls.
template <typename T, int D>
__device__ void finish_item(const AttentionParams& p, const WorkItem& item, int kv_head,
                            int group, const float* o_rows, const float* m_rows,
                            const float* l_rows, int sources, int row_stride) {
  __shared__ int merges;  // this CTA finished the tile's last chunk: it merges the others
  const int rows = item.n_tok * group;
  const bool split = item.num_chunks > 1;
  auto slot_row = [&](int chunk, int r) {
    return (static_cast<int64_t>(item.first_slot + chunk) * p.num_kv_heads + kv_head) *
               p.slot_rows + r;
  };
  auto out_at = [&](int r, int d) {
    const int64_t token = item.q_begin + r / group;
    return static_cast<T*>(p.out) + (token * p.num_heads + kv_head * group + r % group) * D + d;
  };
  for (int idx = threadIdx.x; idx < rows * D; idx += blockDim.x) {
    const int r = idx / D;
    const int d = idx % D;
    float max_all = kNegInf;
    for (int s = 0; s < sources; ++s) max_all = fmaxf(max_all, m_rows[s * row_stride + r]);
    float sum = 0.f;
    float acc = 0.f;
    for (int s = 0; s < sources; ++s) {
      const float m = m_rows[s * row_stride + r];
      if (m != kNegInf) {  // a source that saw no key holds no output: never read it
        const float weight = exp2f(m - max_all);
        sum += l_rows[s * row_stride + r] * weight;
        acc += o_rows[(s * row_stride + r) * D + d] * weight;
      }
    }
    const float value = sum > 0.f ? acc / sum : 0.f;  // no visible key (malformed input): zero
    if (!split) {
      store_global(out_at(r, d), from_float(value, T()));
    } else {
      const int64_t row = slot_row(item.chunk, r);
      store_global(p.partial_out + row * D + d, value);
      if (d == 0) store_global(p.partial_ml + row, float2{sum > 0.f ? max_all : kNegInf, sum});
    }
  }
  if (!split) return;

  // Publish the partial rows, then count this chunk in; the tile's last chunk to arrive merges.
  thread_fence();
  __syncthreads();
  int* counter = p.counters + static_cast<int64_t>(item.tile) * p.num_kv_heads + kv_head;
  if (threadIdx.x == 0) merges = atomic_add_global(counter, 1) == item.num_chunks - 1;
  __syncthreads();
  if (!merges) return;
  thread_fence();
  for (int idx = threadIdx.x; idx < rows * D; idx += blockDim.x) {
    const int r = idx / D;
    const int d = idx % D;
    float max_all = kNegInf;
    for (int c = 0; c < item.num_chunks; ++c) {
      const float2 ml = load_coherent(p.partial_ml + slot_row(c, r));
      if (ml.y > 0.f) max_all = fmaxf(max_all, ml.x);
    }
    float sum = 0.f;
    float acc = 0.f;
    for (int c = 0; c < item.num_chunks; ++c) {
      const float2 ml = load_coherent(p.partial_ml + slot_row(c, r));
      if (ml.y > 0.f) {  // an empty chunk wrote no output: never read it
        const float weight = ml.y * exp2f(ml.x - max_all);
        sum += weight;
        acc += weight * load_coherent(p.partial_out + slot_row(c, r) * D + d);
      }
    }
    store_global(out_at(r, d), from_float(sum > 0.f ? acc / sum : 0.f, T()));
  }
  if (threadIdx.x == 0) store_global(counter, 0);  // ready for the next layer's launch
}

}  // namespace kvl
