// The tensor-core path's warp-collective instructions, emulated lane by lane (included by
// host_emulation.cuh). Every lane publishes what it brings (a row address, or its A and B
// fragment registers), the warp meets, and each lane computes exactly the elements the PTX ISA
// assigns to it (the layouts in mma.cuh); the warp meets again before anyone goes on, as the
// .sync.aligned instructions do. A kernel that mixes up fragment layouts, forgets .trans, or
// reads a shared-memory row nobody wrote gets wrong numbers (or NaN) here as on the GPU.
#pragma once

namespace kvl::emu {

enum WarpOperation : int { kLdmatrix = 1, kLdmatrixTrans, kMmaBf16, kMmaF16 };

// Publishes this lane's operands and waits for the whole warp; the table stays valid until the
// caller's matching leave_collective().
inline const uint32_t (*enter_collective(int operation, const uint32_t* words, int count))[6] {
  WarpState& w = my_warp();
  const int lane = self().linear % 32;
  std::memcpy(w.operands[lane], words, count * sizeof(uint32_t));
  w.operation[lane] = operation;
  syncwarp();
  for (int l = 0; l < 32; ++l) {
    if (w.operation[l] != operation) fail("lanes of a warp run different ldmatrix/mma (divergence)");
  }
  return w.operands;
}

inline void leave_collective() { syncwarp(); }

inline const char* published_address(const uint32_t (*table)[6], int lane) {
  const char* address;
  std::memcpy(&address, table[lane], sizeof(address));
  return address;
}

inline void check_shared_row(const void* row) {
  const State& s = state();
  const char* p = static_cast<const char*>(row);
  const char* begin = reinterpret_cast<const char*>(s.dynamic_smem.data());
  const char* end = begin + s.dynamic_smem.size() * sizeof(uint4);
  if (p < begin || p + 16 > end) fail("ldmatrix row outside the dynamic shared memory");
  check_aligned(row, 16, "ldmatrix row");
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16
inline void ldmatrix(uint32_t (&r)[4], const void* row, bool trans) {
  check_shared_row(row);
  uint32_t words[2];
  std::memcpy(words, &row, sizeof(row));
  const auto table = enter_collective(trans ? kLdmatrixTrans : kLdmatrix, words, 2);
  const int lane = self().linear % 32;
  uint32_t result[4];
  for (int m = 0; m < 4; ++m) {
    if (!trans) {  // row lane/4 of matrix m, elements 2(lane%4) and 2(lane%4)+1
      std::memcpy(&result[m], published_address(table, 8 * m + lane / 4) + 4 * (lane % 4), 4);
    } else {  // column lane/4 of matrix m, rows 2(lane%4) and 2(lane%4)+1
      uint16_t lo, hi;
      std::memcpy(&lo, published_address(table, 8 * m + 2 * (lane % 4)) + 2 * (lane / 4), 2);
      std::memcpy(&hi, published_address(table, 8 * m + 2 * (lane % 4) + 1) + 2 * (lane / 4), 2);
      result[m] = lo | static_cast<uint32_t>(hi) << 16;
    }
  }
  leave_collective();
  std::memcpy(r, result, sizeof(result));
}

inline double element_value(uint32_t word, int half, bool bf16) {
  const uint16_t bits = static_cast<uint16_t>(word >> (16 * half));
  if (bf16) {
    const uint32_t widened = static_cast<uint32_t>(bits) << 16;
    float value;
    std::memcpy(&value, &widened, 4);
    return value;
  }
  __half h;
  std::memcpy(&h, &bits, 2);
  return __half2float(h);
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32, D = A * B + C in place.
// Products of 16-bit values are exact in double; the sum is rounded to fp32 once.
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                      bool bf16) {
  const uint32_t words[6] = {a[0], a[1], a[2], a[3], b0, b1};
  const auto table = enter_collective(bf16 ? kMmaBf16 : kMmaF16, words, 6);
  auto A = [&](int row, int col) {  // owned by lane 4 * (row % 8) + (col % 8) / 2
    const int reg = row / 8 + 2 * (col / 8);
    return element_value(table[4 * (row % 8) + (col % 8) / 2][reg], col % 2, bf16);
  };
  auto B = [&](int k, int n) {  // owned by lane 4 * n + (k % 8) / 2, register b[k / 8]
    return element_value(table[4 * n + (k % 8) / 2][4 + k / 8], k % 2, bf16);
  };
  const int lane = self().linear % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  float result[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2);
    const int col = 2 * t + i % 2;
    double sum = d[i];
    for (int k = 0; k < 16; ++k) sum += A(row, k) * B(k, col);
    result[i] = static_cast<float>(sum);
  }
  leave_collective();
  std::memcpy(d, result, sizeof(result));
}

}  // namespace kvl::emu
