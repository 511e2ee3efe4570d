// kvwrite: reshape_and_cache_flash_per_token_head_quant: quantize each (token, KV head) row of
// key and value with its own scale, computed here, and write codes and scale into a paged cache
// (contract: docs/ops/reshape_and_cache_flash_per_token_head_quant.md).
//
// Compiled at run time with NVRTC (see cuda_impl.py): one module per instantiation and, by
// default, per call signature, with the arguments fixed by the caches and the inputs' layout
// compiled in (KVWRITE_FIXED_ARGS).
//
// pth_quant_kernel<IN, MODE, VEC, CPL>: a group of `lanes` = 2^lane_shift threads (1 to
// 32, within one warp) per row, rows ordered (token, head, K then V), so the K and V rows of one
// (slot, head), adjacent in the packed layout, are written by neighbouring lanes. Lane l holds the
// row's chunks l, l + lanes, ... (CPL of them, VEC elements each, one vector access per chunk).
// The row's amax (int8, fp8) or min and max (int4) is an xor-shuffle reduction within the group
// (NaN ignored). The scale's division and the per-scale constants of the exact quotient
// (kvw/fp8.cuh: x / s = (x * m) / s2 by a product and one or two fused corrections, bit for bit
// the IEEE quotient) are computed once per lane; each element then costs the quotient and its
// rounding, done exactly with additions rounded toward zero or -inf (no conversion
// instructions). The slot is loaded after the row.
// int4 with VEC = 1 (unaligned rows): each lane's code is paired with its neighbour's by a
// shuffle and the even lane stores the byte.
// Slots < 0 (padding) or >= num_slots are skipped; rows past num_tokens are never read.
//
// Before the kernel: the row arithmetic, shared with a host build (-DKVWRITE_HOST_TEST, g++) that
// the tests compare with the reference on the CPU.
#include "kvw/common.cuh"
#include "kvw/fp8.cuh"
#include "kvw/vec_io.cuh"

#define PTH_INT8 0
#define PTH_FP8 1
#define PTH_INT4 2

// The scale floor float32(1e-6): bits 0x358637BD.
#define PTH_FLOOR 1e-6f

// Additions rounded toward zero (rz) and toward -inf (rm). The host build (tests) derives them
// from the round-to-nearest sum and its exact error (TwoSum, -ffp-contract=off).
#ifdef KVWRITE_HOST_TEST
KVW_HD float sub_rn(float a, float b) { return a - b; }
KVW_HD float add_err(float a, float b, float s) {
  const float bb = s - a;
  return (a - (s - bb)) + (b - bb);  // a + b - s, exactly
}
KVW_HD float add_rz(float a, float b) {
  const float s = a + b, e = add_err(a, b, s);
  return (s > 0.0f && e < 0.0f) || (s < 0.0f && e > 0.0f) ? nextafterf(s, 0.0f) : s;
}
KVW_HD float add_rm(float a, float b) {
  const float s = a + b, e = add_err(a, b, s);
  return e < 0.0f ? nextafterf(s, -INFINITY) : s;
}
#else
KVW_HD float sub_rn(float a, float b) {
  float r;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
KVW_HD float add_rz(float a, float b) {
  float r;
  asm("add.rz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
KVW_HD float add_rm(float a, float b) {
  float r;
  asm("add.rm.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
#endif

KVW_HD float nan_to_zero(float v) { return v == v ? v : 0.0f; }
KVW_HD float clampf(float v, float lo, float hi) { return fminf(fmaxf(v, lo), hi); }

// The row reductions' steps, NaN ignored: the GPU's min and max return the other operand of any
// NaN (signaling ones too). C's fmaxf returns NaN for a signaling NaN operand (a 16-bit NaN
// pattern widened), so the host build tests for NaN explicitly.
#ifdef KVWRITE_HOST_TEST
KVW_HD float amax_step(float a, float v) { return v == v ? fmaxf(a, fabsf(v)) : a; }
KVW_HD float min_step(float lo, float v) { return v == v ? fminf(lo, v) : lo; }
KVW_HD float max_step(float hi, float v) { return v == v ? fmaxf(hi, v) : hi; }
#else
KVW_HD float amax_step(float a, float v) { return fmaxf(a, fabsf(v)); }
KVW_HD float min_step(float lo, float v) { return fminf(lo, v); }
KVW_HD float max_step(float hi, float v) { return fmaxf(hi, v); }
#endif

// Integer rounding in float32 arithmetic only, exactly (never floor(v + 0.5) rounded to nearest,
// which takes 0.49999997 to 1), and without conversion instructions (a quarter of the issue
// rate): for y in [0, 2^23), RM(y + 2^23) = RZ(y + 2^23) = 2^23 + floor(y) (the float32 step is 1
// there), whose bits are 0x4B000000 + floor(y). And floor(RZ(y)) = floor(RM(y)) = floor(y) for
// the exact sum y of two floats: a directed rounding never passes the integer below y, which is a
// float. So rhaz(q) = sign(q) floor(|q| + 1/2) and rhu(q) = floor(q + 1/2) take two additions.
#define PTH_2P23 8388608.0f  // 2^23

// The bits of 2^23 + floor(y) for y in [0, 2^23): 0x4B000000 + floor(y), whose low byte is
// floor(y)'s (0x4B000000 ends with a zero byte).
KVW_HD u32 floor_bits(float y) { return f32_bits(add_rm(y, PTH_2P23)); }

// The exact quotient RN(x / s) of int8 rows, from kvw/fp8.cuh's per-scale constants: fp8_quotient
// without its clamp and its sign fix-up, which int8 needs neither of. |x / s| <= 127.00001 for
// every element of a row with finite values (s >= RN(amax / 127)), so |x * m| <= 2^9 (within the
// exact range of the corrections); an infinite element makes s infinite and m 0, so x * m is NaN
// (inf * 0) or ±0; and a zero's sign does not matter.
template <int STEPS>
KVW_HD float int8_quotient(float x, const Fp8Scale& sc) {
  const float a = mul_rn(x, sc.m);
  float q = mul_rn(a, sc.y);
#pragma unroll
  for (int i = 0; i < STEPS; ++i) q = fma_rn(fma_rn(-sc.s2, q, a), sc.y, q);
  return q;
}

// The int8 code (its byte) of q = RN(x / s), |q| <= 128 or NaN: rhaz, a NaN quotient counted as
// 0 (floor_bits). No clamp: |q| <= 127.00001 (int8_quotient), so |rhaz(q)| <= 127.
KVW_HD u32 int8_code(float q) {
  // floor(|q| + 1/2) in the low byte; a NaN sum gives 2^23 (fmaxf), as |q| < 1/2 does.
  const u32 n = f32_bits(fmaxf(add_rm(add_rz(fabsf(q), 0.5f), PTH_2P23), PTH_2P23));
  const u32 neg = static_cast<u32>(static_cast<int>(f32_bits(q)) >> 31);  // 0 or all ones
  return ((n ^ neg) - neg) & 0xFFu;  // the two's complement byte of ±floor(|q| + 1/2)
}

// The int4 code of q = RN(x / s) with zero point zp: a NaN quotient counted as 0, then
// clamp(rhu(q) + zp, 0, 15) = floor(clamp(q + zp + 1/2, 0, 15.5)): zp + 1/2 is exact, the sum
// rounds toward -inf (its floor is the exact one), and floor is monotone. q from fp8_quotient:
// |q| <= 2^20.
KVW_HD u32 int4_code(float q, float zp) {
  return floor_bits(clampf(add_rm(nan_to_zero(q), zp + 0.5f), 0.0f, 15.5f)) & 0xFu;
}

// The scale of int8 (div 127) and fp8 (div 448) rows from their amax (NaN ignored, 0 if none).
KVW_HD float amax_scale(float amax, float div) { return fmaxf(div_rn(amax, div), PTH_FLOOR); }

// The scale of an int4 row from its min and max over the non-NaN values (mn > mx: none, both
// 0). A NaN range (+inf - +inf) gives the floor: fmaxf returns its non-NaN operand.
KVW_HD float int4_scale(float& mn, float& mx) {
  if (!(mn <= mx)) mn = mx = 0.0f;
  return fmaxf(div_rn(sub_rn(mx, mn), 15.0f), PTH_FLOOR);
}

// The int4 zero point clamp(rhu(RN(-mn / s)), 0, 15), from the scale constants sc of s.
template <int STEPS>
KVW_HD float int4_zero_point(float mn, const Fp8Scale& sc) {
  return static_cast<float>(int4_code(fp8_quotient<STEPS>(-mn, sc), 0.0f));
}

// The int4 scale cache entry: s with its low 4 bits replaced by the zero point.
KVW_HD u32 int4_entry(float s, float zp) {
  return (f32_bits(s) & 0xFFFFFFF0u) | static_cast<u32>(zp);
}

#ifndef KVWRITE_HOST_TEST

#define KVW_PTH_PARAMS                                                                           \
    const u8* __restrict__ key,             /* [T_pad, H, Dk] via (k_tok, k_head, 1) elements */ \
    const u8* __restrict__ value,           /* [T_pad', H, Dv] via (v_tok, v_head, 1) */         \
    u8* __restrict__ key_cache,             /* [nb, bs, H, E] via (kc_b, kc_s, kc_h, 1) bytes */ \
    u8* __restrict__ value_cache,           /* [nb, bs, H, E] via (vc_b, vc_s, vc_h, 1) */       \
    float* __restrict__ k_scale,            /* [nb, bs, H] via (ks_b, ks_s, ks_h) floats */      \
    float* __restrict__ v_scale,            /* [nb, bs, H] via (vs_b, vs_s, vs_h) */             \
    const void* __restrict__ slot_mapping,  /* [num_tokens] int64 (slot64) or int32 */          \
    i64 num_tokens,                                                                              \
    i64 slot64,                             /* 1: int64 slots, 0: int32 */                       \
    i64 num_heads, i64 dk, i64 dv,          /* H, head sizes of key and value (elements) */      \
    i64 lane_shift,                         /* log2(lanes per row) */                            \
    i64 k_tok, i64 k_head, i64 v_tok, i64 v_head,                                                \
    i64 kc_b, i64 kc_s, i64 kc_h, i64 vc_b, i64 vc_s, i64 vc_h,                                  \
    i64 ks_b, i64 ks_s, i64 ks_h, i64 vs_b, i64 vs_s, i64 vs_h,                                  \
    i64 block_size, i64 block_shift,        /* block_shift = log2(block_size), or -1 */          \
    i64 num_slots                           /* num_blocks * block_size */

// In a build specialized for one call signature (-D KVWRITE_FIXED_ARGS=v0,...,v23) the
// arguments from slot64 on are compile-time constants: none is read from the parameter bank,
// the shuffles unroll and the index math folds.
#ifdef KVWRITE_FIXED_ARGS
#define KVW_PTH_FIXED_PROLOGUE()                                                                 \
  {                                                                                              \
    KVW_FIXED_ARGS_ARRAY(24);                                                                    \
    slot64 = fixed[0];                                                                           \
    num_heads = fixed[1]; dk = fixed[2]; dv = fixed[3]; lane_shift = fixed[4];                   \
    k_tok = fixed[5]; k_head = fixed[6]; v_tok = fixed[7]; v_head = fixed[8];                    \
    kc_b = fixed[9]; kc_s = fixed[10]; kc_h = fixed[11];                                         \
    vc_b = fixed[12]; vc_s = fixed[13]; vc_h = fixed[14];                                        \
    ks_b = fixed[15]; ks_s = fixed[16]; ks_h = fixed[17];                                        \
    vs_b = fixed[18]; vs_s = fixed[19]; vs_h = fixed[20];                                        \
    block_size = fixed[21]; block_shift = fixed[22]; num_slots = fixed[23];                      \
  }
#else
#define KVW_PTH_FIXED_PROLOGUE()
#endif

template <int IN, int MODE, int VEC, int CPL>
__global__ void __launch_bounds__(256) pth_quant_kernel(KVW_PTH_PARAMS) {
  KVW_PDL_ENTRY();
  KVW_PTH_FIXED_PROLOGUE()
  static_assert(MODE != PTH_FP8 || VEC == 1 || VEC % 2 == 0, "fp8 chunks: 1 or even");
  constexpr int IB = elem_bytes(IN);
  constexpr int STEPS = IN == DT_F32 ? 2 : 1;  // the exact quotient's corrections (kvw/fp8.cuh)
  constexpr bool INT4_PAIRS = MODE == PTH_INT4 && VEC == 1;  // nibbles paired across lanes
  // Code bytes per chunk.
  constexpr int OUT_N = MODE == PTH_INT4 ? (VEC >= 2 ? VEC / 2 : 1) : VEC;
  constexpr u32 FULL = 0xFFFFFFFFu;
  // 32-bit: the host launches at most 2^32 - 1 threads (cuda_impl.py checks).
  const u32 gid = blockIdx.x * blockDim.x + threadIdx.x;
  const u32 lanes = 1u << lane_shift;
  const u32 lane = gid & (lanes - 1u);
  const u32 row = gid >> lane_shift;
  const u32 th = row >> 1;  // token * H + head
  const i64 rows_th = num_tokens * num_heads;
  // A warp whose rows all lie past the last token leaves before any shuffle (warp-uniform);
  // in the others every lane takes part in the shuffles.
  if (static_cast<i64>(((gid & ~31u) >> lane_shift) >> 1) >= rows_th) return;
  const bool active = static_cast<i64>(th) < rows_th;
  const bool is_v = row & 1u;
  const u32 t32 = th / static_cast<u32>(num_heads);
  const i64 t = t32;
  const i64 h = th - t32 * static_cast<u32>(num_heads);
  const i64 d = is_v ? dv : dk;
  const u8* src = is_v ? value + (t * v_tok + h * v_head) * IB : key + (t * k_tok + h * k_head) * IB;

  Raw<VEC * IB> in[CPL];
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const i64 c = static_cast<i64>(lane) + static_cast<i64>(i) * lanes;
    if (active && c * VEC < d) {
      in[i] = load_raw<VEC * IB>(src + c * VEC * IB);
    } else {
#pragma unroll
      for (int k = 0; k < (VEC * IB >= 4 ? VEC * IB / 4 : 1); ++k) in[i].w[k] = 0;
    }
  }
  // The slot after the row (load_index: nothing computed from it is placed before the row's
  // loads). Its width is a fixed argument, a constant in specialized builds.
  i64 slot = -1;
  if (active) {
    slot = slot64 ? load_index(static_cast<const long long*>(slot_mapping) + t)
                  : static_cast<i64>(load_index(static_cast<const int*>(slot_mapping) + t));
  }

  // The row's elements. Past the row int4 takes NaN, which its min and max ignore; int8 and fp8
  // take the zeros loaded there, which leave the amax as it is. (Inactive lanes' rows are not
  // stored: their values do not matter.)
  float x[CPL][VEC];
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const i64 c = static_cast<i64>(lane) + static_cast<i64>(i) * lanes;
    const bool ok = MODE != PTH_INT4 || c * VEC < d;
#pragma unroll
    for (int j = 0; j < VEC; ++j) x[i][j] = ok ? elem_f32<IN>(in[i], j) : __int_as_float(0x7FC00000);
  }

  float s, mn = 0.0f;
  if constexpr (MODE == PTH_INT4) {
    float lo = __int_as_float(0x7F800000), hi = __int_as_float(0xFF800000);  // +inf, -inf
#pragma unroll
    for (int i = 0; i < CPL; ++i)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        lo = min_step(lo, x[i][j]);
        hi = max_step(hi, x[i][j]);
      }
    for (u32 m = lanes >> 1; m >= 1u; m >>= 1) {
      lo = fminf(lo, __shfl_xor_sync(FULL, lo, m));
      hi = fmaxf(hi, __shfl_xor_sync(FULL, hi, m));
    }
    s = int4_scale(lo, hi);
    mn = lo;
  } else {
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < CPL; ++i)
#pragma unroll
      for (int j = 0; j < VEC; ++j) a = amax_step(a, x[i][j]);
    for (u32 m = lanes >> 1; m >= 1u; m >>= 1) a = fmaxf(a, __shfl_xor_sync(FULL, a, m));
    s = amax_scale(a, MODE == PTH_INT8 ? 127.0f : 448.0f);
  }
  const Fp8Scale sc = fp8_exact_scale<true>(s);
  u32 entry = f32_bits(s);
  float zp = 0.0f;
  if constexpr (MODE == PTH_INT4) {
    zp = int4_zero_point<STEPS>(mn, sc);
    entry = int4_entry(s, zp);
  }

  Raw<OUT_N> out[CPL];
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    if constexpr (MODE == PTH_FP8) {
      fp8_quantize<DT_E4M3, VEC, STEPS>(x[i], out[i].w, sc);
    } else if constexpr (MODE == PTH_INT8) {
#pragma unroll
      for (int k = 0; k < (OUT_N >= 4 ? OUT_N / 4 : 1); ++k) out[i].w[k] = 0;
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        out[i].w[j >> 2] |= int8_code(int8_quotient<STEPS>(x[i][j], sc)) << ((j & 3) * 8);
    } else if constexpr (INT4_PAIRS) {
      const u32 code = int4_code(fp8_quotient<STEPS>(x[i][0], sc), zp);
      const u32 next = __shfl_down_sync(FULL, code, 1);  // the odd element, in lane + 1
      out[i].w[0] = code | (next << 4);
    } else {
#pragma unroll
      for (int k = 0; k < (OUT_N >= 4 ? OUT_N / 4 : 1); ++k) out[i].w[k] = 0;
#pragma unroll
      for (int j = 0; j < VEC; j += 2) {
        const u32 b = int4_code(fp8_quotient<STEPS>(x[i][j], sc), zp) |
                      (int4_code(fp8_quotient<STEPS>(x[i][j + 1], sc), zp) << 4);
        out[i].w[(j >> 1) >> 2] |= b << (((j >> 1) & 3) * 8);
      }
    }
  }

  if (!active || static_cast<u64>(slot) >= static_cast<u64>(num_slots)) return;  // also < 0
  i64 blk, pg;
  if (block_shift >= 0) {
    blk = slot >> block_shift;
    pg = slot & (block_size - 1);
  } else if ((static_cast<u64>(num_slots) >> 32) == 0) {
    const u32 b32 = static_cast<u32>(slot) / static_cast<u32>(block_size);
    blk = b32;
    pg = slot - static_cast<i64>(b32) * block_size;
  } else {
    blk = slot / block_size;
    pg = slot - blk * block_size;
  }
  u8* dst = is_v ? value_cache + blk * vc_b + pg * vc_s + h * vc_h
                 : key_cache + blk * kc_b + pg * kc_s + h * kc_h;
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const i64 c = static_cast<i64>(lane) + static_cast<i64>(i) * lanes;
    if (c * VEC < d) {
      if constexpr (INT4_PAIRS) {
        if ((c & 1) == 0) store_raw<1>(dst + (c >> 1), out[i]);
      } else {
        store_raw<OUT_N>(dst + c * OUT_N, out[i]);
      }
    }
  }
  if (lane == 0) {
    float* sp = is_v ? v_scale + blk * vs_b + pg * vs_s + h * vs_h
                     : k_scale + blk * ks_b + pg * ks_s + h * ks_h;
    *reinterpret_cast<u32*>(sp) = entry;
  }
}
#endif  // KVWRITE_HOST_TEST
