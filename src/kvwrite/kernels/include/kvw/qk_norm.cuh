// QK-norm + RoPE (docs/ops/fused_qk_norm_rope.md): the per-head arithmetic shared by
// fused_qk_norm_rope's and fused_qk_norm_rope_and_reshape_cache_flash's kernels.
//
// The lane layout (QknLayout<E, L, SEG>). One head row, padded with zeros to P elements (P the
// smallest power of two >= D), is held by a group of L lanes of one warp (L a power of two, L <=
// 32), E = P / L elements per lane, as NSEG = E / SEG segments of SEG consecutive elements: lane
// l's segment s holds the elements [l*SEG + s*L*SEG, l*SEG + s*L*SEG + SEG).
// - SEG = E (one segment, "consecutive"): lane l holds [l*E, l*E + E).
// - SEG < E ("interleaved"): the group's segments s lie side by side, so one warp access to
//   segment s covers L*SEG consecutive elements of the row (16-byte segments: fully coalesced),
//   and with P = 2 * L * SEG a lane holds the two halves' segments of the same pairs: the neox
//   partner of element i < P/2 is element i + P/2 of the same lane (PS > 0 below), no exchange.
// The contract's fixed sum of squares is then an in-lane pairwise tree over each segment's SEG
// leaves, __shfl_xor_sync with masks 1, 2, ..., L/2 on each segment's sum (block s of L*SEG
// leaves), and an in-lane tree over the NSEG block sums: neighbours at every level, as the
// contract's tree. The +0 leaves past D add exactly.
//
// Every float32 step is one explicitly rounded PTX instruction (mul.rn, add.rn, sub.rn, div.rn,
// sqrt.rn, rcp.rn: never contracted into an FMA, no flush to zero):
//   ss = the tree; m = RN(ss / D) (D a power of two: RN(ss * 2^-k), the same value);
//   a = RN(m + eps); sigma = RN(sqrt(a)); r = RN(1 / sigma);
//   u_i = RN(x_i * r); n_i = RN(u_i * g_i), g_i = float32(w_i) or RN(float32(w_i) + offset)
//   (no weight: g_i = 1, and RN(u_i * 1) = u_i);
//   then RoPE on the float32 n (kvw/rope.cuh's formula) and one rounding to the row's dtype.
// The rotation's partners: GPT-J pairs (2i, 2i + 1) lie in one segment (SEG even). A neox pair
// (i, i + rot/2) lies in one lane where rot/2 is a multiple of L*SEG (PS = rot / (2*L*SEG)
// segments apart: the interleaved layouts the launchers choose); otherwise (consecutive layout,
// PS = 0) it spans lanes: each lane publishes its n in shared memory (the group's P floats) and
// reads its partners back after a __syncwarp of the group.
#pragma once
#include "kvw/common.cuh"
#include "kvw/vec_io.cuh"
#include "kvw/rope.cuh"

// Template value of a weight kind: no weight (n = u).
#define QKN_NO_WEIGHT 6
// Template value of the query's destination: written back in place (no query_out).
#define QKN_IN_PLACE 7
// Threads per CTA of the small-call builds (each build's CTA is a template argument; the
// exchange buffer is sized by it).
#define QKN_THREADS 128

#ifndef KVWRITE_HOST_TEST
KVW_HD float sqrt_rn(float a) {
  float r;
  asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}
KVW_HD float rcp_rn(float a) {
  float r;
  asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}
#else
#include <math.h>
// The float64 root rounded once to float32 is the correctly rounded float32 root.
KVW_HD float sqrt_rn(float a) { return static_cast<float>(sqrt(static_cast<double>(a))); }
KVW_HD float rcp_rn(float a) { return 1.0f / a; }
#endif

// The in-lane part of the tree: N leaves (a power of two) summed pairwise, neighbours at every
// level; as a recursion over halves (the same tree), so that every index is a constant.
template <int N>
KVW_HD float qkn_tree(const float* q) {
  if constexpr (N == 1) {
    return q[0];
  } else {
    return add_rn(qkn_tree<N / 2>(q), qkn_tree<N / 2>(q + N / 2));
  }
}

template <int E>
KVW_HD float qkn_lane_tree(const float (&q)[E]) {
  return qkn_tree<E>(q);
}

// r = RN(1 / RN(sqrt(RN(RN(ss / D) + eps)))), D in [2, 512].
KVW_HD float qkn_inv_rms(float ss, i64 head_size, float eps) {
  const u32 d = static_cast<u32>(head_size);
  float m;
  if ((d & (d - 1)) == 0) {
    // D = 2^k: ss * 2^-k is the exact quotient, so its rounding is RN(ss / D).
#ifdef KVWRITE_HOST_TEST
    const u32 k = 31 - __builtin_clz(d);
#else
    const u32 k = 31 - __clz(d);
#endif
    m = mul_rn(ss, bits_f32((127u - k) << 23));
  } else {
    m = div_rn(ss, static_cast<float>(d));
  }
  return rcp_rn(sqrt_rn(add_rn(m, eps)));
}


// The lane layout (see the top of this file): E elements per lane in segments of SEG, L lanes.
// (Host code too: tests/test_qk_norm_rope.py checks its offsets and tree on the CPU.)
template <int E_, int L_, int SEG_>
struct QknLayout {
  static constexpr int E = E_, L = L_, SEG = SEG_, NSEG = E_ / SEG_;
  static_assert(E_ % SEG_ == 0 && L_ >= 1 && L_ <= 32 && (L_ & (L_ - 1)) == 0,
                "whole segments, a power-of-two group of at most 32 lanes");
  // The row element of the lane's element i (i a constant): i0 = lane * SEG.
  static KVW_HD u32 off(u32 i0, int i) {
    return i0 + static_cast<u32>((i / SEG) * (L * SEG) + i % SEG);
  }
};

#ifndef KVWRITE_HOST_TEST

// The lanes of this thread's group (L lanes, aligned within the warp).
template <int L>
KVW_HD u32 qkn_group_mask() {
  if constexpr (L == 32) {
    return 0xFFFFFFFFu;
  } else {
    return ((1u << L) - 1u) << (threadIdx.x & 31u & ~static_cast<u32>(L - 1));
  }
}

// The sum of squares of the group's row (every lane ends with it): per segment the in-lane tree
// and the xor masks 1, 2, ..., L/2, then the in-lane tree over the segments' sums. The shuffles
// of the NSEG segments are independent (interleaved: NSEG in flight at each level).
template <class LY>
KVW_HD float qkn_sum_squares(const float (&q)[LY::E], u32 mask) {
  float part[LY::NSEG];
#pragma unroll
  for (int s = 0; s < LY::NSEG; ++s) part[s] = qkn_tree<LY::SEG>(q + s * LY::SEG);
#pragma unroll
  for (int m = 1; m < LY::L; m <<= 1) {
#pragma unroll
    for (int s = 0; s < LY::NSEG; ++s) part[s] = add_rn(part[s], __shfl_xor_sync(mask, part[s], m));
  }
  return qkn_tree<LY::NSEG>(part);
}

// A lane's E elements of one row (kind IN) as E / V chunks of V elements (V divides SEG: a chunk
// lies in one segment). A chunk at or past the row's end (head_size) holds a copy of the row's
// first chunk (qkn_load_row): its elements count as +0 (qkn_to_f32) and it is never stored.
template <int IN, int E, int V>
struct QknRow {
  Raw<V * elem_bytes(IN)> c[E / V];
};

template <int IN, int E, int V>
KVW_HD QknRow<IN, E, V> qkn_zero_row() {
  QknRow<IN, E, V> r;
#pragma unroll
  for (int k = 0; k < E / V; ++k) r.c[k] = zero_raw<V * elem_bytes(IN)>();
  return r;
}

// Loads with ld.volatile: ptxas may not sink them below the position's test. Branch-free: a
// chunk past the row's end loads the row's first chunk instead (always there); qkn_to_f32
// zeroes its elements and qkn_store_row skips it. (Branches between chunk loads let ptxas
// place work that waits for other loads between them.)
template <int IN, class LY, int V>
KVW_HD QknRow<IN, LY::E, V> qkn_load_row(const u8* row, u32 i0, i64 head_size) {
  static_assert(LY::SEG % V == 0, "a chunk within a segment");
  constexpr int B = V * elem_bytes(IN);
  QknRow<IN, LY::E, V> r;
#pragma unroll
  for (int k = 0; k < LY::E / V; ++k) {
    const u32 b = LY::off(i0, k * V);
    const bool in = b < static_cast<u64>(head_size);
    r.c[k] = load_raw_volatile<B>(row + (in ? static_cast<i64>(b) * elem_bytes(IN) : 0));
  }
  return r;
}

template <int IN, class LY, int V>
KVW_HD void qkn_store_row(u8* row, const QknRow<IN, LY::E, V>& r, u32 i0, i64 head_size) {
  constexpr int B = V * elem_bytes(IN);
#pragma unroll
  for (int k = 0; k < LY::E / V; ++k) {
    const u32 b = LY::off(i0, k * V);
    if (b < static_cast<u64>(head_size))
      store_raw<B>(row + static_cast<i64>(b) * elem_bytes(IN), r.c[k]);
  }
}

// The lane's elements as float32, +0 past the row's end (the tree's padding leaves).
template <int IN, class LY, int V>
KVW_HD void qkn_to_f32(const QknRow<IN, LY::E, V>& r, u32 i0, i64 head_size,
                       float (&x)[LY::E]) {
#pragma unroll
  for (int k = 0; k < LY::E / V; ++k) {
    const bool in = LY::off(i0, k * V) < static_cast<u64>(head_size);
#pragma unroll
    for (int e = 0; e < V; ++e) x[k * V + e] = in ? elem_f32<IN>(r.c[k], e) : 0.0f;
  }
}

// float32 values rounded to nearest even in kind IN.
template <int IN, int E, int V>
KVW_HD QknRow<IN, E, V> qkn_round(const float (&x)[E]) {
  QknRow<IN, E, V> r;
#pragma unroll
  for (int k = 0; k < E / V; ++k) {
    r.c[k] = zero_raw<V * elem_bytes(IN)>();
#pragma unroll
    for (int e = 0; e < V; ++e) put_elem<IN>(r.c[k], e, round_to<IN>(x[k * V + e]));
  }
  return r;
}

// The lane's weights: a [D] vector of kind W, the lane's elements in chunks of VW elements (VW
// divides SEG; nothing for QKN_NO_WEIGHT; a chunk past head_size copies the first, for elements
// never stored). Loaded apart from their conversion (qkn_weights) so that a kernel can request
// them and convert them after other loads.
template <int W, int E, int VW>
struct QknWeight {
  Raw<VW * elem_bytes(W == QKN_NO_WEIGHT ? DT_F32 : W)> c[W == QKN_NO_WEIGHT ? 1 : E / VW];
};

template <int W, class LY, int VW>
KVW_HD QknWeight<W, LY::E, VW> qkn_load_weight(const u8* w, u32 i0, i64 head_size) {
  QknWeight<W, LY::E, VW> r;
  if constexpr (W == QKN_NO_WEIGHT) {
    r.c[0] = zero_raw<VW * 4>();
  } else {
    static_assert(LY::SEG % VW == 0, "a weight chunk within a segment");
    // Branch-free as qkn_load_row: a chunk past the end loads the first one.
    constexpr int B = VW * elem_bytes(W);
#pragma unroll
    for (int k = 0; k < LY::E / VW; ++k) {
      const u32 b = LY::off(i0, k * VW);
      const bool in = b < static_cast<u64>(head_size);
      r.c[k] = load_raw<B>(w + (in ? static_cast<i64>(b) * elem_bytes(W) : 0));
    }
  }
  return r;
}

// g = float32(w), or RN(float32(w) + offset) where add_offset (weight_offset != 0); ones where
// there is no weight (then n = RN(u * 1) = u).
template <int W, int E, int VW>
KVW_HD void qkn_weight_f32(const QknWeight<W, E, VW>& w, bool add_offset, float offset,
                           float (&g)[E]) {
  if constexpr (W == QKN_NO_WEIGHT) {
#pragma unroll
    for (int i = 0; i < E; ++i) g[i] = 1.0f;
  } else {
#pragma unroll
    for (int k = 0; k < E / VW; ++k) {
#pragma unroll
      for (int e = 0; e < VW; ++e) g[k * VW + e] = elem_f32<W>(w.c[k], e);
    }
    if (add_offset) {
#pragma unroll
      for (int i = 0; i < E; ++i) g[i] = add_rn(g[i], offset);
    }
  }
}

// A group's weights: with both weights of one kind (ONE), the group's own (q_weight for a query
// head, k_weight for a key head) loaded once through an address selected without a branch;
// otherwise both, loaded by every lane (no branch splits the loads: ptxas moved weight loads
// under a branch above the rows' loads and waited for them there), and selected after their
// conversion.
template <int WQ, int WK, int E, int VW>
struct QknWeights {
  static constexpr bool ONE = WQ == WK;
  QknWeight<WQ, E, VW> q;  // ONE: the group's own weight
  QknWeight<ONE ? QKN_NO_WEIGHT : WK, E, VW> k;
};

template <int WQ, int WK, class LY, int VW>
KVW_HD QknWeights<WQ, WK, LY::E, VW> qkn_load_weights(const u8* q_weight, const u8* k_weight,
                                                       bool is_q, u32 i0, i64 head_size) {
  QknWeights<WQ, WK, LY::E, VW> r;
  if constexpr (QknWeights<WQ, WK, LY::E, VW>::ONE) {
    r.q = qkn_load_weight<WQ, LY, VW>(is_q ? q_weight : k_weight, i0, head_size);
    r.k.c[0] = zero_raw<VW * 4>();
  } else {
    r.q = qkn_load_weight<WQ, LY, VW>(q_weight, i0, head_size);
    r.k = qkn_load_weight<WK, LY, VW>(k_weight, i0, head_size);
  }
  return r;
}

template <int WQ, int WK, int E, int VW>
KVW_HD void qkn_weights(const QknWeights<WQ, WK, E, VW>& w, bool is_q, bool add_offset,
                        float offset, float (&g)[E]) {
  if constexpr (QknWeights<WQ, WK, E, VW>::ONE) {
    qkn_weight_f32<WQ, E, VW>(w.q, add_offset, offset, g);
  } else {
    float gq[E], gk[E];
    qkn_weight_f32<WQ, E, VW>(w.q, add_offset, offset, gq);
    qkn_weight_f32<WK, E, VW>(w.k, add_offset, offset, gk);
#pragma unroll
    for (int i = 0; i < E; ++i) g[i] = is_q ? gq[i] : gk[i];
  }
}

// The lane's table entries in groups of U elements (neox: VT, GPT-J: 2*VT pairs' elements; a
// group lies in one segment), VT cos and VT sin entries of kind CS per group:
// - PS > 0 (neox pairs in the lane): the groups of the first PS segments, all in [0, rot/2);
//   the partner segments s + PS use the same entries;
// - PS = 0, neox (consecutive layout): every group, loaded where it lies in [0, rot) (VT divides
//   rot/2, so a group is wholly in [0, rot/2), [rot/2, rot) or past rot);
// - GPT-J: every group, loaded where it lies in [0, rot).
template <int CS, class LY, int VT, bool NEOX, int PS>
struct QknTable {
  static constexpr int U = NEOX ? VT : 2 * VT;
  static_assert(LY::SEG % U == 0, "a table group within a segment");
  static_assert(PS == 0 || (NEOX && 2 * PS <= LY::NSEG), "in-lane partners: neox, PS segments");
  static_assert(PS > 0 || !NEOX || LY::NSEG == 1, "neox partners across lanes: one segment");
  static constexpr int NG = (PS > 0 ? PS : LY::NSEG) * (LY::SEG / U);
  Raw<VT * elem_bytes(CS)> c[NG], s[NG];
};

template <int CS, class LY, int VT, bool NEOX, int PS>
KVW_HD QknTable<CS, LY, VT, NEOX, PS> qkn_load_table(const u8* table, u32 i0, u32 half, u32 rot) {
  using TB = QknTable<CS, LY, VT, NEOX, PS>;
  constexpr int B = VT * elem_bytes(CS);
  TB tb;
#pragma unroll
  for (int k = 0; k < TB::NG; ++k) {
    const u32 b = LY::off(i0, k * TB::U);
    const u32 p = PS > 0 ? b : NEOX ? (b < half ? b : b - half) : b / 2;  // the pair index
    if (PS > 0 || b < rot) {
      tb.c[k] = load_raw<B>(table + static_cast<i64>(p) * elem_bytes(CS));
      tb.s[k] = load_raw<B>(table + static_cast<i64>(p + half) * elem_bytes(CS));
    } else {
      tb.c[k] = tb.s[k] = zero_raw<B>();
    }
  }
  return tb;
}

// N consecutive floats of shared memory at p (aligned to N floats when N is 2 or 4).
template <int N>
KVW_HD void qkn_lds(const float* p, float* out) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 v = *reinterpret_cast<const float4*>(p + i);
      out[i] = v.x; out[i + 1] = v.y; out[i + 2] = v.z; out[i + 3] = v.w;
    }
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const float2 v = *reinterpret_cast<const float2*>(p + i);
      out[i] = v.x; out[i + 1] = v.y;
    }
  } else {
    out[0] = p[0];
  }
}

template <int N>
KVW_HD void qkn_sts(float* p, const float* in) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4)
      *reinterpret_cast<float4*>(p + i) = make_float4(in[i], in[i + 1], in[i + 2], in[i + 3]);
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 2) *reinterpret_cast<float2*>(p + i) = make_float2(in[i], in[i + 1]);
  } else {
    p[0] = in[0];
  }
}

// The neox exchange buffer of this thread's group (consecutive layout): CTA * E floats per CTA,
// the group's P floats from its first lane's E-th float.
template <int E, int L, int CTA>
KVW_HD float* qkn_exchange() {
  __shared__ __align__(16) float buf[CTA * E];
  return buf + (threadIdx.x & ~static_cast<u32>(L - 1)) * E;
}

// RoPE on the lane's float32 values n (row element LY::off(i0, i) is n[i]), in place: pair
// (x, y) with c, s: x' = RN(RN(x*c) - RN(y*s)), y' = RN(RN(y*c) + RN(x*s)); elements >= rot
// keep n. `group` is the group's P floats of the exchange buffer (neox with PS = 0 only).
template <int CS, class LY, int VT, bool NEOX, int PS>
KVW_HD void qkn_rotate(float (&n)[LY::E], const QknTable<CS, LY, VT, NEOX, PS>& tb, u32 i0,
                       u32 half, u32 rot, float* group, u32 mask) {
  using TB = QknTable<CS, LY, VT, NEOX, PS>;
  if constexpr (NEOX && PS > 0) {
    // Element i of the first PS segments (i < PS*SEG) pairs with i + PS*SEG, same entries.
#pragma unroll
    for (int k = 0; k < TB::NG; ++k) {
#pragma unroll
      for (int e = 0; e < VT; ++e) {
        const int i = k * VT + e, j = i + PS * LY::SEG;
        const float c = elem_f32<CS>(tb.c[k], e), s = elem_f32<CS>(tb.s[k], e);
        const float x = n[i], y = n[j];
        n[i] = sub_rn(mul_rn(x, c), mul_rn(y, s));
        n[j] = add_rn(mul_rn(y, c), mul_rn(x, s));
      }
    }
  } else if constexpr (NEOX) {
    constexpr int E = LY::E;
    constexpr int XS = E >= 4 ? 4 : E;
#pragma unroll
    for (int i = 0; i < E; i += XS) qkn_sts<XS>(group + i0 + i, n + i);
    __syncwarp(mask);
    constexpr int XV = VT >= 4 ? 4 : VT;
#pragma unroll
    for (int k = 0; k < E / VT; ++k) {
      const u32 b = i0 + k * VT;
      if (b < rot) {
        const bool first = b < half;
        const u32 pb = first ? b + half : b - half;  // the partners' first element
        float y[VT];
#pragma unroll
        for (int i = 0; i < VT; i += XV) qkn_lds<XV>(group + pb + i, y + i);
#pragma unroll
        for (int e = 0; e < VT; ++e) {
          const float c = elem_f32<CS>(tb.c[k], e), s = elem_f32<CS>(tb.s[k], e);
          const float x = n[k * VT + e];
          n[k * VT + e] = first ? sub_rn(mul_rn(x, c), mul_rn(y[e], s))
                                : add_rn(mul_rn(x, c), mul_rn(y[e], s));
        }
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < TB::NG; ++k) {
      if (LY::off(i0, k * 2 * VT) < rot) {
#pragma unroll
        for (int e = 0; e < VT; ++e) {
          const float c = elem_f32<CS>(tb.c[k], e), s = elem_f32<CS>(tb.s[k], e);
          const float x = n[k * 2 * VT + 2 * e], y = n[k * 2 * VT + 2 * e + 1];
          n[k * 2 * VT + 2 * e] = sub_rn(mul_rn(x, c), mul_rn(y, s));
          n[k * 2 * VT + 2 * e + 1] = add_rn(mul_rn(y, c), mul_rn(x, s));
        }
      }
    }
  }
}

// Raw chunk words made opaque to the compiler (an asm volatile move each): converting them again
// after this is not the same expression as converting them before, so the compiler keeps the
// chunks (half the registers of their float32 values for 16-bit elements) instead of the values.
template <int N>
KVW_HD Raw<N> qkn_opaque(Raw<N> r) {
#pragma unroll
  for (int j = 0; j < (N >= 4 ? N / 4 : 1); ++j) asm volatile("mov.b32 %0, %0;" : "+r"(r.w[j]));
  return r;
}

// The normalized values of a lane's row chunks before the rotation: n_i = RN(RN(x_i * r) * g_i)
// of the lane's E elements (float32), g_i the group's weights (qkn_weights, offset applied).
// LEAN (the register-bound large-call build): the row's chunks and the weights are converted
// again after the reciprocal root (through qkn_opaque), so that their float32 values are not
// held across the reduction (16-bit rows and weights: E fewer registers; no spill under the
// large-call build's bound, at 2 instructions per element more).
template <int IN, class LY, int V, int WQ, int WK, int VW, bool LEAN>
KVW_HD void qkn_normalize(const QknRow<IN, LY::E, V>& row,
                          const QknWeights<WQ, WK, LY::E, VW>& w, bool is_q, bool add_offset,
                          float offset, u32 i0, i64 head_size, float eps, u32 mask,
                          float (&n)[LY::E]) {
  constexpr int E = LY::E;
  float x[E], q[E], g[E];
  qkn_to_f32<IN, LY, V>(row, i0, head_size, x);
  if constexpr (!LEAN) qkn_weights<WQ, WK, E, VW>(w, is_q, add_offset, offset, g);
#pragma unroll
  for (int i = 0; i < E; ++i) q[i] = mul_rn(x[i], x[i]);
  const float r = qkn_inv_rms(qkn_sum_squares<LY>(q, mask), head_size, eps);
  if constexpr (LEAN) {
    if constexpr (IN != DT_F32) {
      QknRow<IN, E, V> again;
#pragma unroll
      for (int k = 0; k < E / V; ++k) again.c[k] = qkn_opaque(row.c[k]);
      qkn_to_f32<IN, LY, V>(again, i0, head_size, x);
    }
    QknWeights<WQ, WK, E, VW> wo = w;
    if constexpr (WQ != QKN_NO_WEIGHT) {
#pragma unroll
      for (int k = 0; k < (WQ == QKN_NO_WEIGHT ? 1 : E / VW); ++k) wo.q.c[k] = qkn_opaque(w.q.c[k]);
    }
    qkn_weights<WQ, WK, E, VW>(wo, is_q, add_offset, offset, g);
  }
#pragma unroll
  for (int i = 0; i < E; ++i) n[i] = mul_rn(mul_rn(x[i], r), g[i]);
}

// The whole per-head computation on a lane's row chunks: the rotated, normalized values
// (float32) of the lane's E elements; `w` the lane's weights (qkn_load_weights), `tb` the table
// entries of the token's position.
template <int IN, int CS, class LY, int V, int VT, bool NEOX, int PS, int WQ, int WK, int VW,
          bool LEAN>
KVW_HD void qkn_norm_rope(const QknRow<IN, LY::E, V>& row, const QknWeights<WQ, WK, LY::E, VW>& w,
                          bool is_q, bool add_offset, float offset,
                          const QknTable<CS, LY, VT, NEOX, PS>& tb, u32 i0, i64 head_size,
                          u32 half, u32 rot, float eps, float* group, u32 mask,
                          float (&n)[LY::E]) {
  qkn_normalize<IN, LY, V, WQ, WK, VW, LEAN>(row, w, is_q, add_offset, offset, i0, head_size, eps,
                                            mask, n);
  qkn_rotate<CS, LY, VT, NEOX, PS>(n, tb, i0, half, rot, group, mask);
}
#endif  // KVWRITE_HOST_TEST
