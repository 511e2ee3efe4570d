// Slot -> cache address arithmetic shared by every op that scatters rows into a paged cache.
#pragma once
#include "kvw/common.cuh"

// The element offset of slot s (0 <= s < num_slots) in a cache: block * block_stride +
// (s mod block_size) * page_stride, with a shift when block_size is a power of two and a 32-bit
// division when the slots fit in 32 bits (a 64-bit division is a long subroutine on the GPU).
KVW_HD i64 slot_offset(i64 s, i64 block_stride, i64 page_stride, i64 block_size, i64 block_shift,
                       bool slots_fit_u32) {
  i64 blk, pg;
  if (block_shift >= 0) {
    blk = s >> block_shift;
    pg = s & (block_size - 1);
  } else if (slots_fit_u32) {
    const u32 b32 = static_cast<u32>(s) / static_cast<u32>(block_size);
    blk = b32;
    pg = s - static_cast<i64>(b32) * block_size;
  } else {
    blk = s / block_size;
    pg = s - blk * block_size;
  }
  return blk * block_stride + pg * page_stride;
}
