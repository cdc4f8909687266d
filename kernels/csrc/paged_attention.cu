// Host entry points of paged attention (extern "C", called through ctypes by kernels/cuda.py):
// pick the instantiated kernel for (dtype, head_dim, block_size), opt it in to its shared
// memory, launch it and, when the keys were split, the reduce.
#include <type_traits>

#include "paged_attention.cuh"
#include "split_reduce.cuh"

namespace kvl {

// Opts paged_attention_kernel<T, D, BS> in to its dynamic shared memory (above 48 KB a kernel
// must ask), once per device. The flag lives in this instantiation: every kernel asks for itself.
template <typename T, int D, int BS>
cudaError_t allow_attention_smem() {
  constexpr int smem_bytes = Layout<D>::kSmemBytes;
  if (smem_bytes <= 48 * 1024) return cudaSuccess;
  static unsigned long long configured_devices = 0;  // a benign race: the call is idempotent
  int device = 0;
  cudaError_t rc = cudaGetDevice(&device);
  if (rc != cudaSuccess) return rc;
  const unsigned long long bit = 1ull << (device % 64);
  if (configured_devices & bit) return cudaSuccess;
  rc = cudaFuncSetAttribute(paged_attention_kernel<T, D, BS>,
                            cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (rc == cudaSuccess) configured_devices |= bit;
  return rc;
}

template <typename T, int D, int BS>
int launch_attention(const AttentionParams& p, cudaStream_t stream) {
  const dim3 grid(p.num_seqs * p.q_tiles_per_seq, p.num_kv_heads, p.num_splits);
  auto kernel = paged_attention_kernel<T, D, BS>;
  const int smem_bytes = Layout<D>::kSmemBytes;
  const cudaError_t rc = allow_attention_smem<T, D, BS>();
  if (rc != cudaSuccess) return static_cast<int>(rc);
  if (p.num_splits > kMaxSplits) return -1;
  KVL_LAUNCH(kernel, grid, dim3(kThreads), smem_bytes, stream, p);
  if (p.num_splits > 1) {
    auto reduce = split_reduce_kernel<T>;
    KVL_LAUNCH(reduce, dim3(p.num_tokens, p.num_heads), dim3(D), 0, stream, p.partial_out,
               p.partial_ml, static_cast<T*>(p.out), p.query_start_loc, p.num_seqs,
               p.num_splits, p.num_tokens, p.num_heads, D);
  }
  return static_cast<int>(cudaGetLastError());
}

// Calls fn(T{}, D, BS) (the last two as integral_constant) for the one instantiated kernel
// that matches; -1 when the combination is not built.
template <typename Fn>
int with_config(int dtype, int head_dim, int block_size, Fn&& fn) {
  auto by_block = [&](auto type, auto dim) {
    switch (block_size) {
      case 16: return fn(type, dim, std::integral_constant<int, 16>());
      case 32: return fn(type, dim, std::integral_constant<int, 32>());
      default: return -1;
    }
  };
  auto by_dim = [&](auto type) {
    switch (head_dim) {
      case 64: return by_block(type, std::integral_constant<int, 64>());
      case 128: return by_block(type, std::integral_constant<int, 128>());
      default: return -1;
    }
  };
  switch (dtype) {
    case kFloat16: return by_dim(__half());
    case kBFloat16: return by_dim(__nv_bfloat16());
    default: return -1;
  }
}

}  // namespace kvl

extern "C" int kvl_abi_version() { return 1; }

// The kernel's shape limits, which kernels/cuda.py plans launches with (checked at load).
extern "C" void kvl_attention_limits(int* max_rows, int* tile_keys, int* max_splits) {
  *max_rows = kvl::kMaxRows;
  *tile_keys = kvl::kTileKeys;
  *max_splits = kvl::kMaxSplits;
}

extern "C" const char* kvl_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

// How many attention CTAs fit on one SM, for the split heuristic in kernels/cuda.py.
extern "C" int kvl_attention_ctas_per_sm(int dtype, int head_dim, int block_size, int* ctas) {
  return kvl::with_config(dtype, head_dim, block_size, [&](auto type, auto dim, auto block) {
    auto kernel = kvl::paged_attention_kernel<decltype(type), decltype(dim)::value,
                                              decltype(block)::value>;
    const int smem_bytes = kvl::Layout<decltype(dim)::value>::kSmemBytes;
    const cudaError_t rc = kvl::allow_attention_smem<decltype(type), decltype(dim)::value,
                                                     decltype(block)::value>();
    if (rc != cudaSuccess) return static_cast<int>(rc);
    return static_cast<int>(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, kernel, kvl::kThreads, smem_bytes));
  });
}

extern "C" int kvl_paged_attention(int dtype, int head_dim, int block_size, const void* query,
                                   int64_t q_stride, const void* key_cache,
                                   const void* value_cache, int64_t cache_rows,
                                   const int* block_tables, int bt_stride, const int* seq_lens,
                                   const int* query_start_loc, void* out, float* partial_out,
                                   void* partial_ml, int num_seqs, int num_tokens, int num_heads,
                                   int num_kv_heads, int q_tile, int q_tiles_per_seq,
                                   int num_splits, int split_keys, float scale,
                                   cudaStream_t stream) {
  if (num_seqs == 0 || num_tokens == 0) return 0;
  kvl::AttentionParams p;
  p.query = query;
  p.key_cache = key_cache;
  p.value_cache = value_cache;
  p.block_tables = block_tables;
  p.seq_lens = seq_lens;
  p.query_start_loc = query_start_loc;
  p.out = out;
  p.partial_out = partial_out;
  p.partial_ml = static_cast<float2*>(partial_ml);
  p.q_stride = q_stride;
  p.bt_stride = bt_stride;
  p.num_seqs = num_seqs;
  p.num_tokens = num_tokens;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.q_tile = q_tile;
  p.q_tiles_per_seq = q_tiles_per_seq;
  p.num_splits = num_splits;
  p.split_keys = split_keys;
  p.scale_log2 = scale * 1.4426950408889634f;
#ifdef KVL_HOST_EMULATION
  // Out-of-bounds global accesses abort the emulated run with the offending address.
  const int64_t elem = 2;
  const int64_t rows = static_cast<int64_t>(num_tokens) * num_heads;
  kvl::emu::BufferScope buffers({
      {query, ((num_tokens - 1) * q_stride + num_heads * head_dim) * elem},
      {key_cache, cache_rows * num_kv_heads * head_dim * elem},
      {value_cache, cache_rows * num_kv_heads * head_dim * elem},
      {block_tables, static_cast<int64_t>(num_seqs) * bt_stride * 4},
      {seq_lens, num_seqs * 4},
      {query_start_loc, (num_seqs + 1) * 4},
      {out, rows * head_dim * elem},
      {partial_out, num_splits > 1 ? num_splits * rows * head_dim * 4 : 0},
      {partial_ml, num_splits > 1 ? num_splits * rows * 8 : 0},
  });
#else
  (void)cache_rows;
#endif
  return kvl::with_config(dtype, head_dim, block_size, [&](auto type, auto dim, auto block) {
    return kvl::launch_attention<decltype(type), decltype(dim)::value, decltype(block)::value>(
        p, stream);
  });
}
