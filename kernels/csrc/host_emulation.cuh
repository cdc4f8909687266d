// Runs the kernels' CUDA C++ on the host, for tests on machines without a GPU: every CTA is a
// set of fibers (one per CUDA thread) switched at __syncthreads, __syncwarp and shuffles, with
// cp.async copies deferred to cp.async.wait_group and global accesses bounds-checked. Two
// schedules expose races: round-robin (threads advance barrier by barrier together) and greedy
// (the lowest runnable thread runs, so warps drift as far apart as barriers allow). The
// tensor-core instructions (ldmatrix, mma.sync) are in host_emulation_warp.cuh. Included by
// common.cuh only when KVL_HOST_EMULATION is defined; never part of the CUDA build.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <utility>
#include <vector>

// CUDA's host headers annotate functions for nvcc; for a host compiler they must be plain C++.
#undef __device__
#undef __global__
#undef __shared__
#undef __forceinline__
#undef __launch_bounds__
#undef __restrict__
#define __device__
#define __global__
#define __shared__ static  // CTAs run one at a time, so one static copy is the CTA's memory
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict

using std::max;
using std::min;

namespace kvl::emu {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

struct Pending {  // an issued cp.async not yet performed
  void* dst;
  const void* src;
  int bytes;
  int src_bytes;
  int group;
};

struct Fiber {
  void* sp = nullptr;
  Dim3 thread_idx;
  int linear = 0;
  bool done = false;
  int waiting = 0;  // 0: runnable, kBlockBarrier or kWarpBarrier
  unsigned wait_generation = 0;
  int shuffles = 0;  // parity picks the exchange buffer
  int committed_groups = 0;
  std::vector<Pending> pending;
};

struct WarpState {
  int arrived = 0;
  unsigned generation = 0;
  uint64_t exchange[2][32] = {};
  int lane_mask[2][32] = {};
  uint32_t operands[32][6] = {};  // ldmatrix / mma: what each lane brought (host_emulation_warp)
  int operation[32] = {};
};

struct Range {
  const void* begin;
  int64_t bytes;
};

struct Config {
  bool reverse_order = false;  // run threads (and CTAs) last to first
  bool eager_copies = false;  // perform cp.async at issue instead of at wait_group
  bool greedy = false;  // always resume the first runnable thread instead of round-robin
};

constexpr int kBlockBarrier = 1;
constexpr int kWarpBarrier = 2;

struct State {
  Config config;
  Dim3 block_idx, block_dim, grid_dim;
  std::vector<Fiber> fibers;
  std::vector<WarpState> warps;
  std::vector<char> stacks;
  std::vector<uint4> dynamic_smem;  // 16-byte aligned
  std::function<void()> body;
  int current = 0;
  int arrived = 0;
  unsigned generation = 0;
  void* scheduler_sp = nullptr;
  std::vector<Range> buffers;
  std::vector<std::pair<const void*, int>> smem_limits;  // kernel -> opted-in dynamic bytes
  bool in_fiber = false;
  bool failed = false;  // this launch hit an error: stop running it
  bool error_pending = false;  // not yet returned by cudaGetLastError()
  char error[256] = {};
};

inline State& state() {
  static State s;
  return s;
}

// The first error of a launch, reported as a CUDA error: cudaGetLastError() returns
// cudaErrorUnknown once and cudaGetErrorString() this text (so Python raises, not the process).
inline void record_error(const char* what) {
  State& s = state();
  if (s.failed) return;
  s.failed = true;
  char message[sizeof(s.error)];
  std::snprintf(message, sizeof(message), "kvl host emulation: %s (block %u,%u,%u thread %d)",
                what, s.block_idx.x, s.block_idx.y, s.block_idx.z,
                s.in_fiber ? s.fibers[s.current].linear : -1);
  std::memcpy(s.error, message, sizeof(message));
}

inline void kvl_emu_leave_fiber();

// Inside a kernel: record the error and abandon the launch (the fiber is never resumed; its
// stack holds nothing that needs destroying).
[[noreturn]] inline void fail(const char* what) {
  record_error(what);
  if (!state().in_fiber) std::abort();  // only kernel code calls fail()
  kvl_emu_leave_fiber();
  __builtin_unreachable();
}

// ---- context switch (x86-64 System V: callee-saved registers on the fiber's own stack) ------

extern "C" void kvl_emu_switch(void** save_sp, void* load_sp);
asm(R"(
.pushsection .text
.weak kvl_emu_switch
.type kvl_emu_switch,@function
kvl_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.popsection
)");

inline Fiber& self() { return state().fibers[state().current]; }

inline void yield() { kvl_emu_switch(&self().sp, state().scheduler_sp); }

inline void kvl_emu_leave_fiber() {
  for (;;) yield();  // the scheduler sees `failed` and never resumes this fiber
}

inline void fiber_main() {
  state().body();
  self().done = true;
  for (;;) yield();  // the scheduler never resumes a finished fiber
}

inline bool runnable(const Fiber& f) {
  const State& s = state();
  if (f.done) return false;
  if (f.waiting == kBlockBarrier) return s.generation != f.wait_generation;
  if (f.waiting == kWarpBarrier) return s.warps[f.linear / 32].generation != f.wait_generation;
  return true;
}

// Parks the calling thread until the barrier's generation moves past `generation`.
inline void wait_for(int barrier, unsigned generation) {
  Fiber& f = self();
  f.waiting = barrier;
  f.wait_generation = generation;
  yield();  // resumed only once runnable
  f.waiting = 0;
}

inline void resume(int t) {
  State& s = state();
  s.current = t;
  s.in_fiber = true;
  kvl_emu_switch(&s.scheduler_sp, s.fibers[t].sp);
  s.in_fiber = false;
}

constexpr size_t kStackBytes = 256 * 1024;

inline void run_block(Dim3 block_idx) {
  State& s = state();
  const int n = static_cast<int>(s.block_dim.x * s.block_dim.y * s.block_dim.z);
  if (n % 32 != 0) return record_error("block size must be a multiple of 32");
  s.block_idx = block_idx;
  s.fibers.assign(n, Fiber());
  s.warps.assign(n / 32, WarpState());
  s.stacks.resize(static_cast<size_t>(n) * kStackBytes);
  s.arrived = 0;
  // Garbage (all-ones bytes read as NaN) so a read of shared memory nobody wrote shows up.
  std::memset(s.dynamic_smem.data(), 0xff, s.dynamic_smem.size() * sizeof(uint4));
  for (int t = 0; t < n; ++t) {
    Fiber& f = s.fibers[t];
    f.linear = t;
    f.thread_idx = {t % s.block_dim.x, (t / s.block_dim.x) % s.block_dim.y,
                    t / (s.block_dim.x * s.block_dim.y)};
    // Initial frame: six zeroed callee-saved registers, then fiber_main as the return address;
    // `ret` leaves rsp = 8 mod 16 at fiber_main's entry, as after a call.
    uintptr_t top = reinterpret_cast<uintptr_t>(s.stacks.data() + (t + 1) * kStackBytes);
    top &= ~static_cast<uintptr_t>(15);
    auto* frame = reinterpret_cast<void**>(top) - 8;
    std::memset(frame, 0, 8 * sizeof(void*));
    frame[6] = reinterpret_cast<void*>(&fiber_main);
    f.sp = frame;
  }
  auto thread_at = [&](int k) { return s.config.reverse_order ? n - 1 - k : k; };
  for (;;) {
    bool ran = false;
    for (int k = 0; k < n; ++k) {
      const int t = thread_at(k);
      if (!runnable(s.fibers[t])) continue;
      resume(t);
      if (s.failed) return;
      ran = true;
      if (s.config.greedy) break;  // rescan from the first thread
    }
    if (ran) continue;
    for (const Fiber& f : s.fibers) {
      if (!f.done) return record_error("deadlock: threads wait at a barrier others never reach");
    }
    return;
  }
}

// Above the default 48 KB, a launch fails on a GPU unless cudaFuncSetAttribute raised that
// kernel's own limit first; emulated launches fail the same way.
inline bool smem_allowed(const void* kernel, int smem_bytes) {
  if (smem_bytes <= 48 * 1024) return true;
  for (const auto& [k, limit] : state().smem_limits) {
    if (k == kernel && smem_bytes <= limit) return true;
  }
  record_error("launch with > 48 KB dynamic shared memory before cudaFuncSetAttribute");
  return false;
}

template <typename Kernel>
void launch(Kernel kernel, dim3 grid, dim3 block, int smem_bytes,
            const std::function<void()>& body) {
  State& s = state();
  s.failed = false;
  s.block_idx = {};
  if (!smem_allowed(reinterpret_cast<const void*>(kernel), smem_bytes)) {
    s.error_pending = true;
    return;
  }
  s.dynamic_smem.assign((smem_bytes + 15) / 16, uint4{});
  s.grid_dim = {grid.x, grid.y, grid.z};
  s.block_dim = {block.x, block.y, block.z};
  s.body = body;
  const int64_t blocks = static_cast<int64_t>(grid.x) * grid.y * grid.z;
  for (int64_t k = 0; k < blocks; ++k) {
    const int64_t b = s.config.reverse_order ? blocks - 1 - k : k;
    run_block({static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
               static_cast<unsigned>(b / grid.x / grid.y)});
    if (s.failed) break;
  }
  s.fibers.clear();
  if (s.failed) s.error_pending = true;
}

inline unsigned char* dynamic_smem() {
  return reinterpret_cast<unsigned char*>(state().dynamic_smem.data());
}

// ---- barriers and shuffles -----------------------------------------------------------------

inline void syncthreads() {
  State& s = state();
  const unsigned generation = s.generation;
  if (++s.arrived == static_cast<int>(s.fibers.size())) {
    s.arrived = 0;
    ++s.generation;
    return;
  }
  wait_for(kBlockBarrier, generation);
}

inline WarpState& my_warp() { return state().warps[self().linear / 32]; }

inline void syncwarp() {
  WarpState& w = my_warp();
  const unsigned generation = w.generation;
  if (++w.arrived == 32) {
    w.arrived = 0;
    ++w.generation;
    return;
  }
  wait_for(kWarpBarrier, generation);
}

// All 32 lanes publish, meet, then read their partner's value. Two buffers alternate, so a
// lane that races ahead to the next shuffle cannot overwrite a value not yet read.
template <typename T>
T shfl_xor(T value, int lane_mask) {
  static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
  Fiber& f = self();
  WarpState& w = my_warp();
  const int lane = f.linear % 32;
  const int buffer = f.shuffles++ % 2;
  std::memcpy(&w.exchange[buffer][lane], &value, sizeof(T));
  w.lane_mask[buffer][lane] = lane_mask;
  syncwarp();
  if (w.lane_mask[buffer][lane ^ lane_mask] != lane_mask) fail("lanes of a warp shuffle apart");
  T result;
  std::memcpy(&result, &w.exchange[buffer][lane ^ lane_mask], sizeof(T));
  return result;
}

// ---- global memory checks --------------------------------------------------------------------

struct BufferScope {  // the launcher's buffers, valid for global accesses while it runs
  BufferScope(std::initializer_list<Range> ranges) {
    for (const Range& r : ranges) {
      if (r.bytes > 0) state().buffers.push_back(r);
    }
    count = ranges.size();
  }
  ~BufferScope() { state().buffers.clear(); }
  size_t count;
};

inline void check_global(const void* ptr, int64_t bytes, const char* what) {
  const auto& buffers = state().buffers;
  if (buffers.empty()) return;  // a launcher that registers nothing is not checked
  const char* p = static_cast<const char*>(ptr);
  for (const Range& r : buffers) {
    const char* b = static_cast<const char*>(r.begin);
    if (p >= b && p + bytes <= b + r.bytes) return;
  }
  char message[160];
  std::snprintf(message, sizeof(message), "out-of-bounds global %s of %lld bytes at %p", what,
                static_cast<long long>(bytes), ptr);
  fail(message);
}

inline void check_aligned(const void* ptr, int alignment, const char* what) {
  if (reinterpret_cast<uintptr_t>(ptr) % alignment != 0) {
    char message[120];
    std::snprintf(message, sizeof(message), "misaligned %d-byte %s at %p", alignment, what, ptr);
    fail(message);
  }
}

// ---- cp.async ------------------------------------------------------------------------------

inline void perform(const Pending& c) {
  if (c.src_bytes > 0) std::memcpy(c.dst, c.src, c.src_bytes);
  std::memset(static_cast<char*>(c.dst) + c.src_bytes, 0, c.bytes - c.src_bytes);
}

inline void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
  check_aligned(dst, bytes, "cp.async destination");
  if (src_bytes > 0) {
    check_aligned(src, bytes, "cp.async source");
    check_global(src, src_bytes, "cp.async read");
  }
  Fiber& f = self();
  const Pending copy{dst, src, bytes, src_bytes, f.committed_groups};
  if (state().config.eager_copies) {
    perform(copy);
  } else {
    f.pending.push_back(copy);
  }
}

inline void cp_async_commit() { ++self().committed_groups; }

inline void cp_async_wait(int allowed_pending) {
  Fiber& f = self();
  const int complete_below = f.committed_groups - allowed_pending;
  std::vector<Pending> still;
  for (const Pending& c : f.pending) {
    if (c.group < complete_below) {
      perform(c);
    } else {
      still.push_back(c);
    }
  }
  f.pending.swap(still);
}

}  // namespace kvl::emu

#include "host_emulation_warp.cuh"

// ---- the CUDA names the kernels use -----------------------------------------------------------

#define threadIdx (::kvl::emu::self().thread_idx)
#define blockIdx (::kvl::emu::state().block_idx)
#define blockDim (::kvl::emu::state().block_dim)
#define gridDim (::kvl::emu::state().grid_dim)

inline void __syncthreads() { kvl::emu::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { kvl::emu::syncwarp(); }

template <typename T>
T __shfl_xor_sync(unsigned, T value, int lane_mask) {
  return kvl::emu::shfl_xor(value, lane_mask);
}

inline cudaError_t cudaGetLastError() {
  kvl::emu::State& s = kvl::emu::state();
  if (!s.error_pending) return cudaSuccess;
  s.error_pending = false;
  return cudaErrorUnknown;
}

inline const char* cudaGetErrorString(cudaError_t code) {
  if (code == cudaSuccess) return "no error (host emulation)";
  const char* error = kvl::emu::state().error;
  return error[0] ? error : "error (host emulation)";
}

inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel kernel, cudaFuncAttribute attribute, int value) {
  if (attribute == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    kvl::emu::state().smem_limits.emplace_back(reinterpret_cast<const void*>(kernel), value);
  }
  return cudaSuccess;
}

template <typename Kernel>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* ctas, Kernel, int, size_t) {
  *ctas = 2;
  return cudaSuccess;
}

// Weak: every translation unit includes this header, the shared library keeps one copy.
extern "C" __attribute__((weak, visibility("default"))) void kvl_emu_configure(int reverse_order,
                                                                               int eager_copies,
                                                                               int greedy) {
  kvl::emu::state().config = {reverse_order != 0, eager_copies != 0, greedy != 0};
}
