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
