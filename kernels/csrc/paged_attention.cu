// Host entry points of paged attention (extern "C", called through ctypes by kernels/library.py):
// the planner that builds a step's work list on the device, and one launch per layer of the
// tensor-core kernel (GQA) or the CUDA-core kernel (MHA) over it, on fixed grids.
#include <type_traits>

#include "attention_plan.cuh"
#include "attention_simt.cuh"
#include "attention_tc.cuh"

namespace kvl {

enum Kernel : int { kTensorCores = 0, kCudaCores = 1 };  // kernels/cuda.py passes the same

template <int kKernel, typename T, int D, int BS>
struct Attention {
  using KernelFn = void (*)(const AttentionParams);
  static KernelFn kernel() {
    if constexpr (kKernel == kTensorCores) {
      return tc::attention_kernel<T, D, BS>;
    } else {
      return simt::attention_kernel<T, D, BS>;
    }
  }
  static constexpr int kThreads = kKernel == kTensorCores ? tc::kThreads : simt::kThreads;
  static constexpr int kSmemBytes =
      kKernel == kTensorCores ? tc::Layout<D>::kSmemBytes : simt::Layout<D>::kSmemBytes;

  // Opts the kernel in to its dynamic shared memory (above 48 KB a kernel must ask), once per
  // device. The flag lives in this instantiation: every kernel asks for itself.
  static cudaError_t allow_smem() {
    if (kSmemBytes <= 48 * 1024) return cudaSuccess;
    static unsigned long long configured_devices = 0;  // a benign race: the call is idempotent
    int device = 0;
    cudaError_t rc = cudaGetDevice(&device);
    if (rc != cudaSuccess) return rc;
    const unsigned long long bit = 1ull << (device % 64);
    if (configured_devices & bit) return cudaSuccess;
    auto k = kernel();
    rc = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (rc == cudaSuccess) configured_devices |= bit;
    return rc;
  }

  static int launch(const AttentionParams& p, int max_items, cudaStream_t stream) {
    const cudaError_t rc = allow_smem();
    if (rc != cudaSuccess) return static_cast<int>(rc);
    auto k = kernel();
    // One column per possible item, plus the last one that zeroes the padding rows.
    KVL_LAUNCH(k, dim3(max_items + 1, p.num_kv_heads), dim3(kThreads), kSmemBytes, stream, p);
    return static_cast<int>(cudaGetLastError());
  }

  static int ctas_per_sm(int* ctas) {
    const cudaError_t rc = allow_smem();
    if (rc != cudaSuccess) return static_cast<int>(rc);
    return static_cast<int>(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, kernel(), kThreads, kSmemBytes));
  }
};

// Calls fn(kernel, T{}, D, BS) (the integers as integral_constant) for the one instantiated
// kernel that matches; -1 when the combination is not built.
template <typename Fn>
int with_config(int kernel, int dtype, int head_dim, int block_size, Fn&& fn) {
  auto by_block = [&](auto which, auto type, auto dim) {
    switch (block_size) {
      case 16: return fn(which, type, dim, std::integral_constant<int, 16>());
      case 32: return fn(which, type, dim, std::integral_constant<int, 32>());
      default: return -1;
    }
  };
  auto by_dim = [&](auto which, auto type) {
    switch (head_dim) {
      case 64: return by_block(which, type, std::integral_constant<int, 64>());
      case 128: return by_block(which, type, std::integral_constant<int, 128>());
      default: return -1;
    }
  };
  auto by_dtype = [&](auto which) {
    switch (dtype) {
      case kFloat16: return by_dim(which, __half());
      case kBFloat16: return by_dim(which, __nv_bfloat16());
      default: return -1;
    }
  };
  switch (kernel) {
    case kTensorCores: return by_dtype(std::integral_constant<int, kTensorCores>());
    case kCudaCores: return by_dtype(std::integral_constant<int, kCudaCores>());
    default: return -1;
  }
}

template <typename Which, typename Type, typename Dim, typename Block>
using AttentionOf = Attention<Which::value, Type, Dim::value, Block::value>;

}  // namespace kvl

extern "C" int kvl_abi_version() { return 2; }

// The shapes kernels/cuda.py plans with (checked when the library loads).
extern "C" void kvl_attention_limits(int* tc_rows, int* tc_split_rows, int* simt_rows,
                                     int* chunk_align) {
  *tc_rows = kvl::tc::kMaxRows;
  *tc_split_rows = kvl::tc::kWarpRows;
  *simt_rows = kvl::simt::kMaxRows;
  *chunk_align = kvl::kChunkAlign;
}

extern "C" const char* kvl_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

// How many attention CTAs fit on one SM, for the planner's cost model.
extern "C" int kvl_attention_ctas_per_sm(int kernel, int dtype, int head_dim, int block_size,
                                         int* ctas) {
  return kvl::with_config(kernel, dtype, head_dim, block_size, [&](auto w, auto t, auto d, auto b) {
    return kvl::AttentionOf<decltype(w), decltype(t), decltype(d), decltype(b)>::ctas_per_sm(ctas);
  });
}

// Builds the step's work list (one CTA). tiles is int4 scratch [max_tiles], items WorkItem
// [max_items]; see attention_plan.cuh.
extern "C" int kvl_attention_plan(const int* seq_lens, const int* query_start_loc, int num_seqs,
                                  int num_tokens, int q_tile, int group, int slot_rows,
                                  int num_kv_heads, int cta_slots, int max_items, int max_slots,
                                  int max_tiles, void* tiles, void* items, int* num_items,
                                  cudaStream_t stream) {
  kvl::PlanParams p;
  p.seq_lens = seq_lens;
  p.query_start_loc = query_start_loc;
  p.num_seqs = num_seqs;
  p.num_tokens = num_tokens;
  p.q_tile = q_tile;
  p.group = group;
  p.slot_rows = slot_rows;
  p.num_kv_heads = num_kv_heads;
  p.cta_slots = cta_slots;
  p.max_items = max_items;
  p.max_slots = max_slots;
  p.max_tiles = max_tiles;
  p.tiles = static_cast<int4*>(tiles);
  p.items = static_cast<kvl::WorkItem*>(items);
  p.num_items = num_items;
#ifdef KVL_HOST_EMULATION
  kvl::emu::BufferScope buffers({
      {seq_lens, num_seqs * 4},
      {query_start_loc, (num_seqs + 1) * 4},
      {tiles, static_cast<int64_t>(max_tiles) * 16},
      {items, static_cast<int64_t>(max_items) * static_cast<int64_t>(sizeof(kvl::WorkItem))},
      {num_items, 4},
  });
#endif
  auto kernel = kvl::attention_plan_kernel;
  KVL_LAUNCH(kernel, dim3(1), dim3(kvl::kPlanThreads), 0, stream, p);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int kvl_paged_attention(int kernel, int dtype, int head_dim, int block_size,
                                   const void* query, int64_t q_stride, const void* key_cache,
                                   const void* value_cache, int64_t num_blocks,
                                   const int* block_tables, int bt_stride, const int* seq_lens,
                                   const int* query_start_loc, const void* items,
                                   const int* num_items, int max_items, void* out,
                                   float* partial_out, void* partial_ml, int* counters,
                                   int max_slots, int slot_rows, int max_tiles, int num_seqs,
                                   int num_tokens, int num_heads, int num_kv_heads, float scale,
                                   cudaStream_t stream) {
  if (num_tokens == 0) return 0;
  kvl::AttentionParams p;
  p.query = query;
  p.key_cache = key_cache;
  p.value_cache = value_cache;
  p.block_tables = block_tables;
  p.seq_lens = seq_lens;
  p.query_start_loc = query_start_loc;
  p.items = static_cast<const kvl::WorkItem*>(items);
  p.num_items = num_items;
  p.out = out;
  p.partial_out = partial_out;
  p.partial_ml = static_cast<float2*>(partial_ml);
  p.counters = counters;
  p.q_stride = q_stride;
  p.bt_stride = bt_stride;
  p.num_seqs = num_seqs;
  p.num_tokens = num_tokens;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.slot_rows = slot_rows;
  p.scale_log2 = scale * 1.4426950408889634f;
#ifdef KVL_HOST_EMULATION
  // Out-of-bounds global accesses abort the emulated run with the offending address.
  const int64_t elem = 2;
  const int64_t rows = static_cast<int64_t>(num_tokens) * num_heads;
  const int64_t slot_rows_all = static_cast<int64_t>(max_slots) * num_kv_heads * slot_rows;
  kvl::emu::BufferScope buffers({
      {query, ((num_tokens - 1) * q_stride + num_heads * head_dim) * elem},
      {key_cache, num_blocks * num_kv_heads * block_size * head_dim * elem},
      {value_cache, num_blocks * num_kv_heads * block_size * head_dim * elem},
      {block_tables, static_cast<int64_t>(num_seqs) * bt_stride * 4},
      {seq_lens, num_seqs * 4},
      {query_start_loc, (num_seqs + 1) * 4},
      {items, static_cast<int64_t>(max_items) * static_cast<int64_t>(sizeof(kvl::WorkItem))},
      {num_items, 4},
      {out, rows * head_dim * elem},
      {partial_out, slot_rows_all * head_dim * 4},
      {partial_ml, slot_rows_all * 8},
      {counters, static_cast<int64_t>(max_tiles) * num_kv_heads * 4},
  });
#else
  (void)num_blocks;
  (void)max_slots;
  (void)max_tiles;
#endif
  return kvl::with_config(kernel, dtype, head_dim, block_size, [&](auto w, auto t, auto d, auto b) {
    return kvl::AttentionOf<decltype(w), decltype(t), decltype(d), decltype(b)>::launch(
        p, max_items, stream);
  });
}
