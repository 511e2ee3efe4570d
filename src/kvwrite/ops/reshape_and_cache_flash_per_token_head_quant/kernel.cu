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
// row's chunks l, l + lanes, ... (CPL of them, VEC elements each, one vector load per chunk; the
// chunk's codes stored in accesses of 2^store_shift bytes, what the cache rows' alignment
// allows). The row's loads and its slot's are issued first. Then the row's amax (int8, fp8) or
// min and max (int4), NaN propagating (bfloat16 / float16 pairs: one instruction per pair), by
// an xor-shuffle reduction within the group, decides the row's path:
// - the fast path (rows of finite values; int4: whose range also holds zero; every row of
//   real data): the rule's arithmetic simplified where those rows allow it (see "The fast path"
//   below): the scale's division by the constant divisor's exact-quotient constants, RN(1 / s),
//   each element's quotient in one product and two fused multiply-adds, its code in three
//   additions (int8, int4) or the satfinite conversion (fp8), bit for bit the general path's;
// - the general path (NaN, infinities, int4 rows of one sign): the rule step by step, with its
//   own NaN-ignoring reductions (kvw/fp8.cuh's exact quotient x / s = (x * m) / s2, the
//   roundings done exactly with additions rounded toward zero or -inf: no conversion
//   instructions).
// Rows of one warp may take different paths (the general path's shuffles use the ballot of its
// rows' lanes).
// int4 with VEC = 1 (unaligned rows): each lane's code is paired with its neighbour's by a
// shuffle and the even lane stores the byte.
// Slots < 0 (padding) or >= num_slots are skipped; rows past num_tokens are never stored (their
// lanes read the last token's row).
//
// Before the kernel: the row arithmetic, shared with a host build (-DKVWRITE_HOST_TEST, g++) that
// the tests compare with the reference on the CPU.
#include "kvw/common.cuh"
#include "kvw/fp8.cuh"
#include "kvw/round.cuh"
#include "kvw/vec_io.cuh"

#define PTH_INT8 0
#define PTH_FP8 1
#define PTH_INT4 2

// The scale floor float32(1e-6): bits 0x358637BD.
#define PTH_FLOOR 1e-6f

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

// Integer roundings: kvw/round.cuh (add_rz, add_rm, floor_bits, rhu_clamp_code).
#define PTH_2P23 KVW_2P23  // 2^23

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
KVW_HD u32 int4_code(float q, float zp) { return rhu_clamp_code(q, zp + 0.5f, 15.0f); }

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

// ------------------------------------------------------------------------------------------
// The fast path: rows whose values are all finite (int4: and whose range holds zero, mn <= 0 <=
// mx, with a finite range) -- every row of real data, and those that the kernel checks for
// from its reductions. On them the arithmetic above simplifies, bit for bit:
// - s is finite and normal (FLOOR <= s <= 2^125), so y = RN(1 / s) is normal (2^-125 <= y <=
//   2^20) and y = m * RN(1 / s2) with fp8_exact_scale's m and s2 (a power of two scales an RN
//   result exactly in the normal range). The quotient without the scaling by m, q = RN(x * y)
//   and STEPS corrections q = RN(q + RN(x - s q) y), computes the same real numbers as
//   int8_quotient / fp8_quotient's (x m, s2 = s m), each divided by m, so the same floats,
//   wherever neither form's residual underflows: that needs |x| or |x m| below 2^-100, where
//   |x / s| < 2^-80 (s >= FLOOR, s2 >= 2) and the code is 0 (int8), zp (int4) or a zero of x's
//   sign (fp8) from either form. |x / s| <= 127.00001 (int8), 448.0001 (fp8), 15.00001 (int4:
//   |x| <= mx - mn), so nothing overflows and no clamp is needed: one product and two fused
//   multiply-adds per element (four for float32 inputs). test_per_token_head.py compares this
//   form with the scaled one on every 16-bit value under scales of every binade.
// - The scale's division by 127, 448 or 15 is the same quotient with constants (the dividend
//   a >= 0 scaled by the divisor's power of two): exact for 16-bit dividends with one step
//   (amax is an input value; tests/test_fp8_division.py checks every significand pair), and
//   for float32 ones (int4's RN(mx - mn), float32 inputs) with two.
// - int8 codes: rhaz(q) = sign(q) floor(|q| + 1/2) in two directed additions, the sign folded
//   into the second: u = RZ(|q| + 1/2) (floor(u) = floor(|q| + 1/2)), then RM(u + C) = C +
//   floor(u) for q >= 0 and RM(u - C) = -(C - floor(u)) for q < 0, with C = 2^23 + 256: both
//   sums lie in [2^23, 2^24) in magnitude (step 1), so the low byte of the bits is floor(u) or
//   256 - floor(u), the two's complement byte (|q| <= 127.00001: floor(u) <= 127).
// - int4 codes: zp = rhu(RN(-mn / s)) <= 15 needs no clamp, and rhu(q) + zp >= rhu(RN(mn / s))
//   + rhu(RN(-mn / s)) >= 0 (monotone roundings; rhu(-v) + rhu(v) is 0 or 1), so only the top
//   clamp is left: the bits of RM(min(RM(q + zp + 1/2), 15.5) + 2^23) are 0x4B000000 + code.
//   Eight of them pack into a word by a Horner sum t0 + 16 (t1 + 16 (t2 + ...)) less the
//   0x4B000000 parts (of t0 and 16 t1 only: 0x4B000000 * 256 = 0 mod 2^32).
// - fp8 codes: the quotient with x's sign bit put back (only a zero quotient can have lost it:
//   x = -0, or an underflow), then the satfinite conversion (NaN elements need no exception:
//   the conversion keeps them NaN, but the kernel's NaN-propagating amax sends their rows to
//   the general path all the same).
// ------------------------------------------------------------------------------------------

// The constant divisors 127, 448 and 15 as (m, s2, y) of fp8_exact_scale: 127 = 3.96875 * 2^5,
// 448 = 3.5 * 2^7, 15 = 3.75 * 2^2; y = RN(1 / s2) (the tests check these values).
#define PTH_M127 0x1p-5f
#define PTH_S127 3.96875f
#define PTH_Y127 0x1.020408p-2f
#define PTH_M448 0x1p-7f
#define PTH_S448 3.5f
#define PTH_Y448 0x1.24924ap-2f
#define PTH_M15 0x1p-2f
#define PTH_S15 3.75f
#define PTH_Y15 0x1.111112p-2f

// RN(x / s) for the fast path's rows, from y = RN(1 / s) (see above).
template <int STEPS>
KVW_HD float fast_quotient(float x, float s, float y) {
  float q = mul_rn(x, y);
#pragma unroll
  for (int i = 0; i < STEPS; ++i) q = fma_rn(fma_rn(-s, q, x), y, q);
  return q;
}

// RN(a / D) for a finite a >= 0 and a constant divisor D = s2 / m: fast_quotient of a * m (exact
// unless a * m < 2^-126, where the result lies far below the scale floor and is floored).
template <int STEPS>
KVW_HD float fast_div_const(float a, float m, float s2, float y) {
  return fast_quotient<STEPS>(mul_rn(a, m), s2, y);
}

// RN(1 / s) for a finite normal s > 0 with 1 / s normal: m RN(1 / s2), with fp8_exact_scale's m
// and s2 (rcp_rn_s2 is exact for s2 in [2, 4)).
KVW_HD float fast_rcp(float s) {
  const float m = bits_f32((255u - (f32_bits(s) >> 23)) << 23);
  return mul_rn(rcp_rn_s2(mul_rn(s, m)), m);
}

// The int8 code of q (fast path): its two's complement byte in the low 8 bits (the other bits
// are not part of it).
#define PTH_INT8_C 0x4B000100u  // 2^23 + 256
// (a & 0x80000000) | c in one instruction (c in a register: left to itself, the compiler spends
// two, the constants being too many for one).
KVW_HD u32 sign_or(u32 a, u32 c) {
#ifdef KVWRITE_HOST_TEST
  return (a & 0x80000000u) | c;
#else
  u32 r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(0x80000000u), "r"(c));
  return r;
#endif
}
KVW_HD u32 fast_int8_code(float q) {
  const float u = add_rz(fabsf(q), 0.5f);
  return f32_bits(add_rm(u, bits_f32(sign_or(f32_bits(q), PTH_INT8_C))));
}

// The int4 code of q (fast path) with zc = zp + 1/2: 0x4B000000 + the code. CLAMP = false
// leaves out the top clamp, for rows whose largest value's code is at most 15 (fast_int4_top):
// the codes are monotone in x, so no element of the row reaches 16.
template <bool CLAMP = true>
KVW_HD u32 fast_int4_bits(float q, float zc) {
  const float v = add_rm(q, zc);
  return f32_bits(add_rm(CLAMP ? fminf(v, 15.5f) : v, PTH_2P23));
}

// Whether the row's codes all stay below 16 unclamped: RM(RN(mx / s) + zc) < 16, i.e. the code
// of its largest value mx is at most 15 (rhu(q) + zp reaches 16 only where both RN(mx / s) and
// RN(-mn / s) fall on a half: ties, rare).
template <int STEPS>
KVW_HD bool fast_int4_top(float mx, float s, float y, float zc) {
  return add_rm(fast_quotient<STEPS>(mx, s, y), zc) < 16.0f;
}

// N (2, 4 or 8) int4 codes as fast_int4_bits gives them, packed into N / 2 bytes (element 0 in
// the low nibble): the Horner sum, less 0x4B000000 + 16 * 0x4B000000 = 0xFB000000 (mod 2^32).
template <int N>
KVW_HD u32 fast_int4_pack(const u32 (&t)[N]) {
  u32 w = t[N - 1];
#pragma unroll
  for (int j = N - 2; j >= 0; --j) w = w * 16u + t[j];
  return w - 0xFB000000u;
}

// The fp8 code's float: the quotient with x's sign (a lost zero sign comes back).
KVW_HD float fast_fp8_signed(float q, float x) {
  return bits_f32(f32_bits(q) | (f32_bits(x) & 0x80000000u));
}

// The fast path's scale of an int8 (D = 127) or fp8 (D = 448) row from its finite amax.
template <int MODE, int STEPS>
KVW_HD float fast_amax_scale(float amax) {
  const float q = MODE == PTH_INT8 ? fast_div_const<STEPS>(amax, PTH_M127, PTH_S127, PTH_Y127)
                                   : fast_div_const<STEPS>(amax, PTH_M448, PTH_S448, PTH_Y448);
  return fmaxf(q, PTH_FLOOR);
}

// The fast path's int4 scale from mn <= 0 <= mx with a finite range (float32 dividend: two
// steps).
KVW_HD float fast_int4_scale(float mn, float mx) {
  return fmaxf(fast_div_const<2>(sub_rn(mx, mn), PTH_M15, PTH_S15, PTH_Y15), PTH_FLOOR);
}

// The fast path's int4 zero point rhu(RN(-mn / s)) (at most 15, see above), as a float.
// Returned as the bits of 2^23 + zp (zp in the low 4 bits): zc = zp + 1/2 is then that float less
// 2^23 - 1/2, exactly.
template <int STEPS>
KVW_HD u32 fast_int4_zero_point(float mn, float s, float y) {
  return rhu_bits(fast_quotient<STEPS>(-mn, s, y));
}
KVW_HD float fast_int4_zc(u32 zp_bits) { return sub_rn(bits_f32(zp_bits), 8388607.5f); }

// Whether a row takes the fast path, from its NaN-propagating reductions (a NaN fails every
// comparison).
KVW_HD bool fast_amax_row(float amax) { return amax < bits_f32(0x7F800000u); }

KVW_HD bool fast_int4_row(float mn, float mx) {
  return mn <= 0.0f && mx >= 0.0f && sub_rn(mx, mn) < bits_f32(0x7F800000u);
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
    i64 num_slots,                          /* num_blocks * block_size */                        \
    i64 store_shift                         /* log2(bytes per code store), <= log2(code bytes) */

// In a build specialized for one call signature (-D KVWRITE_FIXED_ARGS=v0,...,v24) the
// arguments from slot64 on are compile-time constants: none is read from the parameter bank,
// the shuffles unroll and the index math folds.
#define KVW_PTH_FIXED_PROLOGUE() KVW_ASSIGN_FIXED_ARGS(slot64, num_heads, dk, dv, lane_shift,   \
    k_tok, k_head, v_tok, v_head, kc_b, kc_s, kc_h, vc_b, vc_s, vc_h, ks_b, ks_s, ks_h, vs_b,   \
    vs_s, vs_h, block_size, block_shift, num_slots, store_shift)

// NaN-propagating min and max of float32 values (the fast path's row test: a NaN anywhere in
// the row reaches the result).
#if __CUDA_ARCH__ >= 800
KVW_F32_ASM2(nmax, "max.NaN.f32")
KVW_F32_ASM2(nmin, "min.NaN.f32")
#else
KVW_HD float nmax(float a, float b) { return a != a || b != b ? a + b : fmaxf(a, b); }
KVW_HD float nmin(float a, float b) { return a != a || b != b ? a + b : fminf(a, b); }
#endif

// The same on pairs of 16-bit elements in a 32-bit word (sm_80 on: one instruction per pair).
// pk_max_abs: max(|a|, |b|) per half; its sign bits are not part of the result (xorsign).
template <int IN>
KVW_HD u32 pk_max_abs(u32 a, u32 b) {
  u32 r;
#if __CUDA_ARCH__ >= 860
  if constexpr (IN == DT_BF16)
    asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  else
    asm("max.NaN.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#else
  a &= 0x7FFF7FFFu;
  b &= 0x7FFF7FFFu;
  if constexpr (IN == DT_BF16)
    asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  else
    asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#endif
  return r;
}
template <int IN>
KVW_HD u32 pk_min(u32 a, u32 b) {
  u32 r;
  if constexpr (IN == DT_BF16)
    asm("min.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  else
    asm("min.NaN.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
template <int IN>
KVW_HD u32 pk_max(u32 a, u32 b) {
  u32 r;
  if constexpr (IN == DT_BF16)
    asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  else
    asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// Four code bytes (the low byte of each argument) in one word, byte 0 first.
KVW_HD u32 bytes4(u32 b0, u32 b1, u32 b2, u32 b3) {
  return __byte_perm(__byte_perm(b0, b1, 0x0040u), __byte_perm(b2, b3, 0x0040u), 0x5410u);
}

// Stores one chunk of N code bytes as N / SW accesses of SW bytes (SW: what the cache rows'
// alignment allows; the chunk's input loads are as wide as the input's allows).
template <int N, int SW>
KVW_HD void store_parts(u8* p, const Raw<N>& r) {
  if constexpr (SW >= N) {
    store_raw<N>(p, r);
  } else {
#pragma unroll
    for (int k = 0; k < N / SW; ++k) {
      Raw<SW> part;
      if constexpr (SW >= 4) {
#pragma unroll
        for (int w = 0; w < SW / 4; ++w) part.w[w] = r.w[k * (SW / 4) + w];
      } else {
        part.w[0] = r.w[(k * SW) >> 2] >> (((k * SW) & 3) * 8);
      }
      store_raw<SW>(p + k * SW, part);
    }
  }
}

// store_parts with SW = 2^shift (a fixed argument: a constant in specialized builds).
template <int N>
KVW_HD void store_chunk(u8* p, const Raw<N>& r, i64 shift) {
  if (N <= 1 || (1 << shift) >= N) {
    store_raw<N>(p, r);
  } else if (N > 8 && shift == 3) {
    store_parts<N, (N > 8 ? 8 : N)>(p, r);
  } else if (N > 4 && shift == 2) {
    store_parts<N, (N > 4 ? 4 : N)>(p, r);
  } else if (shift == 1) {
    store_parts<N, (N > 2 ? 2 : N)>(p, r);
  } else {
    store_parts<N, 1>(p, r);
  }
}

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
  constexpr int NW = VEC * IB >= 4 ? VEC * IB / 4 : 1;  // input words per chunk
  // 16-bit element pairs reduced by one instruction each (sm_80 on).
#if __CUDA_ARCH__ >= 800
  constexpr bool PACKED = IN != DT_F32;
#else
  constexpr bool PACKED = false;
#endif
  constexpr u32 FULL = 0xFFFFFFFFu;
  const float INF = bits_f32(0x7F800000u);
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
  // Rows past the last token read the last token's (no predicate on the loads; nothing of
  // theirs is stored).
  const i64 t = active ? static_cast<i64>(t32) : num_tokens - 1;
  const i64 h = th - t32 * static_cast<u32>(num_heads);
  const i64 d = is_v ? dv : dk;
  const u8* src = is_v ? value + (t * v_tok + h * v_head) * IB : key + (t * k_tok + h * k_head) * IB;
  // Every chunk of every lane lies in both rows (a constant in specialized builds).
  const bool full = static_cast<i64>(lanes) * (CPL * VEC) <= (dk < dv ? dk : dv);

  Raw<VEC * IB> in[CPL];
  bool in_row[CPL];  // the chunk lies in the row
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const i64 c = static_cast<i64>(lane) + static_cast<i64>(i) * lanes;
    in_row[i] = full || c * VEC < d;
    if (in_row[i]) {
      in[i] = load_raw<VEC * IB>(src + c * VEC * IB);
    } else {
#pragma unroll
      for (int k = 0; k < NW; ++k) in[i].w[k] = 0;
    }
  }
  // The slot after the row (load_index: nothing computed from it is placed before the row's
  // loads). Its width is a fixed argument, a constant in specialized builds.
  const i64 slot = slot64 ? load_index(static_cast<const long long*>(slot_mapping) + t)
                          : static_cast<i64>(load_index(static_cast<const int*>(slot_mapping) + t));

  // The row's amax (int8, fp8) or min and max (int4), NaN propagating: they decide whether the
  // row takes the fast path (see "The fast path" above) and are its scale's inputs there.
  // Chunks past the row: zeros (amax) or left out (min, max).
  float r_a = 0.0f, r_lo = INF, r_hi = -INF;
  if constexpr (MODE == PTH_INT4) {
    if constexpr (PACKED && VEC >= 2) {
      const u32 pinf = IN == DT_BF16 ? 0x7F807F80u : 0x7C007C00u;
      u32 lo2 = pinf, hi2 = pinf | 0x80008000u;
#pragma unroll
      for (int i = 0; i < CPL; ++i)
        if (in_row[i]) {
#pragma unroll
          for (int k = 0; k < NW; ++k) {
            lo2 = pk_min<IN>(lo2, in[i].w[k]);
            hi2 = pk_max<IN>(hi2, in[i].w[k]);
          }
        }
      const Raw<4> l{{lo2}}, u{{hi2}};
      r_lo = nmin(elem_f32<IN>(l, 0), elem_f32<IN>(l, 1));
      r_hi = nmax(elem_f32<IN>(u, 0), elem_f32<IN>(u, 1));
    } else {
#pragma unroll
      for (int i = 0; i < CPL; ++i)
        if (in_row[i]) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float x = elem_f32<IN>(in[i], j);
            r_lo = nmin(r_lo, x);
            r_hi = nmax(r_hi, x);
          }
        }
    }
    for (u32 m = lanes >> 1; m >= 1u; m >>= 1) {
      r_lo = nmin(r_lo, __shfl_xor_sync(FULL, r_lo, m));
      r_hi = nmax(r_hi, __shfl_xor_sync(FULL, r_hi, m));
    }
  } else {
    if constexpr (PACKED) {
      u32 a2 = 0;
#pragma unroll
      for (int i = 0; i < CPL; ++i)
#pragma unroll
        for (int k = 0; k < NW; ++k) a2 = pk_max_abs<IN>(a2, in[i].w[k]);
      const Raw<4> a{{a2}};
      r_a = nmax(fabsf(elem_f32<IN>(a, 0)), fabsf(elem_f32<IN>(a, 1)));
    } else {
#pragma unroll
      for (int i = 0; i < CPL; ++i)
#pragma unroll
        for (int j = 0; j < VEC; ++j) r_a = nmax(r_a, fabsf(elem_f32<IN>(in[i], j)));
    }
    for (u32 m = lanes >> 1; m >= 1u; m >>= 1) r_a = nmax(r_a, __shfl_xor_sync(FULL, r_a, m));
  }
  // Rows that store nothing (past the last token, or a slot out of range or padding) take
  // either path; the slot's test here also keeps its load up with the row's (a load whose value
  // is only used at the stores is issued there, its round trip after the arithmetic).
  // KVWRITE_PTH_GENERAL_ONLY sends every row down the general path (tests: its bytes on
  // ordinary rows); KVWRITE_PTH_FAST_ONLY leaves the general path out (machine-code counts
  // only: wrong on NaN and infinite rows).
  const bool stores = active && static_cast<u64>(slot) < static_cast<u64>(num_slots);  // >= 0
#if defined(KVWRITE_PTH_GENERAL_ONLY)
  const bool fast = false;
#elif defined(KVWRITE_PTH_FAST_ONLY)
  const bool fast = stores;  // and no general path below
#else
  const bool fast =
      !stores || (MODE == PTH_INT4 ? fast_int4_row(r_lo, r_hi) : fast_amax_row(r_a));
#endif
  // The lanes of the rows that take the general path (whole rows: their shuffles' lanes).
  const u32 general = __ballot_sync(FULL, !fast);

  Raw<OUT_N> out[CPL];
  u32 entry;
  if (fast) {
    float s, zc = 0.0f;
    if constexpr (MODE == PTH_INT4) {
      s = fast_int4_scale(r_lo, r_hi);
    } else {
      s = fast_amax_scale<MODE, STEPS>(r_a);
    }
    const float y = fast_rcp(s);
    entry = f32_bits(s);
    bool unclamped = false;
    if constexpr (MODE == PTH_INT4) {
      const u32 zp = fast_int4_zero_point<STEPS>(r_lo, s, y);
      entry = (f32_bits(s) & 0xFFFFFFF0u) | (zp & 0xFu);
      zc = fast_int4_zc(zp);
      unclamped = fast_int4_top<STEPS>(r_hi, s, y, zc);
    }
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      if constexpr (MODE == PTH_INT8) {
        u32 b[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j)
          b[j] = fast_int8_code(fast_quotient<STEPS>(elem_f32<IN>(in[i], j), s, y));
        if constexpr (VEC >= 4) {
#pragma unroll
          for (int k = 0; k < VEC / 4; ++k)
            out[i].w[k] = bytes4(b[4 * k], b[4 * k + 1], b[4 * k + 2], b[4 * k + 3]);
        } else if constexpr (VEC == 2) {
          out[i].w[0] = __byte_perm(b[0], b[1], 0x0040u);
        } else {
          out[i].w[0] = b[0];
        }
      } else if constexpr (MODE == PTH_FP8) {
#pragma unroll
        for (int k = 0; k < (OUT_N + 3) / 4; ++k) out[i].w[k] = 0;
#pragma unroll
        for (int j = 0; j < VEC; j += 2) {
          const float x0 = elem_f32<IN>(in[i], j);
          const float x1 = j + 1 < VEC ? elem_f32<IN>(in[i], j + 1) : 0.0f;
          const float v0 = fast_fp8_signed(fast_quotient<STEPS>(x0, s, y), x0);
          const float v1 = fast_fp8_signed(fast_quotient<STEPS>(x1, s, y), x1);
          out[i].w[j >> 2] |= fp8x2_from_f32<DT_E4M3>(v0, v1) << ((j & 2) * 8);
        }
      } else if constexpr (INT4_PAIRS) {
        out[i].w[0] = fast_int4_bits(fast_quotient<STEPS>(elem_f32<IN>(in[i], 0), s, y), zc) & 0xFu;
      }
    }
    if constexpr (MODE == PTH_INT4 && !INT4_PAIRS) {
      // Without the top clamp where no code of the row reaches 16 (fast_int4_top: nearly every
      // row; one instruction less per element), with it otherwise.
      // (A macro, not a generic lambda: NVRTC 13.0 takes an unannotated generic lambda in device
      // code for a host function and refuses it in JIT mode.)
#define KVW_PTH_INT4_CODES(CLAMP)                                                       \
  _Pragma("unroll") for (int i = 0; i < CPL; ++i) {                                      \
    u32 tb[VEC];                                                                         \
    _Pragma("unroll") for (int j = 0; j < VEC; ++j) tb[j] = fast_int4_bits<CLAMP>(       \
        fast_quotient<STEPS>(elem_f32<IN>(in[i], j), s, y), zc);                        \
    out[i].w[0] = fast_int4_pack<VEC>(tb);                                               \
  }
#ifdef KVWRITE_PTH_COUNT_UNCLAMPED
      KVW_PTH_INT4_CODES(false)  // machine-code counts of the unclamped loop alone
#else
      if (unclamped) {
        KVW_PTH_INT4_CODES(false)
      } else {
        KVW_PTH_INT4_CODES(true)
      }
#endif
    }
  }
#ifndef KVWRITE_PTH_FAST_ONLY
  else {
    // The general path (any row): the rule's arithmetic step by step, NaN and infinities
    // handled; its own NaN-ignoring reductions. Past the row int4 takes NaN, which its min and
    // max ignore; int8 and fp8 take the zeros loaded there, which leave the amax as it is.
    float s, mn = 0.0f;
    if constexpr (MODE == PTH_INT4) {
      float lo = INF, hi = -INF;
#pragma unroll
      for (int i = 0; i < CPL; ++i)
        if (in_row[i]) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float x = elem_f32<IN>(in[i], j);
            lo = min_step(lo, x);
            hi = max_step(hi, x);
          }
        }
      for (u32 m = lanes >> 1; m >= 1u; m >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(general, lo, m));
        hi = fmaxf(hi, __shfl_xor_sync(general, hi, m));
      }
      s = int4_scale(lo, hi);
      mn = lo;
    } else {
      float a = 0.0f;
#pragma unroll
      for (int i = 0; i < CPL; ++i)
#pragma unroll
        for (int j = 0; j < VEC; ++j) a = amax_step(a, elem_f32<IN>(in[i], j));
      for (u32 m = lanes >> 1; m >= 1u; m >>= 1) a = fmaxf(a, __shfl_xor_sync(general, a, m));
      s = amax_scale(a, MODE == PTH_INT8 ? 127.0f : 448.0f);
    }
    const Fp8Scale sc = fp8_exact_scale<true>(s);
    entry = f32_bits(s);
    float zp = 0.0f;
    if constexpr (MODE == PTH_INT4) {
      zp = int4_zero_point<STEPS>(mn, sc);
      entry = int4_entry(s, zp);
    }
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      // The chunk's words through an opaque copy: the elements are converted again here rather
      // than kept from the reductions above (registers: the general path's would otherwise set
      // the kernel's count, which the fast path's occupancy pays for).
      Raw<VEC * IB> w;
#pragma unroll
      for (int k = 0; k < NW; ++k) asm volatile("mov.b32 %0, %1;" : "=r"(w.w[k]) : "r"(in[i].w[k]));
      float x[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        x[j] = MODE != PTH_INT4 || in_row[i] ? elem_f32<IN>(w, j) : bits_f32(0x7FC00000u);
      if constexpr (MODE == PTH_FP8) {
        fp8_quantize<DT_E4M3, VEC, STEPS>(x, out[i].w, sc);
      } else if constexpr (MODE == PTH_INT8) {
#pragma unroll
        for (int k = 0; k < (OUT_N >= 4 ? OUT_N / 4 : 1); ++k) out[i].w[k] = 0;
#pragma unroll
        for (int j = 0; j < VEC; ++j)
          out[i].w[j >> 2] |= int8_code(int8_quotient<STEPS>(x[j], sc)) << ((j & 3) * 8);
      } else if constexpr (INT4_PAIRS) {
        out[i].w[0] = int4_code(fp8_quotient<STEPS>(x[0], sc), zp);
      } else {
#pragma unroll
        for (int k = 0; k < (OUT_N >= 4 ? OUT_N / 4 : 1); ++k) out[i].w[k] = 0;
#pragma unroll
        for (int j = 0; j < VEC; j += 2) {
          const u32 b = int4_code(fp8_quotient<STEPS>(x[j], sc), zp) |
                        (int4_code(fp8_quotient<STEPS>(x[j + 1], sc), zp) << 4);
          out[i].w[(j >> 1) >> 2] |= b << (((j >> 1) & 3) * 8);
        }
      }
    }
  }
#endif
  if constexpr (INT4_PAIRS) {
#pragma unroll
    for (int i = 0; i < CPL; ++i)  // the odd element's code, from lane + 1
      out[i].w[0] |= __shfl_down_sync(FULL, out[i].w[0], 1) << 4;
  }

  if (!stores) return;
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
    if (in_row[i]) {
      if constexpr (INT4_PAIRS) {
        if ((c & 1) == 0) store_raw<1>(dst + (c >> 1), out[i]);
      } else {
        store_chunk<OUT_N>(dst + c * OUT_N, out[i], store_shift);
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
