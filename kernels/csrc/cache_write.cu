// reshape_and_cache: scatter each new token's K and V row into its slot of the NHD cache.
// In NHD ([num_blocks, block_size, kv_heads, head_dim]) slot block_id * block_size + offset is
// row `slot` of the cache, so the write is a row copy and independent of dtype and block size.
#include "common.cuh"

namespace kvl {

constexpr int kCacheWriteThreads = 128;

// One CTA per token; threads stride over the row's 16-byte vectors. Strides are in vectors.
__global__ void __launch_bounds__(kCacheWriteThreads)
    reshape_and_cache_kernel(const uint4* __restrict__ key, const uint4* __restrict__ value,
                             uint4* __restrict__ key_cache, uint4* __restrict__ value_cache,
                             const int64_t* __restrict__ slot_mapping, int64_t key_stride,
                             int64_t value_stride, int row_vectors) {
  const int64_t token = blockIdx.x;
  const int64_t slot = load_global(slot_mapping + token);
  if (slot < 0) return;  // padding token
  const uint4* key_row = key + token * key_stride;
  const uint4* value_row = value + token * value_stride;
  uint4* key_dst = key_cache + slot * row_vectors;
  uint4* value_dst = value_cache + slot * row_vectors;
  for (int i = threadIdx.x; i < row_vectors; i += kCacheWriteThreads) {
    store_global(key_dst + i, load_global_16(key_row + i));
    store_global(value_dst + i, load_global_16(value_row + i));
  }
}

}  // namespace kvl

// row_bytes and the strides are in bytes and must be multiples of 16 (checked in Python);
// cache_rows = num_blocks * block_size, used only by the emulated build's bounds checks.
extern "C" int kvl_reshape_and_cache(const void* key, const void* value, void* key_cache,
                                     void* value_cache, const int64_t* slot_mapping,
                                     int64_t num_tokens, int64_t key_stride_bytes,
                                     int64_t value_stride_bytes, int64_t row_bytes,
                                     int64_t cache_rows, cudaStream_t stream) {
  if (num_tokens == 0) return 0;
#ifdef KVL_HOST_EMULATION
  kvl::emu::BufferScope buffers({
      {key, (num_tokens - 1) * key_stride_bytes + row_bytes},
      {value, (num_tokens - 1) * value_stride_bytes + row_bytes},
      {key_cache, cache_rows * row_bytes},
      {value_cache, cache_rows * row_bytes},
      {slot_mapping, num_tokens * 8},
  });
#else
  (void)cache_rows;
#endif
  auto kernel = kvl::reshape_and_cache_kernel;
  KVL_LAUNCH(kernel, dim3(static_cast<unsigned>(num_tokens)), dim3(kvl::kCacheWriteThreads), 0,
             stream, static_cast<const uint4*>(key), static_cast<const uint4*>(value),
             static_cast<uint4*>(key_cache), static_cast<uint4*>(value_cache), slot_mapping,
             key_stride_bytes / 16, value_stride_bytes / 16, static_cast<int>(row_bytes / 16));
  return static_cast<int>(cudaGetLastError());
}
