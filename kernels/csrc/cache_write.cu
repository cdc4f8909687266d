// reshape_and_cache: scatter each new token's K and V rows into its slot of the HND cache
// ([num_blocks, num_kv_heads, block_size, head_dim]). Slot block_id * block_size + offset puts
// head h's row at ((block_id * num_kv_heads + h) * block_size + offset) * head_dim: one
// 16-byte-vector copy per head row, independent of dtype.
#include "common.cuh"

namespace kvl {

constexpr int kCacheWriteThreads = 128;

// One CTA per token; threads stride over the token's 16-byte vectors (all heads). Strides and
// sizes are in vectors.
__global__ void __launch_bounds__(kCacheWriteThreads)
    reshape_and_cache_kernel(const uint4* __restrict__ key, const uint4* __restrict__ value,
                             uint4* __restrict__ key_cache, uint4* __restrict__ value_cache,
                             const int64_t* __restrict__ slot_mapping, int64_t key_stride,
                             int64_t value_stride, int head_vectors, int num_kv_heads,
                             int block_size) {
  const int64_t token = blockIdx.x;
  const int64_t slot = load_global(slot_mapping + token);
  if (slot < 0) return;  // padding token
  const int64_t block = slot / block_size;
  const int offset = static_cast<int>(slot % block_size);
  const uint4* key_row = key + token * key_stride;
  const uint4* value_row = value + token * value_stride;
  for (int i = threadIdx.x; i < num_kv_heads * head_vectors; i += kCacheWriteThreads) {
    const int head = i / head_vectors;
    const int64_t dst = ((block * num_kv_heads + head) * block_size + offset) * head_vectors +
                        i % head_vectors;
    store_global(key_cache + dst, load_global_16(key_row + i));
    store_global(value_cache + dst, load_global_16(value_row + i));
  }
}

}  // namespace kvl

// head_bytes (one head's row) and the token strides are in bytes and must be multiples of 16
// (checked in Python); num_blocks is used only by the emulated build's bounds checks.
extern "C" int kvl_reshape_and_cache(const void* key, const void* value, void* key_cache,
                                     void* value_cache, const int64_t* slot_mapping,
                                     int64_t num_tokens, int64_t key_stride_bytes,
                                     int64_t value_stride_bytes, int64_t head_bytes,
                                     int num_kv_heads, int block_size, int64_t num_blocks,
                                     cudaStream_t stream) {
  if (num_tokens == 0) return 0;
  const int64_t row_bytes = head_bytes * num_kv_heads;
#ifdef KVL_HOST_EMULATION
  kvl::emu::BufferScope buffers({
      {key, (num_tokens - 1) * key_stride_bytes + row_bytes},
      {value, (num_tokens - 1) * value_stride_bytes + row_bytes},
      {key_cache, num_blocks * block_size * row_bytes},
      {value_cache, num_blocks * block_size * row_bytes},
      {slot_mapping, num_tokens * 8},
  });
#else
  (void)num_blocks;
#endif
  auto kernel = kvl::reshape_and_cache_kernel;
  KVL_LAUNCH(kernel, dim3(static_cast<unsigned>(num_tokens)), dim3(kvl::kCacheWriteThreads), 0,
             stream, static_cast<const uint4*>(key), static_cast<const uint4*>(value),
             static_cast<uint4*>(key_cache), static_cast<uint4*>(value_cache), slot_mapping,
             key_stride_bytes / 16, value_stride_bytes / 16, static_cast<int>(head_bytes / 16),
             num_kv_heads, block_size);
  return static_cast<int>(cudaGetLastError());
}
