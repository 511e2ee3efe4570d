// RoPE (docs/ops/rotary_embedding.md): the rotation of one unit of a head's row, shared by
// rotary_embedding's and fused_rope_and_reshape_cache_flash's kernels.
//
// A head row of D elements is split into units of W elements (one 16-byte access or less):
// - neox: unit u < HALF / W rotates the chunk at a = u * W with its partner chunk at a + HALF
//   (element i pairs with i + HALF); table entries cos[a .. a + W), sin[...] likewise;
// - GPT-J: unit u < ROT / W rotates the chunk at a = u * W holding W / 2 pairs (2i, 2i + 1);
//   table entries cos[a / 2 .. a / 2 + W / 2);
// - the units after those (rot_units <= u < units_per_head) are the pass-through chunks at
//   ROT + (u - rot_units) * W (partial rotary).
// Pair (x, y) with c, s: x' = RN(RN(x*c) - RN(y*s)), y' = RN(RN(y*c) + RN(x*s)) in float32 with
// explicitly rounded PTX (mul.rn/add.rn/sub.rn are never contracted into an FMA), then rounded to
// nearest even in the row's dtype.
#pragma once
#include "kvw/common.cuh"
#include "kvw/vec_io.cuh"

#ifndef KVWRITE_HOST_TEST

// float32 -> the bits of one element of kind IN (nearest even).
template <int IN>
KVW_HD u32 round_to(float f) {
  if constexpr (IN == DT_F32) {
    return f32_bits(f);
  } else {
    return f16ish_from_f32<IN>(f);
  }
}

// Element i of a zero-initialized chunk of IN elements := bits.
template <int IN, int N>
KVW_HD void put_elem(Raw<N>& r, int i, u32 bits) {
  if constexpr (IN == DT_F32) {
    r.w[i] = bits;
  } else {
    r.w[i >> 1] |= bits << ((i & 1) * 16);
  }
}

template <int N>
KVW_HD Raw<N> zero_raw() {
  Raw<N> r;
#pragma unroll
  for (int j = 0; j < (N >= 4 ? N / 4 : 1); ++j) r.w[j] = 0;
  return r;
}

// Where unit u of a head row lies (element offsets): oa, and ob = oa + HALF for a neox unit.
// Returns whether the unit is rotated (false: a pass-through chunk at oa).
template <int W, bool NEOX>
KVW_HD bool rope_unit_offsets(u32 u, u32 rot_units, u32 half, u32 rot, u32& oa, u32& ob) {
  if (u < rot_units) {
    oa = u * W;
    ob = oa + half;
    return true;
  }
  oa = rot + (u - rot_units) * W;
  ob = oa;
  return false;
}

// A unit's entries of the cos/sin table: `table` points at the token's row (ROT entries of kind
// CS), `half` = ROT / 2, `oa` from rope_unit_offsets. Loaded apart from the rotation so that a
// kernel can issue them and then do other work while they are in flight.
template <int CS, int W, bool NEOX>
struct RopeEntries {
  static constexpr int NC = NEOX ? W : W / 2;  // table entries per unit
  Raw<NC * elem_bytes(CS)> c, s;
};

template <int CS, int W, bool NEOX>
KVW_HD RopeEntries<CS, W, NEOX> rope_load_entries(const u8* table, u32 half, u32 oa) {
  static_assert(NEOX || W % 2 == 0, "GPT-J units hold whole pairs");
  constexpr int CB = elem_bytes(CS);
  constexpr int NC = RopeEntries<CS, W, NEOX>::NC;
  const u32 ci = NEOX ? oa : oa / 2;
  RopeEntries<CS, W, NEOX> e;
  e.c = load_raw<NC * CB>(table + static_cast<i64>(ci) * CB);
  e.s = load_raw<NC * CB>(table + static_cast<i64>(ci + half) * CB);
  return e;
}

// Rotates a unit with its table entries: `a` (and `b`, the partner chunk, for neox) in place.
template <int IN, int CS, int W, bool NEOX>
KVW_HD void rope_rotate_entries(Raw<W * elem_bytes(IN)>& a, Raw<W * elem_bytes(IN)>& b,
                                const RopeEntries<CS, W, NEOX>& e) {
  constexpr int NC = RopeEntries<CS, W, NEOX>::NC;
  Raw<W * elem_bytes(IN)> ra = zero_raw<W * elem_bytes(IN)>();
  Raw<W * elem_bytes(IN)> rb = zero_raw<W * elem_bytes(IN)>();
#pragma unroll
  for (int j = 0; j < NC; ++j) {
    const float c = elem_f32<CS>(e.c, j), s = elem_f32<CS>(e.s, j);
    const float x = elem_f32<IN>(a, NEOX ? j : 2 * j);
    const float y = NEOX ? elem_f32<IN>(b, j) : elem_f32<IN>(a, 2 * j + 1);
    const u32 xo = round_to<IN>(sub_rn(mul_rn(x, c), mul_rn(y, s)));
    const u32 yo = round_to<IN>(add_rn(mul_rn(y, c), mul_rn(x, s)));
    if constexpr (NEOX) {
      put_elem<IN>(ra, j, xo);
      put_elem<IN>(rb, j, yo);
    } else {
      put_elem<IN>(ra, 2 * j, xo);
      put_elem<IN>(ra, 2 * j + 1, yo);
    }
  }
  a = ra;
  if constexpr (NEOX) b = rb;
}

// Rotates a unit: its table entries loaded (issued first), then the rotation.
template <int IN, int CS, int W, bool NEOX>
KVW_HD void rope_rotate_unit(Raw<W * elem_bytes(IN)>& a, Raw<W * elem_bytes(IN)>& b,
                             const u8* table, u32 half, u32 oa) {
  rope_rotate_entries<IN, CS, W, NEOX>(a, b, rope_load_entries<CS, W, NEOX>(table, half, oa));
}
#endif  // KVWRITE_HOST_TEST
