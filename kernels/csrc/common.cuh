// Shared pieces of the kvledger kernels: 16-byte vector conversions, cp.async, checked global
// memory access, and the launch macro. Under KVL_HOST_EMULATION the same kernel sources compile
// with a host C++ compiler and run on the CPU (see host_emulation.cuh).
#pragma once

#include <cstdint>
#include <cstring>

#ifdef KVL_HOST_EMULATION
#include "host_emulation.cuh"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

// Launch a kernel (a function pointer variable) with dynamic shared memory on a stream, and
// declare that memory inside the kernel; emulated builds run the kernel on the host.
#ifdef KVL_HOST_EMULATION
#define KVL_LAUNCH(kernel, grid, block, smem_bytes, stream, ...) \
  ::kvl::emu::launch(kernel, (grid), (block), (smem_bytes), [&] { kernel(__VA_ARGS__); })
#define KVL_DYNAMIC_SMEM(name) unsigned char* name = ::kvl::emu::dynamic_smem()
#else
#define KVL_LAUNCH(kernel, grid, block, smem_bytes, stream, ...) \
  kernel<<<(grid), (block), (smem_bytes), (stream)>>>(__VA_ARGS__)
#define KVL_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace kvl {

// dtype codes; kernels/cuda.py passes the same numbers.
enum DType : int { kFloat16 = 0, kBFloat16 = 1 };

// ---- 8 x 16-bit values <-> float[8] (one 16-byte vector) ---------------------------------

// memcpy rather than a pointer cast: well-defined type punning, compiled to register moves.
__device__ __forceinline__ void unpack8(const uint4& raw, float (&out)[8], __half) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 pair;
    memcpy(&pair, reinterpret_cast<const char*>(&raw) + 4 * i, 4);
    const float2 f = __half22float2(pair);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void unpack8(const uint4& raw, float (&out)[8], __nv_bfloat16) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 pair;
    memcpy(&pair, reinterpret_cast<const char*>(&raw) + 4 * i, 4);
    const float2 f = __bfloat1622float2(pair);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ __half from_float(float x, __half) { return __float2half_rn(x); }
__device__ __forceinline__ __nv_bfloat16 from_float(float x, __nv_bfloat16) {
  return __float2bfloat16_rn(x);
}

// ---- global memory: bounds-checked in emulation, read-only cache on the GPU ----------------

template <typename T>
__device__ __forceinline__ T load_global(const T* ptr) {
#ifdef KVL_HOST_EMULATION
  emu::check_global(ptr, sizeof(T), "load");
  return *ptr;
#else
  return __ldg(ptr);
#endif
}

__device__ __forceinline__ uint4 load_global_16(const void* ptr) {
#ifdef KVL_HOST_EMULATION
  emu::check_global(ptr, 16, "load");
  emu::check_aligned(ptr, 16, "load");
#endif
  return *reinterpret_cast<const uint4*>(ptr);
}

// A load of data other CTAs of this launch wrote (split partials): through L2, never the
// read-only path that __ldg takes, whose cache is not coherent within a kernel.
template <typename T>
__device__ __forceinline__ T load_coherent(const T* ptr) {
#ifdef KVL_HOST_EMULATION
  emu::check_global(ptr, sizeof(T), "load");
  return *ptr;
#else
  return __ldcg(ptr);
#endif
}

__device__ __forceinline__ int atomic_add_global(int* ptr, int value) {
#ifdef KVL_HOST_EMULATION
  emu::check_global(ptr, sizeof(int), "atomic");  // CTAs run one at a time: a plain add is atomic
  const int old = *ptr;
  *ptr = old + value;
  return old;
#else
  return atomicAdd(ptr, value);
#endif
}

// Orders this thread's global writes before its later ones as seen by other CTAs.
__device__ __forceinline__ void thread_fence() {
#ifndef KVL_HOST_EMULATION
  __threadfence();
#endif
}

template <typename T>
__device__ __forceinline__ void store_global(T* ptr, const T& value) {
#ifdef KVL_HOST_EMULATION
  emu::check_global(ptr, sizeof(T), "store");
  emu::check_aligned(ptr, alignof(T), "store");
#endif
  *ptr = value;
}

// ---- cp.async (sm_80+): 16-byte global -> shared copies in commit groups --------------------

// Copies src_bytes (0 or 16) and zero-fills the rest of the 16 bytes; with 0 nothing is read.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes) {
#ifdef KVL_HOST_EMULATION
  emu::cp_async(smem_dst, gmem_src, 16, src_bytes);
#else
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(src_bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef KVL_HOST_EMULATION
  emu::cp_async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most `pending` of this thread's most recent groups are still in flight.
template <int pending>
__device__ __forceinline__ void cp_async_wait() {
#ifdef KVL_HOST_EMULATION
  emu::cp_async_wait(pending);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");
#endif
}

__device__ __forceinline__ float warp_xor(float value, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, value, lane_mask);
}

__device__ __forceinline__ int warp_xor_int(int value, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, value, lane_mask);
}

}  // namespace kvl
