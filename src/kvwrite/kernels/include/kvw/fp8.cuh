// fp8 quantization (the fp8 rule): software conversion, the satfinite hardware conversion, and the
// exact quotient x / s without a division per element. Shared by every op's kernel.
#pragma once
#include "kvw/common.cuh"

// -DKVWRITE_EXACT_DIV makes `fp8_quantize` divide each element with div.rn.f32 instead of the
// division-free quotient below (both are bit-exact; the option exists for comparison).

// ------------------------------------------------------------------------------------------
// float32 -> fp8, software: round to nearest even, saturate to the largest finite value (±inf
// too), NaN -> NaN (sign|0x7F), sign of zero kept, subnormals rounded. Exactly
// `x.clamp(-MAX, MAX).to(fp8)` (the fp8 rule), i.e. CUDA's __NV_SATFINITE conversion.
// FMT is DT_E4M3 (e4m3fn: bias 7, 3 mantissa bits, max 448 = 0x7E) or DT_E5M2 (bias 15,
// 2 mantissa bits, max 57344 = 0x7B). Returns the byte in the low 8 bits.
// ------------------------------------------------------------------------------------------
template <int FMT>
KVW_HD u32 fp8_from_f32_soft(float x) {
  constexpr u32 MAN = FMT == DT_E4M3 ? 3 : 2;
  constexpr u32 BIAS = FMT == DT_E4M3 ? 7 : 15;
  constexpr u32 MAX_F32_BITS = FMT == DT_E4M3 ? 0x43E00000u : 0x47600000u;  // 448, 57344
  constexpr u32 MAX_CODE = FMT == DT_E4M3 ? 0x7Eu : 0x7Bu;
  constexpr u32 MIN_NORMAL_F32_BITS = (127u + 1u - BIAS) << 23;  // 2^(1 - BIAS)
  const u32 b = f32_bits(x);
  const u32 sign = (b >> 24) & 0x80u;
  const u32 a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7Fu;  // NaN
  // Clamping then rounding equals rounding then saturating: MAX is representable and rounding
  // is monotone. Inputs below MAX never round past it (the next step up is >= MAX's midpoint).
  if (a >= MAX_F32_BITS) return sign | MAX_CODE;
  if (a >= MIN_NORMAL_F32_BITS) {
    // Round the float32 bits to MAN mantissa bits (a carry moves into the exponent, as it
    // should), then rebias the exponent.
    constexpr u32 SH = 23 - MAN;
    const u32 r = a + ((1u << (SH - 1)) - 1u) + ((a >> SH) & 1u);
    return sign | ((r >> SH) - ((127u - BIAS) << MAN));
  }
  // fp8 subnormal range: the code is k = round(|x| / 2^(1 - BIAS - MAN)), k in [0, 2^MAN]
  // (k == 2^MAN is the smallest normal, whose code is exactly 2^MAN). |x| = m * 2^(e - 150).
  const u32 e_field = a >> 23;
  const u32 m = (a & 0x7FFFFFu) | (e_field ? 0x800000u : 0u);
  const u32 e = e_field ? e_field : 1u;
  const u32 sh = 151u - BIAS - MAN - e;  // >= 21: m < 2^24, so no overflow below
  if (sh >= 26) return sign;             // |x| < 2^-1 units: rounds to zero
  const u32 r = m + ((1u << (sh - 1)) - 1u) + ((m >> sh) & 1u);
  return sign | (r >> sh);
}

// Two fp8 codes: byte 0 = Q(lo), byte 1 = Q(hi) (the order of the elements in memory).
template <int FMT>
KVW_HD u32 fp8x2_from_f32(float lo, float hi) {
#if !defined(KVWRITE_HOST_TEST) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  u16 r;
  if (FMT == DT_E4M3)
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return fp8_from_f32_soft<FMT>(lo) | (fp8_from_f32_soft<FMT>(hi) << 8);
#endif
}

// RN(1 / b) for b in [2^-22, 4) (make_fp8_scale's s2), branch-free. div.rn.f32 wraps the same
// arithmetic in a range check (FCHK) and a branch to a slow-path call, which ptxas cannot
// overlap: a thread's two scales were prepared one after the other on every fp8 thread's path.
// Here: the hardware approximation (within 2 ulp in this range), two fused Newton steps, and
// the one significand they miss: for b = (2 - 2^-23) * 2^k, 1/b lies just above the midpoint
// between 2^(-k-1) and its successor, the steps land on 2^(-k-1), and RN(1/b) is the successor.
// tests/test_fp8_division.py checks in C that this is RN(1/b) from every approximation within
// 4 ulp (every significand of [1, 4), every 61st and the all-ones one of each lower binade), and
// on the GPU that make_fp8_scale's y is RN(1 / s2) for every scale of [2, 4) and subnormal ones.
KVW_HD float rcp_rn_s2(float b) {
#ifdef KVWRITE_HOST_TEST
  return 1.0f / b;
#else
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
  r = fma_rn(r, fma_rn(-b, r, 1.0f), r);
  const float y = fma_rn(r, fma_rn(-b, r, 1.0f), r);
  const u32 bb = f32_bits(b);
  return (bb & 0x7FFFFFu) == 0x7FFFFFu ? bits_f32(((253u - (bb >> 23)) << 23) | 1u) : y;
#endif
}

// ------------------------------------------------------------------------------------------
// Power-of-two scales (vLLM's "ue8m0" scales: DeepSeek's indexer, fp8_ds_mla's "pow2" rule):
// the smallest power of two >= s for a positive float32 s, from the bits as DeepSeek's
// fast_log2_ceil does: s itself when its 23 mantissa bits are zero (a power of two, and +inf),
// else 2^(e+1) for s in (2^e, 2^(e+1)) (a carry past 2^127 gives +inf; a subnormal s gives
// 2^-126, which the callers' floors never reach). exp2f(ceilf(log2f(s)))
// is not this: it can return 2^e for s a few ulps above 2^e. Host-testable. The PyTorch and
// Triton twins: kvwrite.dtypes.ue8m0_round_up, kvwrite.kernels.triton_fp8.ue8m0_round_up.
// ------------------------------------------------------------------------------------------
KVW_HD float ue8m0_round_up(float s) {
  u32 b = f32_bits(s);
  if (b & 0x7FFFFFu) b = (b & 0xFF800000u) + 0x00800000u;
  return bits_f32(b);
}

// The exact reciprocal of a power-of-two scale s = 2^k, |k| <= 126 (ue8m0_round_up's results
// above the callers' 1e-4 floors and below 2^127), or 0 for s = +inf. Then RN(x * r) is RN(x / s)
// for every x: both are x * 2^-k rounded once (subnormal results included), and for s = +inf
// x * 0 gives x / inf's ±0 (finite x) and NaN (infinite or NaN x). Host-testable.
KVW_HD float pow2_reciprocal(float s) {
  const u32 e = f32_bits(s) >> 23;  // s > 0: the biased exponent
  return e >= 255u ? 0.0f : bits_f32((254u - e) << 23);
}

// The exact reciprocal of a scale s where s is a positive power of two whose reciprocal is a
// normal float, 2^-126 <= s <= 2^126; else 0: a scale the caller quantizes by the quotient
// (fp8_quantize). Decides, for a scale read at run time (vLLM's default 1.0), whether
// fp8_quantize_pow2's one product an element gives the quotient's codes. Host-testable.
KVW_HD float pow2_scale_reciprocal(float s) {
  const u32 b = f32_bits(s);
  const u32 e = b >> 23;  // with the sign bit: a negative s gives e >= 256
  return (b & 0x7FFFFFu) == 0u && e >= 1u && e <= 253u ? pow2_reciprocal(s) : 0.0f;
}

// fp8_quantize for a power-of-two scale: Q(x) = fp8(RN(x * r)), r = pow2_reciprocal(s), the
// same codes as fp8_quantize's exact quotient at one multiplication an element (measured on an
// H200: fp8_ds_mla's "pow2" rule took 8.97 us against 7.23 for "amax" at T = 16384, hot, through
// the quotient; tuning-log 67).
template <int FMT, int N>
KVW_HD void fp8_quantize_pow2(const float (&x)[N], u32 (&out)[(N + 3) / 4], float r) {
#pragma unroll
  for (int j = 0; j < (N + 3) / 4; ++j) out[j] = 0;
#pragma unroll
  for (int i = 0; i < N; i += 2) {
    const float x1 = i + 1 < N ? x[i + 1] : 0.0f;
    out[i >> 2] |= fp8x2_from_f32<FMT>(mul_rn(x[i], r), mul_rn(x1, r)) << ((i & 2) * 8);
  }
}

// ------------------------------------------------------------------------------------------
// fp8 quantization Q(x) = fp8(RN_f32(x / s)), saturated (the fp8 rule), bit for bit, without a
// division per element.
//
// Per scale (once per thread): for a finite nonzero s = ±1.f * 2^e, m = ±2^(1-e) (2^127 for a
// subnormal s; always a normal float) carries the sign of s, s2 = |s| * |m| lies in [2^-22, 4)
// (exactly), and y = RN(1 / s2). Then x / s = (x * m) / s2, and x' = x * m is exact unless it
// overflows (then |x / s| > 2^126: saturates either way) or underflows (then |x / s| < 2^-104:
// zero either way, and the sign survives the rounding). For s = ±0, ±inf or NaN, m = 1/s
// (±inf, ±0, NaN) and s2 = y = 1, so x' already is ±inf (saturates), ±0 or NaN, as x / s is.
//
// Per element: a = min(|x'|, 2^20), NaN kept (a quotient past 2^18 saturates in both formats,
// and the clamp keeps inf - inf out of the residual); q = RN(a * y); then STEPS corrections
// q = RN(q + RN(a - s2 * q) * y) by fused multiply-adds. For float16 and bfloat16 inputs one step
// gives RN(a / s2) exactly (tests/test_fp8_division.py: every bfloat16 significand against every
// scale significand, every float16 one against every 64th); float32 inputs take two (the first
// leaves q faithful, and the second is then exact by Markstein's theorem). Where a / s2 < 2^-40
// the residual may be subnormal and q inexact, but it stays far below the smallest fp8 rounding
// boundary (2^-17), so the code is zero all the same. The sign of x' is put back last (keeps -0
// and tiny negatives), and the satfinite conversion rounds to nearest even and saturates (NaN
// stays NaN).
// ------------------------------------------------------------------------------------------
//
// The bracket (hardware conversion only, |s| in [2^-100, 2^100]): with r the hardware
// approximation of 1/s (within 1 ulp: 2^-23 relative), r_lo = RN(r * (1 - 2^-20)) and r_hi =
// RN(r * (1 + 2^-20)), the products rounded toward zero lo = RZ(x * r_lo) and hi = RZ(x * r_hi)
// satisfy |lo| < |x / s| < |hi| with the sign of x: |r_lo| <= (1 + 2^-23)(1 - 2^-20)(1 + 2^-24)
// / |s| < 1 / |s|, and |hi| >= |x / s| (1 - 2^-23)(1 + 2^-20)(1 - 2^-24)(1 - 2^-23) > |x / s|.
// lo and hi are floats, so RN(x / s) lies between them too, and the satfinite conversion is
// monotone: where fp8(lo) == fp8(hi), that is Q(x). Where a product underflows, every value
// involved is below 2^-125 and converts to the signed zero of x; where it overflows, RZ gives
// ±FLT_MAX, which saturates as x / s does; NaN converts to NaN either way. So two products and
// two conversions per element decide Q(x) unless an fp8 rounding boundary lies within about
// 2^-20 of x / s (about one element in 10^5 for random data; every exact midpoint, which a power
// of two as s makes common: see below), and only a thread holding such an element computes
// the exact constants and the quotient above. The GPU tests check every 16-bit input under
// per-tensor and per-head scales (tests/test_cuda.py, test_mla.py, test_rope.py).
//
// A power of two s in [2^-126, 2^126] (pow2_scale_reciprocal; outside 2^-100 .. 2^100 too)
// takes the bracket with r_lo = r_hi = 1 / s, exact: then lo = hi = x / s, which is RN(x / s)
// itself wherever it is a normal float; below the normal range both convert to the signed zero
// of x, past FLT_MAX both saturate, as x / s does. So the bracket holds at every element and
// never falls back. Under such a scale every fp8 midpoint a 16-bit x can reach is an exact
// quotient (at s = 1, vLLM's default, one bfloat16 value in 16 is an e4m3 midpoint): with the
// margins, ~40% of the 8-element chunks took the quotient (H200, H = 8, T = 2048, hot L2: 4.43
// -> 2.77 us; tuning-log change 113).
// ------------------------------------------------------------------------------------------
struct Fp8Scale {
  float s;   // the scale itself (for the exact-division build)
  float m;   // ±2^(1-e), or 1/s for zero, infinite and NaN scales
  float s2;  // |s| * |m|, in [2^-22, 4), or 1
  float y;   // RN(1 / s2)
  float r_lo, r_hi;  // the bracket's reciprocals (when bracket)
  bool bracket;      // |s| in [2^-100, 2^100]: fp8_quantize tries the bracket first
  bool lazy;         // m, s2, y not computed (make_fp8_scale<..., true>): fp8_quantize computes
                     // them where an element needs the quotient (a constant at every call site)
};

// Builds that decide Q(x) by the bracket: device code with the hardware conversion, unless a
// comparison build asks for the division (KVWRITE_EXACT_DIV) or the inexact product.
#if !defined(KVWRITE_HOST_TEST) && !defined(KVWRITE_EXACT_DIV) && \
    !defined(KVWRITE_PROBE_INEXACT_QUOTIENT) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define KVW_FP8_BRACKET 1
#else
#define KVW_FP8_BRACKET 0
#endif

// The exact quotient's constants m and s2 of scale s (see above), with y = RN(1 / s2) given.
KVW_HD Fp8Scale fp8_exact_scale_given_y(float s, float y) {
  const u32 sb = f32_bits(s);
  const u32 ab = sb & 0x7FFFFFFFu;
  const float a = bits_f32(ab);
  const u32 e = ab >> 23;  // biased exponent field
  Fp8Scale r;
  r.s = s;
  float m = bits_f32((255u - (e > 1u ? e : 1u)) << 23);
  r.s2 = mul_rn(a, m);
  if (ab == 0u || e == 255u) {  // zero, inf, NaN: m = 1/|s|
    m = ab == 0u ? bits_f32(0x7F800000u) : ab == 0x7F800000u ? 0.0f : a;
    r.s2 = 1.0f;
  }
  r.m = bits_f32(f32_bits(m) | (sb & 0x80000000u));
  r.y = y;
  r.bracket = r.lazy = false;
  r.r_lo = r.r_hi = 0.0f;
  return r;
}

// The exact quotient's constants m, s2, y. BRANCH_FREE: y by rcp_rn_s2.
template <bool BRANCH_FREE = true>
KVW_HD Fp8Scale fp8_exact_scale(float s) {
  Fp8Scale r = fp8_exact_scale_given_y(s, 0.0f);
  r.y = BRANCH_FREE ? rcp_rn_s2(r.s2) : div_rn(1.0f, r.s2);
  return r;
}

// The bracket's relative margin (a test sets 0 to show that its sweep catches a bracket too
// narrow to hold x / s).
#ifndef KVWRITE_FP8_BRACKET_MARGIN
#define KVWRITE_FP8_BRACKET_MARGIN 0x1p-20f
#endif

// What fp8_quantize needs of scale s. BRACKET (in bracket builds): the bracket's reciprocals
// only, from the hardware approximation of 1/s (within 1 ulp, so 2^-23 relative, inside the
// 2^-20 margins: |r_lo| < 1/|s| and |RZ(x * r_hi)| > |x / s|; none for a power of two, see
// "The bracket"); a thread computes the exact
// constants only where an element needs the quotient. Otherwise the exact constants, and
// fp8_quantize compiles to the quotient alone. Measured (H200, docs/tuning-log.md change 33):
// the bracket pays in the reshape kernel's 16- and 32-byte chunks (H=128 T=64 2.77 -> 2.36 us)
// and costs elsewhere (8-byte chunks +1-4%, the MLA and fused RoPE kernels +4-15%), so only
// those chunks ask for it.
template <bool BRANCH_FREE = true, bool BRACKET = false>
KVW_HD Fp8Scale make_fp8_scale(float s) {
#if KVW_FP8_BRACKET
  if (!BRACKET) return fp8_exact_scale<BRANCH_FREE>(s);
  Fp8Scale r;
  r.s = s;
  const u32 ab = f32_bits(s) & 0x7FFFFFFFu;
  const float p2r = pow2_scale_reciprocal(s);  // 1 / s for a power of two, else 0
  // 2^-100 <= |s| <= 2^100, or a power of two
  r.bracket = (ab >= 0x0D800000u && ab <= 0x71800000u) || p2r != 0.0f;
  r.lazy = true;
  float rcp;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(rcp) : "f"(s));
  r.r_lo = p2r != 0.0f ? p2r : mul_rn(rcp, 1.0f - KVWRITE_FP8_BRACKET_MARGIN);
  r.r_hi = p2r != 0.0f ? p2r : mul_rn(rcp, 1.0f + KVWRITE_FP8_BRACKET_MARGIN);
  r.m = r.s2 = r.y = 0.0f;
  return r;
#else
  return fp8_exact_scale<BRANCH_FREE>(s);
#endif
}

template <int STEPS>
KVW_HD float fp8_quotient(float x, const Fp8Scale& sc) {
  const float xs = mul_rn(x, sc.m);
  const float a = min_nan(bits_f32(f32_bits(xs) & 0x7FFFFFFFu), 1048576.0f);  // 2^20
  float q = mul_rn(a, sc.y);
#pragma unroll
  for (int i = 0; i < STEPS; ++i) q = fma_rn(fma_rn(-sc.s2, q, a), sc.y, q);
  return bits_f32(f32_bits(q) | (f32_bits(xs) & 0x80000000u));
}

// Q of N elements (N == 1 or even) into N fp8 codes, byte i of `out` = Q(x[i]) (little endian
// words). STEPS: 1 for 16-bit inputs, 2 for float32 (see above).
template <int FMT, int N, int STEPS>
KVW_HD void fp8_quantize(const float (&x)[N], u32 (&out)[(N + 3) / 4],
                         const Fp8Scale& scale) {
  static_assert(N == 1 || N % 2 == 0, "fp8 chunks hold 1 or an even number of elements");
#if KVW_FP8_BRACKET
  if (scale.bracket) {  // see "The bracket" above
    u32 lo[(N + 3) / 4], hi[(N + 3) / 4];
#pragma unroll
    for (int j = 0; j < (N + 3) / 4; ++j) lo[j] = hi[j] = 0;
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const float x1 = i + 1 < N ? x[i + 1] : 0.0f;
      lo[i >> 2] |= fp8x2_from_f32<FMT>(mul_rz(x[i], scale.r_lo), mul_rz(x1, scale.r_lo))
                    << ((i & 2) * 8);
      hi[i >> 2] |= fp8x2_from_f32<FMT>(mul_rz(x[i], scale.r_hi), mul_rz(x1, scale.r_hi))
                    << ((i & 2) * 8);
    }
    u32 differ = 0;
#pragma unroll
    for (int j = 0; j < (N + 3) / 4; ++j) differ |= lo[j] ^ hi[j];
    if (differ == 0) {
#pragma unroll
      for (int j = 0; j < (N + 3) / 4; ++j) out[j] = lo[j];
      return;
    }
  }
  // Where an element needs the quotient (or the scale is outside the bracket's range).
  const Fp8Scale sc = scale.lazy ? fp8_exact_scale<true>(scale.s) : scale;
#else
  const Fp8Scale& sc = scale;
#endif
#pragma unroll
  for (int j = 0; j < (N + 3) / 4; ++j) out[j] = 0;
#pragma unroll
  for (int i = 0; i < N; i += 2) {
    const float x1 = i + 1 < N ? x[i + 1] : 0.0f;
#ifdef KVWRITE_EXACT_DIV
    const float q0 = div_rn(x[i], sc.s), q1 = div_rn(x1, sc.s);
#elif defined(KVWRITE_PROBE_INEXACT_QUOTIENT)
    // Measurement only (CudaTuning.inexact_quotient): one rounded product by an approximation
    // of 1 / s, as an approximate division computes it; NOT the fp8 rule's quotient.
    const float r = mul_rn(sc.m, sc.y);
    const float q0 = mul_rn(x[i], r), q1 = mul_rn(x1, r);
#else
    const float q0 = fp8_quotient<STEPS>(x[i], sc), q1 = fp8_quotient<STEPS>(x1, sc);
#endif
    out[i >> 2] |= fp8x2_from_f32<FMT>(q0, q1) << ((i & 2) * 8);
  }
}

// ------------------------------------------------------------------------------------------
// 16-bit inputs under a scale in [2^-60, 2^60] (bfloat16) or [2^-60, 1] (float16): Q(x) by a
// clamp of each pair and three float32 operations an element. With y = RN(1 / s): q0 = RN(x *
// y), r = RN(s * q0 - x), q = RN(q0 - r * y) is RN(x / s): the identity fp8_quantize rests on
// (one correction step is exact for 16-bit x, tests/test_fp8_division.py), taken at the scale
// itself instead of at s2 = s * m, which changes every value by the power of two m only; the
// residual's sign is flipped (RN is symmetric), which keeps the sign of zero: x = -0 gives q0 =
// -0, r = +0, q = -0. Nothing under- or overflows where it matters: a quotient that can reach
// an fp8 rounding boundary (>= 2^-18) has a residual that is 0 or at least ulp(s) * ulp(q0) >=
// 2^-126 for s >= 2^-60, and no product overflows after the clamp. The clamp (NaN kept, as a
// canonical NaN: the rule does not fix a NaN's code) bounds |x| by c: bfloat16 2^(E + 17) for
// s in [2^E, 2^(E+1)), where |x / s| > 2^16 saturates in both formats (products below 2^18);
// float16 its largest finite value, which turns +-inf into +-65504, saturating for s <= 1
// (products below 2^77). Host-testable (tests/test_fp8_division.py, every 16-bit input).
// Other scales (negative, zero, tiny, huge, inf, NaN; float32 inputs) take fp8_quantize, whose
// y the struct carries (c2 = 0), so a kernel holds one set of constants for either path.
// ------------------------------------------------------------------------------------------
struct Fp8Fast16 {
  float s;  // the scale
  float y;  // RN(1 / s) where c2 != 0, else the quotient's y = RN(1 / s2) (fp8_fast16_fallback)
  u32 c2;   // the clamp bound c in both halves of a 16-bit pair; 0: s takes the quotient
};

template <int IN>
KVW_HD Fp8Fast16 fp8_fast16_scale(float s) {
  const Fp8Scale q = fp8_exact_scale<true>(s);
  const u32 e = (f32_bits(s) >> 23) & 0xFFu;  // s in range: its biased exponent, 67 .. 187
  const bool ok = IN != DT_F32 && s >= 0x1p-60f && s <= (IN == DT_BF16 ? 0x1p60f : 1.0f);
  Fp8Fast16 f;
  f.s = s;
  f.y = ok ? mul_rn(q.y, q.m) : q.y;  // RN(1 / s2) * 2^(1 - E): RN(1 / s), exactly
  f.c2 = !ok ? 0u : IN == DT_BF16 ? ((e + 17u) << 7) * 0x10001u : 0x7BFF7BFFu;
  return f;
}

// The quotient's constants of a scale that takes it (f.c2 == 0): m and s2 again, y kept.
KVW_HD Fp8Scale fp8_fast16_fallback(const Fp8Fast16& f) {
  return fp8_exact_scale_given_y(f.s, f.y);
}

// A pair of 16-bit elements (IN) with each clamped to [-c, c] (NaN a canonical NaN).
template <int IN>
KVW_HD u32 fp8_fast16_clamp(u32 w, const Fp8Fast16& f) {
#if !defined(KVWRITE_HOST_TEST) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  u32 r;
  const u32 lo = f.c2 | 0x80008000u;  // -c in both halves
  if constexpr (IN == DT_BF16) {
    asm("min.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(w), "r"(f.c2));
    asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(r), "r"(lo));
  } else {
    asm("min.NaN.f16x2 %0, %1, %2;" : "=r"(r) : "r"(w), "r"(f.c2));
    asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(r) : "r"(r), "r"(lo));
  }
  return r;
#else
  // By the bits: 16-bit floats order as sign-magnitude integers.
  u32 r = 0;
  const u32 c = f.c2 & 0x7FFFu, inf = IN == DT_BF16 ? 0x7F80u : 0x7C00u;
  for (int h = 0; h < 2; ++h) {
    u32 v = (w >> (16 * h)) & 0xFFFFu;
    const u32 a = v & 0x7FFFu;
    if (a > inf) v = 0x7FFFu;  // a NaN in both kinds
    else if (a > c) v = (v & 0x8000u) | c;
    r |= v << (16 * h);
  }
  return r;
#endif
}

// Q of N clamped 16-bit elements as float32 (fp8_fast16_clamp, then exact conversions) into N
// fp8 codes, byte i of `out` = Q(x[i]), under f (f.c2 != 0).
template <int FMT, int N>
KVW_HD void fp8_quantize_fast16(const float (&x)[N], u32 (&out)[(N + 3) / 4],
                                const Fp8Fast16& f) {
  static_assert(N == 1 || N % 2 == 0, "fp8 chunks hold 1 or an even number of elements");
#pragma unroll
  for (int j = 0; j < (N + 3) / 4; ++j) out[j] = 0;
#pragma unroll
  for (int i = 0; i < N; i += 2) {
    float q[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const float xk = i + k < N ? x[i + k] : 0.0f;
      const float q0 = mul_rn(xk, f.y);
      const float r = fma_rn(f.s, q0, -xk);
      q[k] = fma_rn(-r, f.y, q0);
    }
    out[i >> 2] |= fp8x2_from_f32<FMT>(q[0], q[1]) << ((i & 2) * 8);
  }
}
