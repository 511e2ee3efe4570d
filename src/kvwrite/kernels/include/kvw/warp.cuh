// Warp-level moves shared by the ops' kernels. Device code only (the CPU emulation,
// tests/gather_emu.h, provides the shuffles); every lane of the warp takes part.
#pragma once
#include "kvw/common.cuh"

// A 64-bit value from lane src, or from delta lanes up, as two 32-bit shuffles.
__device__ __forceinline__ i64 shfl_i64(i64 v, int src) {
  const u32 lo = __shfl_sync(0xFFFFFFFFu, static_cast<u32>(static_cast<u64>(v)), src);
  const u32 hi = __shfl_sync(0xFFFFFFFFu, static_cast<u32>(static_cast<u64>(v) >> 32), src);
  return static_cast<i64>((static_cast<u64>(hi) << 32) | lo);
}
__device__ __forceinline__ i64 shfl_down_i64(i64 v, u32 delta) {
  const u32 lo = __shfl_down_sync(0xFFFFFFFFu, static_cast<u32>(static_cast<u64>(v)), delta);
  const u32 hi = __shfl_down_sync(0xFFFFFFFFu, static_cast<u32>(static_cast<u64>(v) >> 32), delta);
  return static_cast<i64>((static_cast<u64>(hi) << 32) | lo);
}
