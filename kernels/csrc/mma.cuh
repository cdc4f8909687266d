// Tensor-core building blocks (sm_80+): ldmatrix and mma.sync.m16n8k16 with fp32 accumulators.
//
// Fragment layouts are the PTX ISA's, lane = 4 * g + t (g = groupID, t = threadID_in_group);
// each 32-bit register holds two 16-bit elements, the lower-indexed one in the low half:
//   A 16x16 (row):  a[0] = A[g][2t..2t+1]    a[1] = A[g+8][2t..2t+1]
//                   a[2] = A[g][2t+8..2t+9]  a[3] = A[g+8][2t+8..2t+9]
//   B 16x8 (col):   b[0] = B[2t..2t+1][g]    b[1] = B[2t+8..2t+9][g]
//   C, D 16x8 f32:  c[0], c[1] = C[g][2t], C[g][2t+1]    c[2], c[3] = C[g+8][2t], C[g+8][2t+1]
// ldmatrix .x4: lanes 8i..8i+7 give the row addresses (16 bytes each) of matrix i, and register
// i of lane l receives row l/4, elements 2(l%4) and 2(l%4)+1; with .trans, elements
// [2(l%4)][l/4] and [2(l%4)+1][l/4] (a transposed 8x8 matrix). host_emulation_warp.cuh computes
// exactly these elements, so a kernel that mixes layouts up is wrong on the CPU too.
#pragma once

#include "common.cuh"

namespace kvl {

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
#ifdef KVL_HOST_EMULATION
  emu::ldmatrix(r, smem_row, false);
#else
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
#ifdef KVL_HOST_EMULATION
  emu::ldmatrix(r, smem_row, true);
#else
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
#endif
}

// d += a * b for one 16x8x16 tile (A and B in the element type, D in fp32).
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1, __nv_bfloat16) {
#ifdef KVL_HOST_EMULATION
  emu::mma_16816(d, a, b0, b1, true);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1, __half) {
#ifdef KVL_HOST_EMULATION
  emu::mma_16816(d, a, b0, b1, false);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Two floats rounded to the element type, `lo` in the low half (an A/B fragment register).
__device__ __forceinline__ uint32_t pack2(float lo, float hi, __nv_bfloat16) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  uint32_t bits;
  memcpy(&bits, &pair, 4);
  return bits;
}

__device__ __forceinline__ uint32_t pack2(float lo, float hi, __half) {
  const __half2 pair = __floats2half2_rn(lo, hi);
  uint32_t bits;
  memcpy(&bits, &pair, 4);
  return bits;
}

// Two consecutive 16-bit elements of global memory as one fragment register.
__device__ __forceinline__ uint32_t load_pair(const void* ptr) {
#ifdef KVL_HOST_EMULATION
  emu::check_global(ptr, 4, "load");
  emu::check_aligned(ptr, 4, "load");
#endif
  return *reinterpret_cast<const uint32_t*>(ptr);
}

}  // namespace kvl
