// The work list of one step, built on the device in one CTA (FlashInfer's planner does the same
// on the host): each sequence's queries cut into query tiles, each tile's keys into chunks of a
// size chosen for the whole step from every sequence's own length. The attention grid is then
// fixed by what the host knows without a sync (token and sequence counts), which is what lets a
// CUDA graph capture a step; CTAs past the list's end leave at once.
#pragma once

#include "common.cuh"

namespace kvl {

struct WorkItem {  // one CTA's work (for each KV head: blockIdx.y)
  int seq;  // row of seq_lens and block_tables
  int q_begin;  // first query token (row of query and out) of the tile
  int n_tok;  // query tokens in the tile
  int first_pos;  // sequence position of the tile's first token
  int kv_begin;  // keys [kv_begin, kv_end); kv_begin is a multiple of kChunkAlign
  int kv_end;
  int tile;  // the tile's index: its merge counter is counters[tile * num_kv_heads + kv_head]
  int num_chunks;  // items of this tile (1: the item writes `out` itself)
  int chunk;  // this item's place among them
  int first_slot;  // partial-result slot of the tile's chunk 0 (when num_chunks > 1)
  int unused[2];
};
static_assert(sizeof(WorkItem) == 48, "kernels/cuda.py allocates 12 ints per item");

constexpr int kPlanThreads = 256;
constexpr int kPlanWarps = kPlanThreads / 32;
constexpr int kChunkAlign = 64;  // chunk sizes are multiples of every kernel's keys per stage
// Candidate chunk sizes: kChunkAlign * {1, 2, 3, 4, 6, 8, 12, ...} (two per octave), then "no
// split" (one chunk per tile).
constexpr int kSplitCandidates = 30;
constexpr int kCandidates = kSplitCandidates + 1;
// Cost model, in keys one CTA streams in the same time: a CTA's start-up (dependent loads,
// filling the pipeline), a split chunk's partial rows (written, then read by the merge), and a
// step whose tiles split at all (the merging CTAs' serial tail). A step's cost is its work over
// the CTA slots plus the idle part of its last wave of CTAs.
constexpr float kItemOverheadKeys = 64.f;
constexpr float kChunkOverheadKeys = 32.f;
constexpr float kSplitOverheadKeys = 128.f;

__device__ __forceinline__ int candidate_chunk(int k) {  // kChunkAlign * 1, 2, 3, 4, 6, 8, 12
  const int multiple = k == 0 ? 1 : k % 2 == 1 ? 1 << ((k + 1) / 2) : 3 << (k / 2 - 1);
  return kChunkAlign * multiple;
}

struct PlanParams {
  const int* seq_lens;
  const int* query_start_loc;
  int num_seqs, num_tokens;
  int q_tile;  // query tokens per tile
  int group;  // query heads per KV head: a tile has n_tok * group rows
  int slot_rows;  // rows a partial slot holds; tiles with more rows are never split
  int num_kv_heads;
  int cta_slots;  // CTAs the GPU runs at once (SMs x CTAs per SM)
  int max_items, max_slots, max_tiles;  // capacities of the buffers below
  int4* tiles;  // scratch [max_tiles]: (seq, q_begin, n_tok, first_pos)
  WorkItem* items;  // [max_items]
  int* num_items;  // [1]
};

// Exclusive prefix sum of one value per thread across the CTA; `total` gets the sum.
__device__ __forceinline__ int block_exclusive_scan(int value, int* scratch, int& total) {
  const int tid = threadIdx.x;
  scratch[tid] = value;
  __syncthreads();
  for (int offset = 1; offset < kPlanThreads; offset *= 2) {
    const int add = tid >= offset ? scratch[tid - offset] : 0;
    __syncthreads();
    scratch[tid] += add;
    __syncthreads();
  }
  const int inclusive = scratch[tid];
  total = scratch[kPlanThreads - 1];
  __syncthreads();
  return inclusive - value;
}

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Keys a tile's rows see (the last row sees first_pos + n_tok - 1 and all before it).
__device__ __forceinline__ int tile_extent(const int4& tile) { return max(0, tile.w + tile.z); }

__device__ __forceinline__ int chunks_of(const int4& tile, const PlanParams& p, int chunk) {
  const bool splittable = tile.z * p.group <= p.slot_rows;
  return splittable && chunk > 0 ? max(1, ceil_div(tile_extent(tile), chunk)) : 1;
}

__global__ void __launch_bounds__(kPlanThreads) attention_plan_kernel(const PlanParams p) {
  __shared__ int scan[kPlanThreads];
  __shared__ int warp_items[kCandidates][kPlanWarps];
  __shared__ int warp_slots[kCandidates][kPlanWarps];
  __shared__ int warp_max[2][kPlanWarps];  // longest splittable / unsplittable tile
  __shared__ float warp_keys[kPlanWarps];
  __shared__ int chosen_chunk;
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;

  // 1. Query tiles of every sequence, in sequence order (each thread a contiguous run).
  const int seqs_per_thread = ceil_div(p.num_seqs, kPlanThreads);
  const int seq_begin = min(p.num_seqs, tid * seqs_per_thread);
  const int seq_end = min(p.num_seqs, seq_begin + seqs_per_thread);
  auto q_len_of = [&](int seq) {  // a malformed entry (negative or past the tokens) gets none
    const int begin = load_global(p.query_start_loc + seq);
    const int end = min(load_global(p.query_start_loc + seq + 1), p.num_tokens);
    return begin >= 0 ? max(0, end - begin) : 0;
  };
  int my_tiles = 0;
  for (int seq = seq_begin; seq < seq_end; ++seq) my_tiles += ceil_div(q_len_of(seq), p.q_tile);
  int num_tiles = 0;
  int tile = block_exclusive_scan(my_tiles, scan, num_tiles);
  num_tiles = min(num_tiles, p.max_tiles);
  for (int seq = seq_begin; seq < seq_end; ++seq) {
    const int q_len = q_len_of(seq);
    const int q_begin = load_global(p.query_start_loc + seq);
    const int first_pos = load_global(p.seq_lens + seq) - q_len;
    for (int tok = 0; tok < q_len && tile < num_tiles; tok += p.q_tile, ++tile) {
      store_global(p.tiles + tile, make_int4(seq, q_begin + tok, min(p.q_tile, q_len - tok),
                                             first_pos + tok));
    }
  }
  __syncthreads();

  // 2. Items and partial slots of every candidate chunk size, and the keys of the step.
  int items[kCandidates] = {};
  int slots[kCandidates] = {};
  int longest[2] = {0, 0};
  float keys = 0.f;
  for (int t = tid; t < num_tiles; t += kPlanThreads) {
    const int4 info = load_global(p.tiles + t);
    const int extent = tile_extent(info);
    const bool splittable = info.z * p.group <= p.slot_rows;
    longest[splittable ? 0 : 1] = max(longest[splittable ? 0 : 1], extent);
    keys += static_cast<float>(extent);
#pragma unroll
    for (int k = 0; k < kCandidates; ++k) {
      const int chunks = chunks_of(info, p, k < kSplitCandidates ? candidate_chunk(k) : 0);
      items[k] += chunks;
      slots[k] += chunks > 1 ? chunks : 0;
    }
  }
#pragma unroll
  for (int k = 0; k < kCandidates; ++k) {
    for (int offset = 16; offset > 0; offset /= 2) {
      items[k] += warp_xor_int(items[k], offset);
      slots[k] += warp_xor_int(slots[k], offset);
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    longest[0] = max(longest[0], warp_xor_int(longest[0], offset));
    longest[1] = max(longest[1], warp_xor_int(longest[1], offset));
    keys += warp_xor(keys, offset);
  }
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < kCandidates; ++k) {
      warp_items[k][warp] = items[k];
      warp_slots[k][warp] = slots[k];
    }
    warp_max[0][warp] = longest[0];
    warp_max[1][warp] = longest[1];
    warp_keys[warp] = keys;
  }
  __syncthreads();

  // 3. The chunk size of least modelled time that fits the buffers (no split always fits).
  if (tid == 0) {
    int max_split = 0, max_whole = 0;
    float all_keys = 0.f;
    for (int w = 0; w < kPlanWarps; ++w) {
      max_split = max(max_split, warp_max[0][w]);
      max_whole = max(max_whole, warp_max[1][w]);
      all_keys += warp_keys[w];
    }
    float best_cost = 0.f;
    int best = kSplitCandidates;
    for (int k = kSplitCandidates; k >= 0; --k) {  // from no split down: ties keep fewer items
      int n_items = 0, n_slots = 0;
      for (int w = 0; w < kPlanWarps; ++w) {
        n_items += warp_items[k][w];
        n_slots += warp_slots[k][w];
      }
      if (n_items > p.max_items || n_slots > p.max_slots) continue;
      const int chunk = k < kSplitCandidates ? candidate_chunk(k) : max_split;
      // The work spread over the GPU's CTA slots, plus the idle share of the last wave of
      // CTAs (exact for equal items: ceil(waves) x the item); never less than the longest item.
      const float longest_item = static_cast<float>(max(max_whole, min(chunk, max_split))) +
                                 kItemOverheadKeys;
      const float slots = static_cast<float>(max(1, p.cta_slots));
      const float spread =
          (all_keys + n_items * kItemOverheadKeys + n_slots * kChunkOverheadKeys) *
          p.num_kv_heads / slots;
      const float waves = static_cast<float>(n_items) * p.num_kv_heads / slots;
      const float cost = fmaxf(longest_item, spread + longest_item * (ceilf(waves) - waves)) +
                         (n_slots > 0 ? kSplitOverheadKeys : 0.f);
      if (k == kSplitCandidates || cost < best_cost) {
        best_cost = cost;
        best = k;
      }
    }
    chosen_chunk = best < kSplitCandidates ? candidate_chunk(best) : 0;
  }
  __syncthreads();
  const int chunk = chosen_chunk;

  // 4. The items, tile by tile (each thread a contiguous run of tiles).
  const int tiles_per_thread = ceil_div(num_tiles, kPlanThreads);
  const int tile_begin = min(num_tiles, tid * tiles_per_thread);
  const int tile_end = min(num_tiles, tile_begin + tiles_per_thread);
  int my_items = 0, my_slots = 0;
  for (int t = tile_begin; t < tile_end; ++t) {
    const int chunks = chunks_of(load_global(p.tiles + t), p, chunk);
    my_items += chunks;
    my_slots += chunks > 1 ? chunks : 0;
  }
  int total_items = 0, total_slots = 0;
  int item = block_exclusive_scan(my_items, scan, total_items);
  int slot = block_exclusive_scan(my_slots, scan, total_slots);
  for (int t = tile_begin; t < tile_end; ++t) {
    const int4 info = load_global(p.tiles + t);
    const int chunks = chunks_of(info, p, chunk);
    const int extent = tile_extent(info);
    const int size = chunks > 1 ? chunk : max(extent, 1);
    for (int c = 0; c < chunks; ++c, ++item) {
      WorkItem w;
      w.seq = info.x;
      w.q_begin = info.y;
      w.n_tok = info.z;
      w.first_pos = info.w;
      w.kv_begin = c * size;
      w.kv_end = min(extent, (c + 1) * size);
      w.tile = t;
      w.num_chunks = chunks;
      w.chunk = c;
      w.first_slot = chunks > 1 ? slot : -1;
      w.unused[0] = w.unused[1] = 0;
      store_global(p.items + item, w);
    }
    slot += chunks > 1 ? chunks : 0;
  }
  if (tid == 0) store_global(p.num_items, total_items);
}

}  // namespace kvl
