// The NVFP4 group rule (docs/ops/nvfp4.md): 16 elements -> 16 E2M1 codes and one E4M3 scale,
// with the per-tensor scale k. Every step of the rule is one IEEE float32 operation rounded to
// nearest even, written with the explicit .rn instructions of kvw/common.cuh (no contraction, no
// flush to zero), so the bytes do not depend on compiler flags. Compiles as host C++ with
// -DKVWRITE_HOST_TEST (tests/test_nvfp4.py checks it against the PyTorch reference on the CPU).
//
//   a = max |x_i| (NaN skipped, from 0)     fmaxf
//   s = RN(a / RN(6k))                      kvw/fp8.cuh's exact quotient (no division)
//   S = E4M3(s), saturating                 fp8x2_from_f32 (satfinite)
//   d = RN(float(S) * k)
//   r = 0 if d == 0 else RN(1 / d)          nvfp4_rcp_rn: rcp_rn_s2 on d's significand
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
#pragma once
#include "kvw/common.cuh"
#include "kvw/fp8.cuh"

#ifdef KVWRITE_HOST_TEST
KVW_HD float add_rn(float a, float b) { return a + b; }
KVW_HD float sub_rn(float a, float b) { return a - b; }
KVW_HD float min_num(float a, float b) { return __builtin_fminf(a, b); }
KVW_HD float max_num(float a, float b) { return __builtin_fmaxf(a, b); }
#else
KVW_HD float add_rn(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
KVW_HD float sub_rn(float a, float b) {
  float r;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
KVW_HD float min_num(float a, float b) { return fminf(a, b); }
KVW_HD float max_num(float a, float b) { return fmaxf(a, b); }
#endif

#ifdef KVWRITE_HOST_TEST
KVW_HD float abs_f(float a) { return __builtin_fabsf(a); }
#else
KVW_HD float abs_f(float a) { return fabsf(a); }
#endif

// 2^23 + E2M1(m) as a float (its bits: 0x4B000000 | code) for m in [0, 6].
KVW_HD float nvfp4_e2m1_t(float m) {
  const float l1 = fma_rn(m, 2.0f, 8388608.0f);   // RN(2m + 2^23)
  const float l2 = add_rn(m, 8388610.0f);         // RN(m + 2 + 2^23)
  const float l3 = fma_rn(m, 0.5f, 8388612.0f);   // RN(m/2 + 4 + 2^23)
  return min_num(min_num(l1, l2), l3);
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

// RN(1 / d) for d in [2^-125, 2^125] (every d = float(S) * k with k in [2^-100, 2^100]): 1/b of
// d's significand b in [1, 2) by rcp_rn_s2, times the power of two, exactly. 0 for d == 0.
KVW_HD float nvfp4_rcp_rn(float d) {
  const u32 db = f32_bits(d);
  const u32 e = (db >> 23) & 0xFFu;
  const float y = rcp_rn_s2(bits_f32((db & 0x807FFFFFu) | 0x3F800000u));
  const float r = mul_rn(y, bits_f32(((254u - e) & 0xFFu) << 23));
  return d == 0.0f ? 0.0f : r;
}

// E4M3 code of RN(a / c) (a >= 0) for the denominator constants `den` (make_fp8_scale of
// RN(c * k)), saturating at 448.
template <int STEPS>
KVW_HD u32 nvfp4_scale_code(float a, const Fp8Scale& den) {
  return fp8x2_from_f32<DT_E4M3>(fp8_quotient<STEPS>(a, den), 0.0f) & 0xFFu;
}

// One candidate: the scale code S and the reciprocal r of d = RN(float(S) * k); d itself in *d.
template <int STEPS>
KVW_HD u32 nvfp4_candidate(float a, float k, const Fp8Scale& den, float* r, float* d) {
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

// The 16 codes of a group as two little-endian words (element 2j in the low nibble of byte j).
// Horner's scheme from the last element down, mod 2^32: acc = (acc * 2 + sign) * 8 + t bits,
// one funnel shift and one multiply-add an element; the t bits' constant 0x4B000000 parts sum to
// 0x4B000000 * (1 + 16) = 0xFB000000 (mod 2^32; the rest shift out), taken off at the end.
KVW_HD void nvfp4_pack(const float (&x)[16], float r, u32 (&out)[2]) {
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    u32 acc = 0;
#pragma unroll
    for (int i = 7; i >= 0; --i) {
      float m, sgn;
      nvfp4_split(mul_rn(x[8 * w + i], r), &m, &sgn);
      acc = nvfp4_shift_in_sign(acc, f32_bits(sgn)) * 8u + f32_bits(nvfp4_e2m1_t(m));
    }
    out[w] = acc - 0xFB000000u;
  }
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
// c = 4 one iff its error is lower). den6/den4: make_fp8_scale of RN(6k) / RN(4k). Returns S.
template <bool FOUR_OVER_SIX, int STEPS>
KVW_HD u32 nvfp4_group(const float (&x)[16], float k, const Fp8Scale& den6, const Fp8Scale& den4,
                       u32 (&out)[2]) {
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
// own sign bit is the code's. Per element: one product, the three lines, two minima, a funnel
// shift and a multiply-add.
KVW_HD void nvfp4_pack_fast(const float (&x)[16], float r, u32 (&out)[2]) {
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    u32 acc = 0;
#pragma unroll
    for (int i = 7; i >= 0; --i) {
      const float v = mul_rn(x[8 * w + i], r);
      acc = nvfp4_shift_in_sign(acc, f32_bits(v)) * 8u + f32_bits(nvfp4_e2m1_t(abs_f(v)));
    }
    out[w] = acc - 0xFB000000u;
  }
}

// Two groups at once (a key's and a value's), step by step in lockstep: the same bytes as two
// nvfp4_group calls, but the machine code consumes both groups' inputs from the first step, so
// the scheduler issues both groups' loads before waiting for either (run one after the other,
// ptxas placed the second group's loads after the first group's rule). Returns S in *sa / *sb.
template <bool FOUR_OVER_SIX, int STEPS>
KVW_HD void nvfp4_group_pair(const float (&xa)[16], const float (&xb)[16], float ka, float kb,
                             const Fp8Scale& a6, const Fp8Scale& a4, const Fp8Scale& b6,
                             const Fp8Scale& b4, u32 (&outa)[2], u32 (&outb)[2], u32* sa,
                             u32* sb) {
  // amax with NaN propagated (max.NaN costs what fmaxf does): a NaN amax says the group holds a
  // NaN, and only then is amax taken again with NaN skipped (the rule's), and the codes by the
  // general path.
  // A tree (4 dependent steps, not 16: small calls wait on this chain); max is associative.
  float ta[8], tb[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    ta[i] = max_nan(abs_f(xa[i]), abs_f(xa[i + 8]));
    tb[i] = max_nan(abs_f(xb[i]), abs_f(xb[i + 8]));
  }
#pragma unroll
  for (int n = 4; n >= 1; n >>= 1) {
#pragma unroll
    for (int i = 0; i < n; ++i) {
      ta[i] = max_nan(ta[i], ta[i + n]);
      tb[i] = max_nan(tb[i], tb[i + n]);
    }
  }
  float amax = ta[0], bmax = tb[0];  // |x| >= +0: the max from 0
  const bool nan_in = amax != amax || bmax != bmax;
  if (nan_in) {
    amax = bmax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      amax = max_num(amax, abs_f(xa[i]));
      bmax = max_num(bmax, abs_f(xb[i]));
    }
  }
  // Both scale codes from one conversion of the two quotients.
  const u32 s2 = fp8x2_from_f32<DT_E4M3>(fp8_quotient<STEPS>(amax, a6),
                                         fp8_quotient<STEPS>(bmax, b6));
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
