// The fp8 read rule, shared by every gather that dequantizes (docs/ops/gather.md): D(c, s) decodes
// the fp8 code c to float32 exactly (subnormal codes exact, NaN codes NaN, e5m2's infinity codes
// ±inf), multiplies by the float32 scale s once (IEEE round to nearest even, subnormal products
// kept), and rounds to the output dtype to nearest even (overflow gives ±inf: no saturation).
//
// With -DKVWRITE_HOST_TEST the decode compiles as host C++ (tests compare it with PyTorch's
// decode of all 256 codes on the CPU).
#pragma once
#include "kvw/common.cuh"

// The float32 value of an fp8 code (the low 8 bits of c), exactly. FMT is DT_E4M3 (e4m3fn: bias
// 7, 3 mantissa bits, no infinity, 0x7F/0xFF NaN) or DT_E5M2 (bias 15, 2 mantissa bits, 0x7C
// infinity, 0x7D-0x7F NaN). Normal codes: the exponent and mantissa bits moved into float32's
// fields with the bias difference added (an integer add, exact); subnormal codes: the mantissa as
// an integer times the smallest subnormal (2^-9, 2^-16), a product of normal floats that is exact.
// No subnormal float32 is formed, so no flush-to-zero setting can change a result.
template <int FMT>
KVW_HD float fp8_decode(u32 c) {
  constexpr u32 MAN = FMT == DT_E4M3 ? 3u : 2u;
  constexpr u32 BIAS = FMT == DT_E4M3 ? 7u : 15u;
  constexpr float TINY = FMT == DT_E4M3 ? 0.001953125f : 1.52587890625e-05f;  // 2^-9, 2^-16
  const u32 sign = (c & 0x80u) << 24;
  const u32 em = c & 0x7Fu;
  u32 bits;
  if (FMT == DT_E4M3 ? em == 0x7Fu : em > 0x7Cu) {
    bits = 0x7FC00000u;  // NaN
  } else if (FMT == DT_E5M2 && em == 0x7Cu) {
    bits = 0x7F800000u;  // infinity
  } else if (em >= (1u << MAN)) {
    bits = (em << (23u - MAN)) + ((127u - BIAS) << 23);
  } else {
    bits = f32_bits(mul_rn(static_cast<float>(em), TINY));
  }
  return bits_f32(bits | sign);
}

// D(c, s) in float32: the decoded code times the scale, one IEEE product.
template <int FMT>
KVW_HD float fp8_dequant(u32 c, float s) {
  return mul_rn(fp8_decode<FMT>(c), s);
}

// D(c, s) with the format chosen by `e5m2` (a compile-time constant in a specialized build, where
// this folds to one of the two; generic builds decode both and pick).
KVW_HD float fp8_dequant_any(u32 c, float s, bool e5m2) {
  return mul_rn(e5m2 ? fp8_decode<DT_E5M2>(c) : fp8_decode<DT_E4M3>(c), s);
}

// D(c, s) of the two codes in the low 16 bits of `pair` (byte 0 element 0, byte 1 element 1),
// into lo and hi. On sm_89 and later the decode is the hardware conversion of both codes to
// float16 (cvt.rn.f16x2.e4m3x2 / .e5m2x2: every e4m3 and e5m2 value, subnormals, infinities and
// NaN included, is a float16 value, so the conversion is exact), then float16 -> float32 (exact),
// then the one IEEE product: the same values as fp8_dequant_any's software decode (NaN as NaN)
// in 3 instructions per code instead of about a dozen with a branch. Elsewhere (and as host C++)
// the software decode.
KVW_HD void fp8x2_dequant(u32 pair, float s, bool e5m2, float& lo, float& hi) {
#if !defined(KVWRITE_HOST_TEST) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const u16 in = static_cast<u16>(pair);
  u32 h2;
  if (e5m2) {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h2) : "h"(in));
  } else {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
  }
  float f0, f1;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f0) : "h"(static_cast<u16>(h2)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(f1) : "h"(static_cast<u16>(h2 >> 16)));
  lo = mul_rn(f0, s);
  hi = mul_rn(f1, s);
#else
  lo = fp8_dequant_any(pair & 0xFFu, s, e5m2);
  hi = fp8_dequant_any((pair >> 8) & 0xFFu, s, e5m2);
#endif
}
