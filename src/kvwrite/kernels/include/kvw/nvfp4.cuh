// The NVFP4 group rule (docs/ops/nvfp4.md): 16 elements -> 16 E2M1 codes and one E4M3 scale,
// with the per-tensor scale k. Every step of the rule is one IEEE float32 operation rounded to
// nearest even, written with the explicit .rn instructions of kvw/common.cuh (no contraction, no
// flush to zero), so the bytes do not depend on compiler flags. Compiles as host C++ with
// -DKVWRITE_HOST_TEST (tests/test_nvfp4.py checks it against the PyTorch reference on the CPU).
//
//   a = max |x_i| (NaN skipped, from 0)     fmaxf
//   s = RN(a / RN(6k))                      kvw/fp8.cuh's exact quotient (no division), with
//                                           nvfp4_den's constants
//   S = E4M3(s), saturating                 fp8x2_from_f32 (satfinite)
//   d = RN(float(S) * k)
//   r = 0 if d == 0 else RN(1 / d)          nvfp4_rcp_rn: rcp_rn_s2's steps on d
//   c_i = E2M1(RN(x_i * r))                 nvfp4_e2m1_t below
//
// E2M1 without comparisons: with m = min(|v|, 6) (fminf returns the number for a NaN, so NaN
// becomes 6 and takes code 7) and the sign bit of min(v, 6) (none for NaN), the code of m is
// RNE(f(m)) with f(m) = min(2m, m + 2, m/2 + 4), the concave line through the E2M1 grid (0, 0.5,
// 1, 1.5, 2, 3, 4, 6 -> 0..7). Its midpoints are the rule's thresholds, and the ties land on the
// even code exactly as the thresholds say (0.25 -> 0, 0.75 -> 2, 1.25 -> 2, 1.75 -> 4, 2.5 -> 4,
// 3.5 -> 6, 5 -> 6). Each line plus 2^23 is rounded once to an integer (one fma or add of an
// exact product: 2m and m/2 are exact, so fused and separate give the same bits), the smallest
// of the three is RNE(f(m)) + 2^23 because rounding is monotone, and its low bits are the code.
// The three lines are positive floats (at least 2^23, never NaN), whose order is the order of
// their bits as unsigned integers: the smallest is one three-input integer minimum (sm_90's
// VIMNMX3; two float minima before).
#pragma once
#include "kvw/common.cuh"
#include "kvw/fp8.cuh"

#ifdef KVWRITE_HOST_TEST
KVW_HD float min_num(float a, float b) { return __builtin_fminf(a, b); }
KVW_HD float max_num(float a, float b) { return __builtin_fmaxf(a, b); }
#else
KVW_HD float min_num(float a, float b) { return fminf(a, b); }
KVW_HD float max_num(float a, float b) { return fmaxf(a, b); }
#endif

#ifdef KVWRITE_HOST_TEST
KVW_HD float abs_f(float a) { return __builtin_fabsf(a); }
#else
KVW_HD float abs_f(float a) { return fabsf(a); }
#endif

// The smallest of three unsigned integers.
KVW_HD u32 umin3(u32 a, u32 b, u32 c) {
#ifdef KVWRITE_HOST_TEST
  const u32 ab = a < b ? a : b;
  return ab < c ? ab : c;
#else
  return min(min(a, b), c);
#endif
}

// 2^23 + E2M1(m) as a float (its bits: 0x4B000000 | code) for m in [0, 6]; any m >= 0 (also
// +inf or a NaN: the fast path's products before its check) gives some float, never a trap.
KVW_HD float nvfp4_e2m1_t(float m) {
  const float l1 = fma_rn(m, 2.0f, 8388608.0f);   // RN(2m + 2^23)
  const float l2 = add_rn(m, 8388610.0f);         // RN(m + 2 + 2^23)
  const float l3 = fma_rn(m, 0.5f, 8388612.0f);   // RN(m/2 + 4 + 2^23)
  return bits_f32(umin3(f32_bits(l1), f32_bits(l2), f32_bits(l3)));
}

// For v = RN(x * r): m = min(|v|, 6) (NaN -> 6: code 7) and sgn = min(v, 6), whose sign bit is
// the code's bit 3 (NaN -> 6: no sign; -0 and negative values keep theirs).
KVW_HD void nvfp4_split(float v, float* m, float* sgn) {
  *m = min_num(abs_f(v), 6.0f);
  *sgn = min_num(v, 6.0f);
}

// The 4-bit code of element x (bits 0-2 E2M1 of |RN(x*r)|, bit 3 its sign; NaN -> 0x7).
KVW_HD u32 nvfp4_code(float x, float r) {
  float m, sgn;
  nvfp4_split(mul_rn(x, r), &m, &sgn);
  return (f32_bits(nvfp4_e2m1_t(m)) & 7u) | ((f32_bits(sgn) >> 28) & 8u);
}

// value(c) of a code's magnitude from 2^23 + c: max(c/2, c - 2, 2c - 8), the inverse of the
// lines above (exact: small multiples of 1/2).
KVW_HD float nvfp4_value_mag(float t) {
  const float c = sub_rn(t, 8388608.0f);
  return max_num(max_num(mul_rn(c, 0.5f), sub_rn(c, 2.0f)), sub_rn(mul_rn(c, 2.0f), 8.0f));
}

// float32 value of an e4m3fn code 0..0x7E (exact): its bits as a float32 denormal-or-normal
// pattern scaled by 2^120 (mul.rn.f32 does not flush the denormal ones).
KVW_HD float nvfp4_e4m3_value(u32 code) {
  return mul_rn(bits_f32(code << 20), 1.329227995784916e36f);  // 2^120
}

// RN(1 / d) for d in [2^-109, 2^109) (every nonzero d = float(S) * k with k in [2^-100, 2^100]:
// S >= 2^-9, S <= 448), 0 for d == 0: kvw/fp8.cuh's rcp_rn_s2 applied to d itself. Its steps
// (the hardware approximation, two fused Newton steps, the all-ones significand's fix) are exact
// for every b in [2^-22, 4) (tests/test_fp8_division.py), and each step commutes with scaling by
// a power of two while d, 1/d and the steps' results are normal floats (d * r0 and the residual
// do not change; RN(2^j x) = 2^j RN(x)), which holds here: so they are exact for every d of the
// range (tests/test_nvfp4.py checks the steps in C on every binade of it). Before: rcp_rn_s2 on
// d's significand times the power of two, seven instructions more.
KVW_HD float nvfp4_rcp_rn(float d) {
  const float y = rcp_rn_s2(d);
  return d == 0.0f ? 0.0f : y;
}

// The constants of the scale quotient RN(a / c) for c = RN(C * k) (C = 6, or 4 for 4over6's
// other candidate): kvw/fp8.cuh's exact quotient, whose constants (fp8_exact_scale) are m, a
// power of two with c * m in [2, 4), s2 = c * m and y = RN(1 / s2). For k in [2^-100, 2^100]
// (the contract's range; other scales write unspecified bytes) c is a positive normal float, so
// m is 2^(128 - e) for c's biased exponent e, and the zero, infinite and NaN cases of
// fp8_exact_scale (a dozen instructions per scale and thread) never arise.
struct Nvfp4Den {
  float m, s2, y;
};

KVW_HD Nvfp4Den nvfp4_den(float c) {
  Nvfp4Den d;
  d.m = bits_f32(0x7F800000u - (f32_bits(c) & 0x7F800000u));
  d.s2 = mul_rn(c, d.m);
  d.y = rcp_rn_s2(d.s2);
  return d;
}

// RN(a / c) for an amax a >= 0 (never NaN; +inf saturates) by fp8_quotient's steps: a * m is
// exact (or past 2^20, where the quotient saturates E4M3 anyway), then STEPS corrections (one
// for 16-bit inputs, whose amax has at most 11 significant bits; two for float32). The quotient
// of a >= +0 is >= +0, so fp8_quotient's sign restore is left out.
template <int STEPS>
KVW_HD float nvfp4_quotient(float a, const Nvfp4Den& d) {
  const float x = min_nan(mul_rn(a, d.m), 1048576.0f);  // 2^20
  float q = mul_rn(x, d.y);
#pragma unroll
  for (int i = 0; i < STEPS; ++i) q = fma_rn(fma_rn(-d.s2, q, x), d.y, q);
  return q;
}

// E4M3 code of RN(a / c) (a >= 0) for the denominator constants `den` (nvfp4_den of
// RN(c * k)), saturating at 448.
template <int STEPS>
KVW_HD u32 nvfp4_scale_code(float a, const Nvfp4Den& den) {
  return fp8x2_from_f32<DT_E4M3>(nvfp4_quotient<STEPS>(a, den), 0.0f) & 0xFFu;
}

// r = RN(1 / RN(float(S) * k)) (0 where that product is 0) for a scale code S: the rule's
// reciprocal, a function of S and k only (nvfp4_kv_kernel tabulates it per CTA).
KVW_HD float nvfp4_scale_rcp(u32 S, float k) {
  return nvfp4_rcp_rn(mul_rn(nvfp4_e4m3_value(S), k));
}

// One candidate: the scale code S and the reciprocal r of d = RN(float(S) * k); d itself in *d.
template <int STEPS>
KVW_HD u32 nvfp4_candidate(float a, float k, const Nvfp4Den& den, float* r, float* d) {
  const u32 S = nvfp4_scale_code<STEPS>(a, den);
  *d = mul_rn(nvfp4_e4m3_value(S), k);
  *r = nvfp4_rcp_rn(*d);
  return S;
}

// ((hi:lo) << 1) >> 32: hi shifted left by one with lo's top bit (its sign) in bit 0.
KVW_HD u32 nvfp4_shift_in_sign(u32 hi, u32 lo) {
#ifdef KVWRITE_HOST_TEST
  return (hi << 1) | (lo >> 31);
#else
  return __funnelshift_l(lo, hi, 1);
#endif
}

// The codes of N elements (N a multiple of 4; N = 16 is a group) as little-endian words, 8
// codes a word (element 2j in the low nibble of byte j; N = 4 fills the low 16 bits of one
// word). Horner's scheme from each word's last element down, mod 2^32: acc = (acc * 2 + sign) * 8
// + t bits, one funnel shift and one multiply-add an element; the t bits' constant 0x4B000000
// parts sum to 0x4B000000 * (1 + 16) = 0xFB000000 (mod 2^32; the rest shift out), taken off at
// the end. FAST: nvfp4_pack_fast's conditions hold (see there): no clamp, v's own sign.
template <int N, bool FAST>
KVW_HD void nvfp4_pack_n(const float (&x)[N], float r, u32 (&out)[(N + 7) / 8]) {
  static_assert(N % 4 == 0, "whole bytes of codes");
#pragma unroll
  for (int w = 0; w < (N + 7) / 8; ++w) {
    u32 acc = 0;
#pragma unroll
    for (int i = (N - 8 * w < 8 ? N - 8 * w : 8) - 1; i >= 0; --i) {
      const float v = mul_rn(x[8 * w + i], r);
      if constexpr (FAST) {
        acc = nvfp4_shift_in_sign(acc, f32_bits(v)) * 8u + f32_bits(nvfp4_e2m1_t(abs_f(v)));
      } else {
        float m, sgn;
        nvfp4_split(v, &m, &sgn);
        acc = nvfp4_shift_in_sign(acc, f32_bits(sgn)) * 8u + f32_bits(nvfp4_e2m1_t(m));
      }
    }
    out[w] = acc - 0xFB000000u;
  }
}

// The 16 codes of a group as two words (the general path: any v, NaN and clamp included).
KVW_HD void nvfp4_pack(const float (&x)[16], float r, u32 (&out)[2]) {
  nvfp4_pack_n<16, false>(x, r, out);
}

// 4over6's error of a candidate: sum over i in order of RN(delta_i^2), delta_i =
// RN(RN(value(c_i) * d) - x_i), each addition rounded.
KVW_HD float nvfp4_error(const float (&x)[16], float r, float d) {
  float e = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    float m, sgn;
    nvfp4_split(mul_rn(x[i], r), &m, &sgn);
    const float v = nvfp4_value_mag(nvfp4_e2m1_t(m));
    const float sv = bits_f32(f32_bits(v) | (f32_bits(sgn) & 0x80000000u));
    const float delta = sub_rn(mul_rn(sv, d), x[i]);
    e = add_rn(e, mul_rn(delta, delta));
  }
  return e;
}

// The group rule: amax, then one candidate ("nvfp4") or the better of two ("nvfp4_4over6": the
// c = 4 one iff its error is lower). den6/den4: nvfp4_den of RN(6k) / RN(4k). Returns S.
template <bool FOUR_OVER_SIX, int STEPS>
KVW_HD u32 nvfp4_group(const float (&x)[16], float k, const Nvfp4Den& den6,
                       const Nvfp4Den& den4, u32 (&out)[2]) {
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) a = max_num(a, abs_f(x[i]));
  float r, d;
  u32 S = nvfp4_candidate<STEPS>(a, k, den6, &r, &d);
  if constexpr (FOUR_OVER_SIX) {
    float r4, d4;
    const u32 S4 = nvfp4_candidate<STEPS>(a, k, den4, &r4, &d4);
    if (nvfp4_error(x, r4, d4) < nvfp4_error(x, r, d)) {
      S = S4;
      r = r4;
    }
  }
  nvfp4_pack(x, r, out);
  return S;
}

// max(a, b) that returns NaN when either is NaN (amax's NaN check for free: see nvfp4_group_pair).
KVW_HD float max_nan(float a, float b) {
#ifdef KVWRITE_HOST_TEST
  return (a != a || b != b) ? a + b : __builtin_fmaxf(a, b);
#elif __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? add_rn(a, b) : fmaxf(a, b);
#endif
}

// The fast path of nvfp4_pack, for a group with no NaN element whose largest product RN(a * r)
// is below 7: then every f(|v_i|) < 7.5 rounds to at most 7 without the clamp at 6, and v_i's
// own sign bit is the code's. Per element: one product, the three lines, their integer minimum,
// a funnel shift and a multiply-add.
KVW_HD void nvfp4_pack_fast(const float (&x)[16], float r, u32 (&out)[2]) {
  nvfp4_pack_n<16, true>(x, r, out);
}

// max |x_i| over N elements with NaN propagated (max.NaN costs what fmaxf does): a NaN says the
// elements hold a NaN, and only then is the rule's amax (NaN skipped) taken, by nvfp4_amax_num.
// A tree (log2 N dependent steps: small calls wait on this chain); max is associative. |x| >=
// +0, so the maximum is the rule's "from 0" wherever there is no NaN.
template <int N>
KVW_HD float nvfp4_amax_nan(const float (&x)[N]) {
  float t[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) t[i] = max_nan(abs_f(x[i]), abs_f(x[i + N / 2]));
#pragma unroll
  for (int n = N / 4; n >= 1; n >>= 1) {
#pragma unroll
    for (int i = 0; i < n; ++i) t[i] = max_nan(t[i], t[i + n]);
  }
  return t[0];
}

// nvfp4_amax_nan of a group of 16-bit inputs from its raw words (8 of them; IN16_BF16: bfloat16,
// else float16), where sm_90 has the 16-bit SIMD maximum (VIMNMX(3).U16x2): with the sign bits
// cleared, the order of 16-bit floats is the order of their bits as unsigned integers, and
// every NaN's bits lie above +inf's, so the largest is the amax, NaN where there is one (some
// NaN: only its being NaN is used). The kernel keeps a group's raw words until the rule needs
// its floats, so a thread holding several groups does not hold them widened (float32) through
// the scale's chain.
#if !defined(KVWRITE_HOST_TEST) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Per 16-bit lane: NaN where either lane is NaN, else the larger magnitude (its sign bit the xor
// of the lanes': unspecified to the caller, which clears it). One HMNMX2 (max.NaN.xorsign.abs,
// sm_86+) where the VIMNMX path took a mask of each word first.
template <bool IN16_BF16>
KVW_HD u32 nvfp4_max_abs16(u32 a, u32 b) {
  u32 r;
  if constexpr (IN16_BF16) {
    asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  } else {
    asm("max.NaN.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  }
  return r;
}
#endif

template <bool IN16_BF16>
KVW_HD float nvfp4_amax_nan16(const u32 (&w)[8]) {
#if !defined(KVWRITE_HOST_TEST) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  u32 m[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) m[i] = w[i];
#pragma unroll
  for (int n = 4; n >= 1; n >>= 1) {
#pragma unroll
    for (int i = 0; i < n; ++i) m[i] = nvfp4_max_abs16<IN16_BF16>(m[i], m[i + n]);
  }
  const u32 a = nvfp4_max_abs16<IN16_BF16>(m[0], m[0] >> 16) & 0x7FFFu;
#else
  u32 a = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const u32 h = (w[i >> 1] >> (16 * (i & 1))) & 0x7FFFu;
    a = h > a ? h : a;
  }
#endif
  if constexpr (IN16_BF16) {
    return bits_f32(a << 16);
  } else {
#ifdef KVWRITE_HOST_TEST
    // float16 -> float32 (the host test's bfloat16 path is the one it checks; this is exact too)
    const u32 e = a >> 10, f = a & 0x3FFu;
    if (e == 31) return bits_f32(0x7F800000u | (f << 13));
    if (e == 0) return static_cast<float>(f) * 5.9604644775390625e-08f;  // f * 2^-24, exact
    return bits_f32(((e + 112u) << 23) | (f << 13));
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<u16>(a)));
    return f;
#endif
  }
}

// The rule's amax of N elements: from 0, NaN skipped.
template <int N>
KVW_HD float nvfp4_amax_num(const float (&x)[N]) {
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i) a = max_num(a, abs_f(x[i]));
  return a;
}

// The rule for two groups at once (a key's and a value's) from their NaN-propagating amax
// (nvfp4_amax_nan): the same bytes as two nvfp4_group calls. The kernel takes the amax first
// and tests the slot between the two steps (see kernel.cu). den*: nvfp4_den of RN(6k) (6) and
// RN(4k) (4; 4over6 only). S in *sa / *sb.
template <bool FOUR_OVER_SIX, int STEPS>
KVW_HD void nvfp4_pair_rule(const float (&xa)[16], const float (&xb)[16], float amax, float bmax,
                            float ka, float kb, const Nvfp4Den& a6, const Nvfp4Den& a4,
                            const Nvfp4Den& b6, const Nvfp4Den& b4, u32 (&outa)[2],
                            u32 (&outb)[2], u32* sa, u32* sb) {
  const bool nan_in = amax != amax || bmax != bmax;
  if (nan_in) {  // rare: the rule's amax, NaN skipped
    amax = nvfp4_amax_num(xa);
    bmax = nvfp4_amax_num(xb);
  }
  // Both scale codes from one conversion of the two quotients.
  const u32 s2 = fp8x2_from_f32<DT_E4M3>(nvfp4_quotient<STEPS>(amax, a6),
                                         nvfp4_quotient<STEPS>(bmax, b6));
  u32 Sa = s2 & 0xFFu, Sb = (s2 >> 8) & 0xFFu;
  float da = mul_rn(nvfp4_e4m3_value(Sa), ka), db = mul_rn(nvfp4_e4m3_value(Sb), kb);
  float ra = nvfp4_rcp_rn(da), rb = nvfp4_rcp_rn(db);
  if constexpr (FOUR_OVER_SIX) {
    float ra4, da4, rb4, db4;
    const u32 Sa4 = nvfp4_candidate<STEPS>(amax, ka, a4, &ra4, &da4);
    const u32 Sb4 = nvfp4_candidate<STEPS>(bmax, kb, b4, &rb4, &db4);
    if (nvfp4_error(xa, ra4, da4) < nvfp4_error(xa, ra, da)) {
      Sa = Sa4;
      ra = ra4;
    }
    if (nvfp4_error(xb, rb4, db4) < nvfp4_error(xb, rb, db)) {
      Sb = Sb4;
      rb = rb4;
    }
  }
  if constexpr (FOUR_OVER_SIX) {  // the general path only (half the code to compile)
    nvfp4_pack(xa, ra, outa);
    nvfp4_pack(xb, rb, outb);
  } else {
    nvfp4_pack_fast(xa, ra, outa);
    nvfp4_pack_fast(xb, rb, outb);
    // Rare: a NaN, or a product of 7 or more (an infinite element, a saturated scale, a coarse
    // subnormal one): the general path.
    if (nan_in || !(mul_rn(amax, ra) < 7.0f) || !(mul_rn(bmax, rb) < 7.0f)) {
      nvfp4_pack(xa, ra, outa);
      nvfp4_pack(xb, rb, outb);
    }
  }
  *sa = Sa;
  *sb = Sb;
}

// nvfp4_pair_rule with its amax: the whole rule for two groups.
template <bool FOUR_OVER_SIX, int STEPS>
KVW_HD void nvfp4_group_pair(const float (&xa)[16], const float (&xb)[16], float ka, float kb,
                             const Nvfp4Den& a6, const Nvfp4Den& a4, const Nvfp4Den& b6,
                             const Nvfp4Den& b4, u32 (&outa)[2], u32 (&outb)[2], u32* sa,
                             u32* sb) {
  nvfp4_pair_rule<FOUR_OVER_SIX, STEPS>(xa, xb, nvfp4_amax_nan(xa), nvfp4_amax_nan(xb), ka, kb,
                                        a6, a4, b6, b4, outa, outb, sa, sb);
}

// One part of a group (N = 4 or 8 of its 16 elements: the small calls' kernel spreads a group
// over 16 / N threads) for the nvfp4 rule, from the group's NaN-propagating amax (the parts'
// nvfp4_amax_nan combined by max_nan) and, where that is NaN, the rule's amax (nvfp4_amax_num
// combined by max_num), which the caller passes in `amax_num`: the part's codes (N / 2 bytes,
// little endian) and the group's S (every part computes it). The same bytes as nvfp4_group.
// rcp_of(S): nvfp4_scale_rcp(S, k), computed or looked up (S <= 0x7E: the quotient is >= +0 and
// its conversion saturates).
template <int N, int STEPS, typename RcpOf>
KVW_HD u32 nvfp4_part_rule_by(const float (&x)[N], float amax_nan, float amax_num,
                              const Nvfp4Den& den6, RcpOf rcp_of, u32 (&out)[(N + 7) / 8]) {
  const bool nan_in = amax_nan != amax_nan;
  const float a = nan_in ? amax_num : amax_nan;
  const u32 S = nvfp4_scale_code<STEPS>(a, den6);
  const float r = rcp_of(S);
  nvfp4_pack_n<N, true>(x, r, out);
  if (nan_in || !(mul_rn(a, r) < 7.0f)) nvfp4_pack_n<N, false>(x, r, out);  // rare, as above
  return S;
}

// The "nvfp4" rule for a whole group (N = 16) of one thread (no lane's help for its amax, so the
// rare branch may diverge) from its NaN-propagating amax (nvfp4_amax_nan), in two steps.
// nvfp4_group_fast: the fast path on amax_nan as it is (S in *S, the codes in out); it returns
// whether the group needs nvfp4_group_rare instead: amax_nan is NaN (so RN(a * r) < 7 is false) or
// a product is 7 or more. nvfp4_group_rare: the general path from the rule's amax (NaN skipped).
// Together the same bytes as nvfp4_part_rule<16> (the fast path's S and r are the general path's
// wherever amax_nan is a number). A caller with several groups (nvfp4_kv_kernel: a key's and a
// value's) takes every group's fast path, then one rare branch for them all, so the fast paths are
// one straight run of code. rcp_of as nvfp4_part_rule_by's; it also gets the code of a NaN
// quotient, 0x7F, whose value is unused.
template <int STEPS, typename RcpOf>
KVW_HD bool nvfp4_group_fast(const float (&x)[16], float amax_nan, const Nvfp4Den& den6,
                             RcpOf rcp_of, u32 (&out)[2], u32* S) {
  *S = nvfp4_scale_code<STEPS>(amax_nan, den6);
  const float r = rcp_of(*S);
  nvfp4_pack_n<16, true>(x, r, out);
  return !(mul_rn(amax_nan, r) < 7.0f);
}

template <int STEPS, typename RcpOf>
KVW_HD u32 nvfp4_group_rare(const float (&x)[16], float amax_nan, const Nvfp4Den& den6,
                            RcpOf rcp_of, u32 (&out)[2]) {
  const float a = amax_nan != amax_nan ? nvfp4_amax_num(x) : amax_nan;
  const u32 S = nvfp4_scale_code<STEPS>(a, den6);
  nvfp4_pack_n<16, false>(x, rcp_of(S), out);
  return S;
}

template <int N, int STEPS>
KVW_HD u32 nvfp4_part_rule(const float (&x)[N], float amax_nan, float amax_num, float k,
                           const Nvfp4Den& den6, u32 (&out)[(N + 7) / 8]) {
  return nvfp4_part_rule_by<N, STEPS>(x, amax_nan, amax_num, den6,
                                      [k](u32 S) { return nvfp4_scale_rcp(S, k); }, out);
}
