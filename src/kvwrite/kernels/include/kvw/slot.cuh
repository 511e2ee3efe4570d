// Slot -> cache address arithmetic shared by every op that scatters rows into a paged cache.
#pragma once
#include "kvw/common.cuh"

// Whether a kernel loads its token's slot before its row (int64 slots, a plain read-only load)
// or after it (int32 slots, load_index): concat_and_cache_mla's, the indexer's and
// reshape_and_cache's kernels. Loaded first, an int32 slot's sign extension was placed
// before the row's load in 17 of the 55 generic int32 variants, which so waited for the slot's
// round trip before requesting their chunk: H200, generic build (KVWRITE_CUDA_SPECIALIZE=0),
// bfloat16 L=512 P=64, rotated L2, auto T=1 / 16 / 256 1.40 / 1.63 / 1.96 -> 1.08 / 1.33 / 1.62
// us, fp8 1.50 / 1.73 / 2.05 -> 1.18 / 1.41 / 1.72; the specialized builds had no such wait and
// measured the same either way. int64 slots keep the first order: load_index measured 0-2% slower
// with them (tuning-log changes 52 and 57).
template <typename SlotT>
constexpr bool SLOT_FIRST = sizeof(SlotT) == 8;

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
