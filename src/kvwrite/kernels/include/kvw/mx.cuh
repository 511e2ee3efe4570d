// The MX group rule (SPEC §10.3, docs/ops/mx.md): 32 elements -> one E8M0 scale byte and 32
// E4M3 codes (mxfp8) or 32 E2M1 codes packed two a byte (mxfp4). Integer work on the amax's
// float32 bits and one exact product per element, so the bytes do not depend on compiler flags.
// Compiles as host C++ with -DKVWRITE_HOST_TEST (tests/test_mx_kernels.py checks it against an
// oracle on the CPU).
//
//   a   = max |x_i| (NaN skipped, +inf counts, from 0)     fmaxf
//   E   = the scale exponent of a (mx_scale_exp)             "ceil" or "floor"
//   v_i = RN(x_i * 2^-E)                                     exact but below 2^-126
//   c_i = E4M3(v_i) (fp8x2_from_f32, satfinite) or E2M1(v_i) (kvw/nvfp4.cuh's codes)
//   scale byte E + 127
#pragma once
#include "kvw/common.cuh"
#include "kvw/fp8.cuh"
#include "kvw/nvfp4.cuh"

#define KVW_MX_GROUP 32

// The scale exponent E of an amax a (>= +0, never NaN) for the element format FP4 (E2M1: M = 6 =
// 1.5 * 2^2) or not (E4M3: M = 448 = 1.75 * 2^8), from a's bits: a = m * 2^k, 1 <= m < 2.
// - a == 0 and every subnormal a: -127. (A subnormal a has k <= -127, so k - e_M + 1 < -127
//   under both rules: no normalization is needed.)
// - a == +inf: 127.
// - "ceil" (floor_rule false): max(-127, k - e_M + [m > m_M]), m > m_M compared on the fraction
//   bits (m_M = 1.75: 0x600000; 1.5: 0x400000).
// - "floor": clamp(k - e_M, -127, 127); k <= 127, so the upper clamp never binds.
template <bool FP4>
KVW_HD int mx_scale_exp(float a, bool floor_rule) {
  constexpr int EM = FP4 ? 2 : 8;
  constexpr u32 MM = FP4 ? 0x400000u : 0x600000u;
  const u32 b = f32_bits(a);
  const u32 e = b >> 23;  // a >= +0: no sign bit
  if (e == 0) return -127;
  if (e == 255) return 127;
  int E = static_cast<int>(e) - 127 - EM;
  if (!floor_rule) E += (b & 0x7FFFFFu) > MM ? 1 : 0;
  return E < -127 ? -127 : E;
}

// 2^-E as a float32, exactly, for E in [-127, 127]: 2^127 .. 2^-126 normal, 2^-127 the
// subnormal 0x00400000. mul_rn (mul.rn.f32, no flush) by it is RN(x / 2^E).
KVW_HD float mx_rcp(int E) {
  return bits_f32(E == 127 ? 0x00400000u : static_cast<u32>(127 - E) << 23);
}

// max |x_i| with NaN skipped, from 0 (the rule's amax): a tree of fmaxf (which returns the
// number for one NaN operand; log2 N dependent steps), then fmaxf with +0, which turns an
// all-NaN group's NaN into 0.
template <int N>
KVW_HD float mx_amax(const float (&x)[N]) {
  float t[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) t[i] = max_num(abs_f(x[i]), abs_f(x[i + N / 2]));
#pragma unroll
  for (int n = N / 4; n >= 1; n >>= 1) {
#pragma unroll
    for (int i = 0; i < n; ++i) t[i] = max_num(t[i], t[i + n]);
  }
  return max_num(t[0], 0.0f);
}

// The codes of N elements (a group, N = 32, or a part of one, N a multiple of 8) for the
// multiplier r = 2^-E as little-endian words: mxfp8 N bytes (N/4 words, element i in byte i),
// mxfp4 N/2 bytes (N/8 words, element 2j in the low nibble of byte j, 2j + 1 in the high one).
// fast (mxfp4 only, mx_fast): kvw/nvfp4.cuh's fast E2M1 path (no clamp at 6, v's own sign: 7
// instructions an element, 9 on the general path), exact under mx_fast's condition.
template <bool FP4, int N>
KVW_HD void mx_codes_n(const float (&x)[N], float r, bool fast, u32 (&out)[FP4 ? N / 8 : N / 4]) {
  static_assert(N % 8 == 0, "whole words of codes");
  if constexpr (FP4) {
    if (fast) {
      nvfp4_pack_n<N, true>(x, r, out);
    } else {
      nvfp4_pack_n<N, false>(x, r, out);
    }
  } else {
#pragma unroll
    for (int w = 0; w < N / 4; ++w) {
      const u32 lo = fp8x2_from_f32<DT_E4M3>(mul_rn(x[4 * w], r), mul_rn(x[4 * w + 1], r));
      const u32 hi = fp8x2_from_f32<DT_E4M3>(mul_rn(x[4 * w + 2], r), mul_rn(x[4 * w + 3], r));
      out[w] = (lo & 0xFFFFu) | (hi << 16);
    }
  }
}

// Whether the mxfp4 codes of a group take the fast E2M1 path: the "ceil" rule and a_nan, the
// group's amax with NaN propagated (nvfp4_amax_nan), times r = 2^-E below 7 (kvw/nvfp4.cuh's
// nvfp4_pack_fast condition: no NaN element, every RN(x_i * r) <= RN(a * r) < 7 since r > 0 and
// rounding is monotone). Under "ceil" every finite group passes (RN(a * r) <= 6); an inf or NaN
// never does (inf * r = inf; NaN compares false). Under "floor" RN(a * r) = 4m lies in [4, 8),
// so about a fifth of random groups would fail: a warp would run both paths, so "floor" keeps
// the general one (floor_rule is compiled in: no test at run time in a specialized build).
KVW_HD bool mx_fast(float a_nan, float r, bool floor_rule) {
  return !floor_rule && mul_rn(a_nan, r) < 7.0f;
}

// The rule's amax from the NaN-propagating one of the same elements: a_nan where it is a
// number, else the NaN-skipping tree (rare).
template <int N>
KVW_HD float mx_amax_from(float a_nan, const float (&x)[N]) {
  return a_nan == a_nan ? a_nan : mx_amax(x);
}

// The codes of a group for the multiplier r = 2^-E (mx_codes_n of 32, the general E2M1 path).
template <bool FP4>
KVW_HD void mx_codes(const float (&x)[KVW_MX_GROUP], float r, u32 (&out)[FP4 ? 4 : 8]) {
  mx_codes_n<FP4, KVW_MX_GROUP>(x, r, false, out);
}

// The whole rule for one group: the codes in `out`, the scale byte E + 127 returned. The
// kernels' path: the NaN-propagating amax, the rule's amax from it, E, then the fast or general
// E2M1 path (mx_fast).
template <bool FP4>
KVW_HD u32 mx_group(const float (&x)[KVW_MX_GROUP], bool floor_rule, u32 (&out)[FP4 ? 4 : 8]) {
  const float a_nan = nvfp4_amax_nan(x);
  const int E = mx_scale_exp<FP4>(mx_amax_from(a_nan, x), floor_rule);
  const float r = mx_rcp(E);
  mx_codes_n<FP4, KVW_MX_GROUP>(x, r, FP4 && mx_fast(a_nan, r, floor_rule), out);
  return static_cast<u32>(E + 127);
}
