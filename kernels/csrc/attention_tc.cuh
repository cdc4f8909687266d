// Paged attention on tensor cores: the rows of a query tile (its tokens times the query heads of
// one GQA group) are the M side of mma.sync.m16n8k16, so S = Q K^T and O += P V are 16x8x16
// tiles and each K/V byte is loaded once for the whole group. A stage is 64 keys of K and V;
// each warp copies its 16 keys, one contiguous run of an HND page, with cp.async. Two modes, by
// the item's rows:
//   key-split (rows <= 16: decode, short extends): every warp computes all rows over its own 16
//     keys of each stage, and the four partial softmaxes merge at the end;
//   row-split (up to 64 rows: prefill): warp w computes rows 16w..16w+15 over all 64 keys.
// Full tiles run a loop without masks or predicated copies; the few boundary tiles a second one.
#pragma once

#include "attention_common.cuh"
#include "mma.cuh"

namespace kvl {
namespace tc {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kWarpRows = 16;  // rows of one mma tile
constexpr int kMaxRows = kWarps * kWarpRows;  // a row-split tile
constexpr int kTileKeys = 64;  // keys per pipeline stage
constexpr int kWarpKeys = kTileKeys / kWarps;  // keys each warp copies per stage

template <int D>
struct Layout {
  static constexpr int kChunks = D / 8;  // 16-byte chunks of a K or V row
  static constexpr int kStages = D >= 128 ? 3 : 4;  // 96 KB (64 KB at D 64): two CTAs per SM
  static constexpr int kTensorElems = kTileKeys * D;
  static constexpr int kStageElems = 2 * kTensorElems;  // K then V
  static constexpr int kCopies = kWarpKeys * kChunks / 32;  // per lane, per tensor and stage
  static constexpr int kSmemBytes = kStages * kStageElems * 2;
  static_assert(kSmemBytes >= kMaxRows * D * 4, "the epilogue's rows reuse the stages");
  static_assert(kChunks % 8 == 0, "swizzle within groups of 8 chunks");
};

template <int BS>
constexpr bool kPagesFitStages = kTileKeys % BS == 0 && BS % kWarpKeys == 0;

// Element offset of (key, chunk) in a [kTileKeys][D] tile: chunks XOR-swizzled by key, so the
// 8 rows one ldmatrix phase reads (same chunk, 8 consecutive keys) hit 8 different bank groups.
template <int D>
__device__ __forceinline__ int swizzled(int key, int chunk) {
  return key * D + ((chunk ^ (key & 7)) << 3);
}

template <typename T, int D, int BS, bool kKeySplit>
__device__ __forceinline__ void attend(const AttentionParams& p, const WorkItem& item,
                                       int kv_head, int group, T* tiles) {
  using L = Layout<D>;
  static_assert(kPagesFitStages<BS>, "a warp's 16 keys of a stage lie in one page");
  constexpr int kStages = L::kStages;
  constexpr int kKeys = kKeySplit ? kWarpKeys : kTileKeys;  // keys a warp computes per stage
  __shared__ float m_rows[kMaxRows];
  __shared__ float l_rows[kMaxRows];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int rows = item.n_tok * group;
  const int row0 = kKeySplit ? 0 : warp * kWarpRows;  // this warp's first row
  const int key0 = kKeySplit ? warp * kWarpKeys : 0;  // its first key within a stage
  const bool computes = kKeySplit || row0 < rows;  // row-split warps past the rows only copy

  // Q fragments of rows row0 + g and row0 + g + 8 (zero past the tile's rows).
  uint32_t qa[D / 16][4];
  int limit[2];  // the last key each of this thread's two rows sees
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + g + 8 * h;
    const int64_t token = item.q_begin + (r < rows ? r / group : 0);
    const T* q_row = static_cast<const T*>(p.query) + token * p.q_stride +
                     (kv_head * group + (r < rows ? r % group : 0)) * D;
    limit[h] = min(item.kv_end, item.first_pos + (r < rows ? r / group : 0) + 1) - 1;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      qa[kk][h] = r < rows ? load_pair(q_row + 16 * kk + 2 * t) : 0u;
      qa[kk][h + 2] = r < rows ? load_pair(q_row + 16 * kk + 8 + 2 * t) : 0u;
    }
  }

  const T* k_cache = static_cast<const T*>(p.key_cache);
  const T* v_cache = static_cast<const T*>(p.value_cache);
  const int* table = p.block_tables + static_cast<int64_t>(item.seq) * p.bt_stride;
  const int warp_key_in_page = (warp * kWarpKeys) % BS;  // kv_begin is a multiple of kTileKeys
  auto first_key = [&](int tile) { return item.kv_begin + tile * kTileKeys + warp * kWarpKeys; };
  auto fetch_block = [&](int tile) {  // the page of this warp's keys of `tile` (0: none)
    const int pos = first_key(tile);
    return pos < item.kv_end ? load_global(table + pos / BS) : 0;
  };
  // Copies this warp's 16 keys of `tile` (K and V), zero-filling keys past kv_end unless
  // `kFull` says there are none.
  auto issue = [&](int tile, int block, auto full) {
    constexpr bool kFull = decltype(full)::value;
    T* k_dst = tiles + (tile % kStages) * L::kStageElems;
    T* v_dst = k_dst + L::kTensorElems;
    const int64_t page = hnd_offset<D, BS>(block, p.num_kv_heads, kv_head, warp_key_in_page);
    const int valid_keys = item.kv_end - first_key(tile);
#pragma unroll
    for (int i = 0; i < L::kCopies; ++i) {
      const int c = lane + 32 * i;  // chunk c of the warp's contiguous 16-key run
      const int key = c / L::kChunks;
      const int at = swizzled<D>(warp * kWarpKeys + key, c % L::kChunks);
      const bool valid = kFull || key < valid_keys;
      cp_async_16(k_dst + at, valid ? k_cache + page + c * 8 : k_cache, valid ? 16 : 0);
      cp_async_16(v_dst + at, valid ? v_cache + page + c * 8 : v_cache, valid ? 16 : 0);
    }
    cp_async_commit();
  };

  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {kNegInf, kNegInf};  // running max of each row, in log2 units
  float l[2] = {0.f, 0.f};  // this thread's share of each row's softmax denominator

  auto compute = [&](int tile, auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    const T* ks = tiles + (tile % kStages) * L::kStageElems;
    const T* vs = ks + L::kTensorElems;
    float s[kKeys / 8][4];
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk += 2) {
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {  // B = K^T: keys are n, dims are k; no transpose
        uint32_t b[4];
        ldmatrix_x4(b, ks + swizzled<D>(key0 + 8 * n + (lane & 7), 2 * kk + (lane >> 3)));
        mma_16816(s[n], qa[kk], b[0], b[1], T());
        mma_16816(s[n], qa[kk + 1], b[2], b[3], T());
      }
    }
    // Online softmax over this stage's keys; a row's 8-key column pairs sit in 4 lanes.
    float tile_max[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (kMasked) {
          const int pos = item.kv_begin + tile * kTileKeys + key0 + 8 * n + 2 * t + (j & 1);
          if (pos > limit[j / 2]) s[n][j] = kNegInf;
        }
        tile_max[j / 2] = fmaxf(tile_max[j / 2], s[n][j]);
      }
    }
    float base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tile_max[h] = fmaxf(tile_max[h], warp_xor(tile_max[h], 1));
      tile_max[h] = fmaxf(tile_max[h], warp_xor(tile_max[h], 2));
      const float new_max = fmaxf(m[h], tile_max[h] * p.scale_log2);
      base[h] = new_max == kNegInf ? 0.f : new_max;  // no key seen yet: no (-inf) - (-inf)
      const float alpha = exp2f(m[h] - base[h]);
      m[h] = new_max;
      l[h] *= alpha;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][2 * h] *= alpha;
        o[n][2 * h + 1] *= alpha;
      }
    }
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s[n][j] = exp2f(fmaf(s[n][j], p.scale_log2, -base[j / 2]));
        l[j / 2] += s[n][j];
      }
    }
    // O += P V: P's A fragments are S's accumulators of two 8-key columns; V^T via .trans.
#pragma unroll
    for (int kb = 0; kb < kKeys / 16; ++kb) {
      const uint32_t pa[4] = {pack2(s[2 * kb][0], s[2 * kb][1], T()),
                              pack2(s[2 * kb][2], s[2 * kb][3], T()),
                              pack2(s[2 * kb + 1][0], s[2 * kb + 1][1], T()),
                              pack2(s[2 * kb + 1][2], s[2 * kb + 1][3], T())};
#pragma unroll
      for (int n = 0; n < D / 8; n += 2) {
        uint32_t b[4];
        const int key = key0 + 16 * kb + (lane & 7) + ((lane >> 3) & 1) * 8;
        ldmatrix_x4_trans(b, vs + swizzled<D>(key, n + (lane >> 4)));
        mma_16816(o[n], pa, b[0], b[1], T());
        mma_16816(o[n + 1], pa, b[2], b[3], T());
      }
    }
  };

  // Pipeline: stages 0..kStages-2 in flight before the loops; iteration `tile` waits for its
  // stage, then refills the one every warp finished reading in the previous iteration. One
  // commit group per iteration (empty past the end), so "all but the newest kStages-2" is `tile`.
  const int num_keys = max(0, item.kv_end - item.kv_begin);
  const int num_tiles = (num_keys + kTileKeys - 1) / kTileKeys;
  const int num_full = num_keys / kTileKeys;  // tiles with every key present
  // Tiles every row sees whole: before kv_end and before the first row's position.
  const int num_unmasked =
      max(0, min(item.kv_end, item.first_pos + 1) - item.kv_begin) / kTileKeys;
  const int num_hot = max(0, min(num_unmasked, num_full - (kStages - 1)));
#pragma unroll
  for (int tile = 0; tile < kStages - 1; ++tile) {
    if (tile < num_tiles) {
      issue(tile, fetch_block(tile), std::false_type());
    } else {
      cp_async_commit();
    }
  }
  int next_block = fetch_block(kStages - 1);
  int tile = 0;
#pragma unroll 1
  for (; tile < num_hot; ++tile) {  // the steady state: full tiles in and out, no masks
    cp_async_wait<kStages - 2>();
    __syncthreads();
    issue(tile + kStages - 1, next_block, std::true_type());
    next_block = fetch_block(tile + kStages);
    if (computes) compute(tile, std::false_type());
  }
#pragma unroll 1
  for (; tile < num_tiles; ++tile) {  // the boundary tiles
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (tile + kStages - 1 < num_tiles) {
      issue(tile + kStages - 1, next_block, std::false_type());
    } else {
      cp_async_commit();
    }
    next_block = fetch_block(tile + kStages);
    if (computes) compute(tile, std::true_type());
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the stages: the epilogue reuses them

  // Each warp's rows (key-split: rows 0..15 of source `warp`; row-split: its own 16 rows).
  float* o_rows = reinterpret_cast<float*>(tiles);
  const int source = kKeySplit ? warp : 0;
  const int row_stride = kKeySplit ? kWarpRows : kMaxRows;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += warp_xor(l[h], 1);
    l[h] += warp_xor(l[h], 2);
    const int r = source * row_stride + row0 + g + 8 * h;
    if (computes) {
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        float* dst = o_rows + r * D + 8 * n + 2 * t;
        dst[0] = o[n][2 * h];
        dst[1] = o[n][2 * h + 1];
      }
      if (t == 0) {
        m_rows[r] = m[h];
        l_rows[r] = l[h];
      }
    }
  }
  __syncthreads();
  finish_item<T, D>(p, item, kv_head, group, o_rows, m_rows, l_rows, kKeySplit ? kWarps : 1,
                    row_stride);
}

template <typename T, int D, int BS>
__global__ void __launch_bounds__(kThreads, 2) attention_kernel(const AttentionParams p) {
  KVL_DYNAMIC_SMEM(smem);  // Layout<D>::kSmemBytes
  const int kv_head = blockIdx.y;
  if (blockIdx.x == gridDim.x - 1) return zero_padding_rows<T, D>(p, kv_head);
  if (static_cast<int>(blockIdx.x) >= load_global(p.num_items)) return;  // past the work list
  const WorkItem item = load_item(p.items + blockIdx.x);
  const int group = p.num_heads / p.num_kv_heads;
  T* tiles = reinterpret_cast<T*>(smem);
  if (item.n_tok * group <= kWarpRows) {
    attend<T, D, BS, true>(p, item, kv_head, group, tiles);
  } else {
    attend<T, D, BS, false>(p, item, kv_head, group, tiles);
  }
}

}  // namespace tc
}  // namespace kvl
