// One warp multiplies 16x16 matrices through ldmatrix and mma.sync exactly as the attention
// kernel does (K as the B operand without transpose, V with .trans). Tests run it on the GPU
// and under the host emulation against torch's matmul: passing on both shows the emulator's
// fragment layouts are the hardware's.
#include "mma.cuh"

namespace kvl {

// c_kt = a @ b^T (b given as [n][k], like K rows) and c_v = a @ v (v given as [k][n], like V
// rows); a, b, v are 16x16 row-major, c_kt and c_v 16x16 fp32. Shared memory: 3 x 512 bytes.
template <typename T>
__global__ void __launch_bounds__(32) selftest_mma_kernel(const T* a, const T* b, const T* v,
                                                          float* c_kt, float* c_v) {
  KVL_DYNAMIC_SMEM(smem);
  T* tiles = reinterpret_cast<T*>(smem);  // a, b, v: 16 rows of 16 elements (two chunks)
  const int lane = threadIdx.x;
  for (int i = lane; i < 3 * 32; i += 32) {  // 32 chunks of 16 bytes per matrix
    const T* src = i < 32 ? a : i < 64 ? b : v;
    reinterpret_cast<uint4*>(tiles)[i] = load_global_16(src + (i % 32) * 8);
  }
  __syncwarp();
  const T* sa = tiles;
  const T* sb = tiles + 256;
  const T* sv = tiles + 512;
  // A: matrices (rows 0-7, cols 0-7), (rows 8-15, 0-7), (rows 0-7, 8-15), (rows 8-15, 8-15).
  uint32_t fa[4];
  ldmatrix_x4(fa, sa + ((lane & 7) + ((lane >> 3) & 1) * 8) * 16 + (lane >> 4) * 8);
  // B = b^T: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
  uint32_t fb[4];
  ldmatrix_x4(fb, sb + ((lane & 7) + (lane >> 4) * 8) * 16 + ((lane >> 3) & 1) * 8);
  // B = v: transposed matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15).
  uint32_t fv[4];
  ldmatrix_x4_trans(fv, sv + ((lane & 7) + ((lane >> 3) & 1) * 8) * 16 + (lane >> 4) * 8);
  float kt[2][4] = {};
  float vv[2][4] = {};
  for (int n = 0; n < 2; ++n) {
    mma_16816(kt[n], fa, fb[2 * n], fb[2 * n + 1], T());
    mma_16816(vv[n], fa, fv[2 * n], fv[2 * n + 1], T());
  }
  const int g = lane / 4;
  const int t = lane % 4;
  for (int n = 0; n < 2; ++n) {
    for (int i = 0; i < 4; ++i) {
      const int at = (g + 8 * (i / 2)) * 16 + 8 * n + 2 * t + i % 2;
      store_global(c_kt + at, kt[n][i]);
      store_global(c_v + at, vv[n][i]);
    }
  }
}

}  // namespace kvl

extern "C" int kvl_selftest_mma(int dtype, const void* a, const void* b, const void* v,
                                float* c_kt, float* c_v, cudaStream_t stream) {
#ifdef KVL_HOST_EMULATION
  kvl::emu::BufferScope buffers(
      {{a, 512}, {b, 512}, {v, 512}, {c_kt, 16 * 16 * 4}, {c_v, 16 * 16 * 4}});
#endif
  auto run = [&](auto type) {
    using T = decltype(type);
    auto kernel = kvl::selftest_mma_kernel<T>;
    KVL_LAUNCH(kernel, dim3(1), dim3(32), 3 * 512, stream, static_cast<const T*>(a),
               static_cast<const T*>(b), static_cast<const T*>(v), c_kt, c_v);
    return static_cast<int>(cudaGetLastError());
  };
  switch (dtype) {
    case kvl::kFloat16: return run(__half());
    case kvl::kBFloat16: return run(__nv_bfloat16());
    default: return -1;
  }
}
