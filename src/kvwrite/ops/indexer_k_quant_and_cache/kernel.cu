// kvwrite: indexer_k_quant_and_cache (docs/ops/indexer_k_quant_and_cache.md): quantize one key
// row [D] per token into e4m3 codes with one float32 scale per group of q elements, into the
// token's slot of a paged cache whose page is all codes first, then all scales.
//
// Compiled at run time with NVRTC (see cuda_impl.py): one module per instantiation and, by
// default, per call signature, with the arguments fixed by the cache and the input's layout
// compiled in (KVWRITE_FIXED_ARGS). The shared parts (element kinds, fp8 conversion, vector
// I/O, slot addressing) come from kvwrite's kernel headers; nothing else is included.
//
// indexer_k_quant_and_cache_kernel<IN, VEC, SlotT, ONE>: a flat grid of threads, `lanes` per
// group and G groups per token (threads_per_token = G * lanes), lanes a power of two dividing
// 32, so that each group's lanes are an aligned segment of one warp and its amax is an
// xor-shuffle reduction (fmaxf, which ignores NaN) within the segment. A lane holds chunks of
// VEC consecutive elements: chunk c of the group's q / VEC goes to lane c mod lanes. ONE: each
// lane has exactly one chunk, held in registers from the load to the store (D = 128, q = 128,
// 16-bit input: 8 lanes of 32 bytes per token, or 16 of 16 bytes in small calls). Otherwise a lane walks its chunks twice: once
// for the amax, once (loads again, from L1/L2) to quantize and store.
//
// Per group: s = max(amax, float32(1e-4)) / 448 by div_rn, once per lane (every lane of the
// segment holds the same amax). "ue8m0" and "mxfp8" (the fixed argument scale_fmt, one of
// KVW_INDEXER_FMT_*, other than F32): s rounded up to a power of two from its bits; then
// x / s = x * 2^-k exactly, so each code is the satfinite conversion
// of one rounded product (mul_rn by the exact reciprocal): RN(x * 2^-k) = RN(x / s), including
// subnormal quotients, and s = +inf gives the reciprocal 0: x * 0 = ±0, inf * 0 = NaN, as x / inf.
// Plain float32 scales: kvw/fp8.cuh's exact division-free quotient (make_fp8_scale, fp8_quantize).
// The scale's 4 bytes: its float32 bits, or for "mxfp8" its biased exponent (bits >> 23, 0xFF for
// +inf) in each byte.
//
// No thread returns before the shuffles (threads past num_tokens load nothing and store nothing),
// so a full-warp mask is always right. Slots < 0 (padding) or >= num_slots are skipped; rows of k
// past num_tokens are never read.
#include "kvw/common.cuh"
#include "kvw/fp8.cuh"
#include "kvw/vec_io.cuh"
#include "kvw/slot.cuh"

// The group scale from its amax (>= 0, never NaN): s = max(amax, float32(1e-4)) / 448, a true
// float32 division, then for ue8m0 the smallest power of two >= s (kvw/fp8.cuh's
// ue8m0_round_up). Host-testable.
// The scale formats (the fixed argument scale_fmt; cuda_impl.py's _FMT_CODE).
#define KVW_INDEXER_FMT_F32 0
#define KVW_INDEXER_FMT_UE8M0 1
#define KVW_INDEXER_FMT_MXFP8 2

KVW_HD float indexer_scale(float amax, bool ue8m0) {
  const float floor = bits_f32(0x38D1B717u);  // float32(1e-4)
  const float s = div_rn(amax > floor ? amax : floor, 448.0f);
  return ue8m0 ? ue8m0_round_up(s) : s;
}

// The 4 scale bytes of a group (little-endian word): s's float32 bits, or for "mxfp8" its UE8M0
// byte 4 times (s > 0 is a power of two or +inf: bits >> 23 is the biased exponent, 0xFF for
// +inf). Host-testable.
KVW_HD u32 indexer_scale_word(float s, bool mxfp8) {
  const u32 b = f32_bits(s);
  return mxfp8 ? (b >> 23) * 0x01010101u : b;
}

#ifndef KVWRITE_HOST_TEST

#define KVW_INDEXER_PARAMS                                                                      \
    const u8* __restrict__ k,             /* [T_pad, D]; token stride k_stride (elements) */    \
    u8* __restrict__ cache,               /* pages of block_size * (D + 4G) bytes */            \
    const SlotT* __restrict__ slot_mapping,  /* [num_tokens] */                                 \
    i64 num_tokens,                                                                             \
    i64 k_stride,                         /* token stride of k, in elements */                  \
    i64 block_stride,                     /* bytes from one page to the next */                 \
    i64 block_size, i64 block_shift,      /* block_shift = log2(block_size), or -1 */           \
    i64 num_slots,                        /* num_blocks * block_size */                         \
    i64 head_dim,                         /* D */                                               \
    i64 group_size,                       /* q = quant_block_size */                            \
    i64 num_groups,                       /* G = D / q */                                       \
    i64 lanes,                            /* threads per group: a power of two, <= 32 */        \
    i64 threads_per_token,                /* G * lanes */                                       \
    i64 scale_fmt                         /* KVW_INDEXER_FMT_F32, _UE8M0 or _MXFP8 */

// In a build specialized for one call signature (-D KVWRITE_FIXED_ARGS=v0,...,v10) the
// arguments from k_stride on are compile-time constants: none is read from the parameter bank
// and the index math (the divisions by threads_per_token and lanes included) folds.
#define KVW_INDEXER_FIXED_PROLOGUE() KVW_ASSIGN_FIXED_ARGS(k_stride, block_stride, block_size,  \
    block_shift, num_slots, head_dim, group_size, num_groups, lanes, threads_per_token,         \
    scale_fmt)

// The VEC codes of one chunk of VEC elements under scale s.
template <int IN, int VEC>
KVW_HD Raw<VEC> indexer_codes(const float (&x)[VEC], float s, bool ue8m0) {
  Raw<VEC> out;
  if (ue8m0) {
    fp8_quantize_pow2<DT_E4M3, VEC>(x, out.w, pow2_reciprocal(s));
  } else {
    // 16-bit inputs need one correction step of the quotient, float32 two (kvw/fp8.cuh).
    fp8_quantize<DT_E4M3, VEC, IN == DT_F32 ? 2 : 1>(x, out.w, make_fp8_scale<true, false>(s));
  }
  return out;
}

// The 4 bytes of a group's scale (indexer_scale_word) at p (4-byte aligned, or byte by byte).
KVW_HD void indexer_store_scale(u8* p, u32 b) {
  if ((reinterpret_cast<u64>(p) & 3u) == 0) {
    *reinterpret_cast<u32*>(p) = b;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = static_cast<u8>(b >> (8 * i));
  }
}

template <int IN, int VEC, typename SlotT, bool ONE>
__global__ void __launch_bounds__(256) indexer_k_quant_and_cache_kernel(KVW_INDEXER_PARAMS) {
  KVW_PDL_ENTRY();
  KVW_INDEXER_FIXED_PROLOGUE()
  constexpr int IB = elem_bytes(IN);
  constexpr int IN_BYTES = VEC * IB;
  // 32-bit: the host launches at most 2^32 - 1 threads (cuda_impl.py checks).
  const u32 gid = blockIdx.x * blockDim.x + threadIdx.x;
  const u32 t32 = gid / static_cast<u32>(threads_per_token);
  const u32 r = gid - t32 * static_cast<u32>(threads_per_token);
  const u32 g = r / static_cast<u32>(lanes);
  const u32 lane = r - g * static_cast<u32>(lanes);
  const bool live = t32 < static_cast<u64>(num_tokens);
  const i64 t = t32;
  const i64 chunks = group_size / VEC;  // per group
  const u8* grp = k + (t * k_stride + static_cast<i64>(g) * group_size) * IB;
  i64 s = -1;
  if (SLOT_FIRST<SlotT> && live) s = static_cast<i64>(slot_mapping[t]);

  float x[VEC];
  float amax = 0.0f;
  if constexpr (ONE) {
    Raw<IN_BYTES> in;
#pragma unroll
    for (int i = 0; i < (IN_BYTES >= 4 ? IN_BYTES / 4 : 1); ++i) in.w[i] = 0;
    if (live) in = load_raw<IN_BYTES>(grp + static_cast<i64>(lane) * IN_BYTES);
    if (!SLOT_FIRST<SlotT> && live) s = static_cast<i64>(load_index(slot_mapping + t));
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      x[i] = elem_f32<IN>(in, i);
      amax = fmaxf(amax, fabsf(x[i]));  // fmaxf returns the other operand for a NaN
    }
  } else {
    if (!SLOT_FIRST<SlotT> && live) s = static_cast<i64>(load_index(slot_mapping + t));
    if (live) {
      for (i64 c = lane; c < chunks; c += lanes) {
        const Raw<IN_BYTES> in = load_raw<IN_BYTES>(grp + c * IN_BYTES);
#pragma unroll
        for (int i = 0; i < VEC; ++i) amax = fmaxf(amax, fabsf(elem_f32<IN>(in, i)));
      }
    }
  }
  for (u32 m = static_cast<u32>(lanes) >> 1; m > 0; m >>= 1)  // within the group's segment
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, m));
  const bool ue8m0 = scale_fmt != KVW_INDEXER_FMT_F32;  // power-of-two scales
  const float sc = indexer_scale(amax, ue8m0);

  if (!live || static_cast<u64>(s) >= static_cast<u64>(num_slots)) return;  // also s < 0
  const bool slots_fit_u32 = (static_cast<u64>(num_slots) >> 32) == 0;
  // The slot's codes at page + o * D, its scales at page + block_size * D + 4 * o * G.
  u8* codes = cache + slot_offset(s, block_stride, head_dim, block_size, block_shift,
                                  slots_fit_u32) + static_cast<i64>(g) * group_size;
  u8* scales = cache + slot_offset(s, block_stride, 4 * num_groups, block_size, block_shift,
                                   slots_fit_u32) + block_size * head_dim + 4 * static_cast<i64>(g);
  if constexpr (ONE) {
    store_raw<VEC>(codes + static_cast<i64>(lane) * VEC, indexer_codes<IN, VEC>(x, sc, ue8m0));
  } else {
    for (i64 c = lane; c < chunks; c += lanes) {
      const Raw<IN_BYTES> in = load_raw<IN_BYTES>(grp + c * IN_BYTES);
#pragma unroll
      for (int i = 0; i < VEC; ++i) x[i] = elem_f32<IN>(in, i);
      store_raw<VEC>(codes + c * VEC, indexer_codes<IN, VEC>(x, sc, ue8m0));
    }
  }
  if (lane == 0)
    indexer_store_scale(scales, indexer_scale_word(sc, scale_fmt == KVW_INDEXER_FMT_MXFP8));
}
#endif  // KVWRITE_HOST_TEST
