// Exact integer roundings in float32 arithmetic (no conversion instructions), shared by the ops
// that quantize to small integer codes: per-token-head int4/int8 (its kernel.cu) and TurboQuant's
// values (SPEC 10.2: clamp(rhu(q), 0, L), §5's round half up).
//
// Integer rounding in float32 arithmetic only, exactly (never floor(v + 0.5) rounded to nearest,
// which takes 0.49999997 to 1), and without conversion instructions (a quarter of the issue
// rate): for y in [0, 2^23), RM(y + 2^23) = RZ(y + 2^23) = 2^23 + floor(y) (the float32 step is 1
// there), whose bits are 0x4B000000 + floor(y). And floor(RZ(y)) = floor(RM(y)) = floor(y) for
// the exact sum y of two floats: a directed rounding never passes the integer below y, which is a
// float. So rhaz(q) = sign(q) floor(|q| + 1/2) and rhu(q) = floor(q + 1/2) take two additions.
#pragma once
#include "kvw/common.cuh"

// Additions rounded toward zero (rz) and toward -inf (rm). The host build (tests) derives them
// from the round-to-nearest sum and its exact error (TwoSum, -ffp-contract=off).
#ifdef KVWRITE_HOST_TEST
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
KVW_F32_ASM2(add_rz, "add.rz.f32")
KVW_F32_ASM2(add_rm, "add.rm.f32")
#endif

KVW_HD float nan_to_zero(float v) { return v == v ? v : 0.0f; }
KVW_HD float clampf(float v, float lo, float hi) { return fminf(fmaxf(v, lo), hi); }

#define KVW_2P23 8388608.0f         // 2^23
#define KVW_2P23_BITS 0x4B000000u  // its bits: floor_bits' bias

// The bits of 2^23 + floor(y) for y in [0, 2^23): KVW_2P23_BITS + floor(y), whose low byte is
// floor(y)'s (0x4B000000 ends with a zero byte).
KVW_HD u32 floor_bits(float y) { return f32_bits(add_rm(y, KVW_2P23)); }

// The bits of 2^23 + rhu(q) = floor(q + 1/2) for q + 1/2 in [0, 2^23): floor_bits(RM(q + 1/2))
// (the sum rounds toward -inf, so its floor is the exact one).
KVW_HD u32 rhu_bits(float q) { return floor_bits(add_rm(q, 0.5f)); }

// clamp(rhu(q) + zp, 0, top) for an integer zp (zc = zp + 1/2, exact) and an integer top <= 255,
// a NaN q counted as 0, in the low byte: floor(clamp(RM(q + zc), 0, top + 1/2)) (the sum rounds
// toward -inf, so its floor is the exact one, and floor is monotone; any q, ±inf included).
KVW_HD u32 rhu_clamp_code(float q, float zc, float top) {
  return floor_bits(clampf(add_rm(nan_to_zero(q), zc), 0.0f, top + 0.5f)) & 0xFFu;
}
