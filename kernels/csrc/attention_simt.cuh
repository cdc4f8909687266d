// Paged attention on CUDA cores, for MHA (one query head per KV head, where a tensor-core tile
// would be 15/16 padding): one CTA per work item and KV head, its rows a few query tokens. Each
// thread owns 8 dims of every row; a K/V row is kChunks 16-byte chunks, one per thread, so the
// CTA covers kSlots keys at once and dot products finish with a warp reduction.
#pragma once

#include "attention_common.cuh"

namespace kvl {
namespace simt {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTileKeys = 32;  // keys per pipeline stage
constexpr int kMaxRows = 8;  // (query token, head) rows per CTA; kernels/cuda.py keeps to it
constexpr int kStages = 4;  // tiles in flight: ~3 x 16 KB per CTA at head_dim 128
static_assert(kChunkAlign % kTileKeys == 0, "items start on a stage boundary");

// Thread layout: a K/V row of D values is kChunks 16-byte chunks, one per thread, so the CTA
// covers kSlots keys at once; thread (slot, chunk) loads and reads only its own chunks of keys
// slot, slot + kSlots, ... in every tile. Each thread therefore reads back exactly what its
// own cp.async wrote, and the main loop needs no CTA barrier.
template <int D>
struct Layout {
  static constexpr int kChunks = D / 8;
  static constexpr int kSlots = kThreads / kChunks;
  static constexpr int kKeysPerSlot = kTileKeys / kSlots;
  static constexpr int kTileBytes = kStages * 2 * kTileKeys * D * 2;  // K and V, 16-bit
  static constexpr int kReduceBytes = kWarps * kMaxRows * D * static_cast<int>(sizeof(float));
  static constexpr int kSmemBytes = kTileBytes > kReduceBytes ? kTileBytes : kReduceBytes;
  static_assert(D % 8 == 0 && 32 % kChunks == 0, "a warp holds whole K/V rows");
  static_assert(kTileKeys % kSlots == 0, "every slot gets the same number of keys per tile");
};

// Offset of the (stage, tensor, key, chunk) 16-byte piece in the tile buffer, in elements.
template <int D>
__device__ __forceinline__ int tile_offset(int stage, int tensor, int key, int chunk) {
  return ((stage * 2 + tensor) * kTileKeys + key) * D + chunk * 8;
}

template <typename T, int D, int BS>
__global__ void __launch_bounds__(kThreads) attention_kernel(const AttentionParams p) {
  using L = Layout<D>;
  KVL_DYNAMIC_SMEM(smem);  // L::kSmemBytes
  __shared__ float warp_max[kWarps][kMaxRows];
  __shared__ float warp_sum[kWarps][kMaxRows];

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int chunk = tid % L::kChunks;
  const int slot = tid / L::kChunks;
  const int kv_head = blockIdx.y;
  if (blockIdx.x == gridDim.x - 1) return zero_padding_rows<T, D>(p, kv_head);
  if (static_cast<int>(blockIdx.x) >= load_global(p.num_items)) return;  // past the work list
  const WorkItem item = load_item(p.items + blockIdx.x);
  const int group = p.num_heads / p.num_kv_heads;
  const int rows = item.n_tok * group;
  const int first_pos = item.first_pos;
  const int k_begin = item.kv_begin;
  const int k_end = item.kv_end;

  // Row r is query token (q_begin + r / group) and query head kv_head*group + r%group.
  auto row_token = [&](int r) { return static_cast<int64_t>(item.q_begin + r / group); };
  auto row_head = [&](int r) { return kv_head * group + r % group; };

  // This thread's 8 dims of every row's query, pre-scaled into the exp2 domain.
  float q[kMaxRows][8];
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    if (r < rows) {
      const T* src = static_cast<const T*>(p.query) + row_token(r) * p.q_stride +
                     row_head(r) * D + chunk * 8;
      unpack8(load_global_16(src), q[r], T());
#pragma unroll
      for (int e = 0; e < 8; ++e) q[r][e] *= p.scale_log2;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) q[r][e] = 0.f;
    }
  }

  const T* key_cache = static_cast<const T*>(p.key_cache);
  const T* value_cache = static_cast<const T*>(p.value_cache);
  const int* block_table = p.block_tables + static_cast<int64_t>(item.seq) * p.bt_stride;
  T* tiles = reinterpret_cast<T*>(smem);
  const int num_tiles = max(0, k_end - k_begin + kTileKeys - 1) / kTileKeys;

  // Block ids of this thread's keys in the next tile to issue; fetched a tile ahead so the
  // block-table load latency hides behind the math of the current tile.
  int block_ids[L::kKeysPerSlot];
  auto fetch_block_ids = [&](int tile) {
#pragma unroll
    for (int i = 0; i < L::kKeysPerSlot; ++i) {
      const int pos = k_begin + tile * kTileKeys + slot + i * L::kSlots;
      block_ids[i] = pos < k_end ? load_global(block_table + pos / BS) : 0;
    }
  };
  auto issue_tile = [&](int tile) {
    const int stage = tile % kStages;
#pragma unroll
    for (int i = 0; i < L::kKeysPerSlot; ++i) {
      const int key = slot + i * L::kSlots;
      const int pos = k_begin + tile * kTileKeys + key;
      T* k_dst = tiles + tile_offset<D>(stage, 0, key, chunk);
      T* v_dst = tiles + tile_offset<D>(stage, 1, key, chunk);
      if (pos < k_end) {
        const int64_t row = hnd_offset<D, BS>(block_ids[i], p.num_kv_heads, kv_head, pos % BS);
        cp_async_16(k_dst, key_cache + row + chunk * 8, 16);
        cp_async_16(v_dst, value_cache + row + chunk * 8, 16);
      } else {  // past the end (last block's tail, or past the split): zeros, nothing read
        cp_async_16(k_dst, key_cache, 0);
        cp_async_16(v_dst, value_cache, 0);
      }
    }
    cp_async_commit();
  };

  float acc[kMaxRows][8];
  float row_max[kMaxRows];
  float row_sum[kMaxRows];  // this slot's share of the softmax denominator
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    row_max[r] = kNegInf;
    row_sum[r] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[r][e] = 0.f;
  }

  // Pipeline: tiles 0..kStages-2 in flight before the loop; iteration `tile` refills the stage
  // read by the previous iteration with tile + kStages - 1. Every iteration commits exactly one
  // group (empty past the end), so "all but the newest kStages - 1 groups" is `tile`.
#pragma unroll
  for (int tile = 0; tile < kStages - 1; ++tile) {
    if (tile < num_tiles) {
      fetch_block_ids(tile);
      issue_tile(tile);
    } else {
      cp_async_commit();
    }
  }
  if (kStages - 1 < num_tiles) fetch_block_ids(kStages - 1);

  for (int tile = 0; tile < num_tiles; ++tile) {
    // The refill below overwrites the stage this thread read last iteration; the warp barrier
    // orders those shared-memory reads before the asynchronous writes.
    __syncwarp();
    const int next = tile + kStages - 1;
    if (next < num_tiles) {
      issue_tile(next);
    } else {
      cp_async_commit();
    }
    if (next + 1 < num_tiles) fetch_block_ids(next + 1);
    cp_async_wait<kStages - 1>();

    const int stage = tile % kStages;
    const int tile_pos = k_begin + tile * kTileKeys;

    // Scores of this thread's keys: partial dot products over its 8 dims, summed across the
    // kChunks lanes that hold the rest of the row (contiguous lanes of the warp).
    float s[L::kKeysPerSlot][kMaxRows];
#pragma unroll
    for (int i = 0; i < L::kKeysPerSlot; ++i) {
      float k[8];
      const int key = slot + i * L::kSlots;
      unpack8(*reinterpret_cast<const uint4*>(tiles + tile_offset<D>(stage, 0, key, chunk)), k,
              T());
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        float dot = 0.f;
        if (r < rows) {
#pragma unroll
          for (int e = 0; e < 8; ++e) dot = fmaf(q[r][e], k[e], dot);
        }
        s[i][r] = dot;
      }
    }
#pragma unroll
    for (int i = 0; i < L::kKeysPerSlot; ++i) {
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        if (r < rows) {
#pragma unroll
          for (int offset = 1; offset < L::kChunks; offset *= 2) {
            s[i][r] += warp_xor(s[i][r], offset);
          }
        }
      }
    }

    // Online softmax. The running max is shared by the warp's slots (so their sums and outputs
    // add directly at the end); the sum and output stay per slot until then.
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r < rows) {
        const int row_pos = first_pos + r / group;
        float tile_max = kNegInf;
#pragma unroll
        for (int i = 0; i < L::kKeysPerSlot; ++i) {
          const int pos = tile_pos + slot + i * L::kSlots;
          if (pos >= k_end || pos > row_pos) s[i][r] = kNegInf;
          tile_max = fmaxf(tile_max, s[i][r]);
        }
#pragma unroll
        for (int offset = L::kChunks; offset < 32; offset *= 2) {
          tile_max = fmaxf(tile_max, warp_xor(tile_max, offset));
        }
        const float new_max = fmaxf(row_max[r], tile_max);
        // A row that has seen no visible key keeps weight 0 (and avoids -inf - -inf = NaN).
        const bool none_visible = new_max == kNegInf;
        const float alpha = none_visible ? 1.f : exp2f(row_max[r] - new_max);
        row_max[r] = new_max;
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < L::kKeysPerSlot; ++i) {
          s[i][r] = none_visible ? 0.f : exp2f(s[i][r] - new_max);
          sum += s[i][r];
        }
        row_sum[r] = row_sum[r] * alpha + sum;
        if (alpha != 1.f) {  // warp-uniform; once the max settles, most tiles skip this
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r][e] *= alpha;
        }
      }
    }

#pragma unroll
    for (int i = 0; i < L::kKeysPerSlot; ++i) {
      float v[8];
      const int key = slot + i * L::kSlots;
      unpack8(*reinterpret_cast<const uint4*>(tiles + tile_offset<D>(stage, 1, key, chunk)), v,
              T());
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        if (r < rows) {
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(s[i][r], v[e], acc[r][e]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Merge the warp's slots: one shared max per row, so plain sums.
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    if (r < rows) {
#pragma unroll
      for (int offset = L::kChunks; offset < 32; offset *= 2) {
        row_sum[r] += warp_xor(row_sum[r], offset);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][e] += warp_xor(acc[r][e], offset);
      }
    }
  }

  // Merge the warps through shared memory. The buffer aliases the K/V tiles, which other warps
  // may still be reading: barrier first.
  __syncthreads();
  float* reduce = reinterpret_cast<float*>(smem);  // [kWarps][kMaxRows][D]
  if (lane < L::kChunks) {
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r < rows) {
#pragma unroll
        for (int e = 0; e < 8; ++e) reduce[(warp * kMaxRows + r) * D + chunk * 8 + e] = acc[r][e];
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      warp_max[warp][r] = row_max[r];
      warp_sum[warp][r] = row_sum[r];
    }
  }
  __syncthreads();
  finish_item<T, D>(p, item, kv_head, group, reduce, &warp_max[0][0], &warp_sum[0][0], kWarps,
                    kMaxRows);
}

}  // namespace simt
}  // namespace kvl
