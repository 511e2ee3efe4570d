// A SIMT emulation of the gather kernels on the CPU, for tests without a GPU
// (tests/test_gather_emu.py). Included before a gather op's kernel.cu, compiled with g++ as C++20:
// the kernel's code runs as written (the row rule, the rounds, the lane arithmetic, the shuffles
// and ballots, the barriers), one std::thread per CUDA thread of a CTA, the CTAs one after the
// other. What it cannot run is the GPU's own instructions: with KVWRITE_EMU the headers take their
// host paths there (loads as plain C++ under the predicate, the fp8 decode and the float16 and
// bfloat16 rounding in software, both exact), so those stay for the GPU tests.
//
// Warp primitives are full-warp (mask 0xFFFFFFFF) as the kernels use them: every lane of the warp
// must reach them, else the emulation hangs (where a GPU would be undefined).
#pragma once
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#define KVWRITE_HOST_TEST 1
#define KVWRITE_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__

struct uint4 {
  unsigned x, y, z, w;
};
struct uint2 {
  unsigned x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }

struct EmuDim {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local EmuDim threadIdx, blockIdx;
// The launch's shape (emu_launch sets them; read by kernels with grid-stride loops).
inline EmuDim blockDim, gridDim;

inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}

constexpr int kEmuThreads = 128;  // KVW_GATHER_THREADS

struct EmuWarp {
  std::barrier<> bar{32};
  unsigned long long vals[32] = {};
};
struct EmuCta {
  std::barrier<> bar{kEmuThreads};
  std::atomic<int> acc{0};
  EmuWarp warps[kEmuThreads / 32];
};
inline thread_local EmuCta* emu_cta = nullptr;

inline EmuWarp& emu_warp() { return emu_cta->warps[threadIdx.x >> 5]; }

inline unsigned __shfl_sync(unsigned, unsigned v, int src) {
  EmuWarp& w = emu_warp();
  w.vals[threadIdx.x & 31u] = v;
  w.bar.arrive_and_wait();
  const unsigned r = static_cast<unsigned>(w.vals[static_cast<unsigned>(src) & 31u]);
  w.bar.arrive_and_wait();
  return r;
}

inline unsigned __shfl_xor_sync(unsigned, unsigned v, int m) {
  return __shfl_sync(0xFFFFFFFFu, v, static_cast<int>((threadIdx.x & 31u) ^ static_cast<unsigned>(m)));
}

// A float's xor shuffle (the kernels' maxima and tree sums), moved as its bits.
inline float __shfl_xor_sync(unsigned mask, float v, int m) {
  unsigned u;
  std::memcpy(&u, &v, 4);
  u = __shfl_xor_sync(mask, u, m);
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

// A lane past the warp's end (lane + delta > 31) keeps its own value, as on the GPU.
inline unsigned __shfl_down_sync(unsigned, unsigned v, unsigned delta) {
  const unsigned lane = threadIdx.x & 31u;
  const unsigned src = lane + delta <= 31u ? lane + delta : lane;
  return __shfl_sync(0xFFFFFFFFu, v, static_cast<int>(src));
}

inline unsigned __ballot_sync(unsigned, int pred) {
  EmuWarp& w = emu_warp();
  w.vals[threadIdx.x & 31u] = pred != 0;
  w.bar.arrive_and_wait();
  unsigned m = 0;
  for (int i = 0; i < 32; ++i) m |= static_cast<unsigned>(w.vals[i] != 0) << i;
  w.bar.arrive_and_wait();
  return m;
}

inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }

inline void __syncthreads() { emu_cta->bar.arrive_and_wait(); }

inline int __syncthreads_or(int pred) {
  if (pred) emu_cta->acc.fetch_or(1);
  emu_cta->bar.arrive_and_wait();
  const int r = emu_cta->acc.load();
  emu_cta->bar.arrive_and_wait();
  if (threadIdx.x == 0) emu_cta->acc.store(0);
  emu_cta->bar.arrive_and_wait();
  return r;
}

// The dynamic shared memory of the CTA being run (one at a time).
inline long long kvw_gather_smem[1 << 16];

// Runs `body` (a kernel call with its arguments) for `grid` CTAs of kEmuThreads threads.
template <typename F>
void emu_launch(unsigned grid, F body) {
  EmuCta cta;
  blockDim.x = kEmuThreads;
  gridDim.x = grid;
  std::vector<std::thread> threads;
  threads.reserve(kEmuThreads);
  for (int t = 0; t < kEmuThreads; ++t) {
    threads.emplace_back([&, t] {
      emu_cta = &cta;
      threadIdx.x = static_cast<unsigned>(t);
      for (unsigned b = 0; b < grid; ++b) {
        blockIdx.x = b;
        body();
        cta.bar.arrive_and_wait();  // the CTA's end: the next one starts with every thread
      }
    });
  }
  for (auto& th : threads) th.join();
}
