// kvwrite: reshape_and_cache_turboquant: quantize each (token, head) of key and value into one
// TurboQuant slot of a paged byte cache (SPEC 10.1-10.2).
//
// Compiled at run time with NVRTC (see cuda_impl.py), one module per variant (and, for the calls
// cuda_impl.specialized picks, per call signature: TQ_FIXED_PARAMS compiled in)
// tq_kernel<IN, KB, VB, SlotT, E, CTA> (and tq_check_kernel<CTA>, the MSE presets' table check
// that runs before it where D is a power of two; the MSE presets' smallest calls take
// tq_split_kernel, at the end of this file, instead of both): IN the input kind (DT_F16, DT_BF16, DT_F32), KB the key's
// bits (8: k8v4's e4m3fn codes; 4 or 3: MSE indices), VB the value's bits (4 or 3), SlotT the slot
// type (int or long long), E the elements of a row each lane holds (a power of two; the launcher
// picks E for the padded head size P, the power of two >= D: LPR = P / E <= 32 lanes per row),
// CTA the threads of a CTA (the launcher's cta_threads; one CTA per SM at least:
// __launch_bounds__'s second argument 1 lets ptxas take up to 128 registers a thread at 512
// rather than spill; the launcher sizes the grid by the measured occupancy).
//
// Layout: a row (token, head) is LPR neighbouring lanes of one warp, lane r of the row holding
// elements [r*E, r*E + E) of the key and the value rows in registers (loaded as 16-byte vectors
// where the chunk is whole and aligned; elements >= D are never read: +0 in the key, NaN in the
// value). A warp holds 32 / LPR rows; the CTAs (CTA threads) stride over the rows
// (grid sized by the launcher to the resident CTAs: the per-CTA setup below is paid once per
// CTA, not once per row; the first pass's rows are loaded before it, each later pass's row while
// the lane quantizes the one before: TqRaw). A row whose slot is negative or out of range
// computes on but stores nothing (its lanes still take part in the warp's shuffles).
//
// Every float32 step is one explicitly rounded PTX instruction (common.cuh's add_rn, sub_rn,
// mul_rn, div_rn, fma_rn; qk_norm.cuh's sqrt_rn, rcp_rn), so no compiler flag can contract or
// flush anything; the divisions by a row's den and s are tq_div_row's (RN(a / b) exactly).
// Every sum of §10.2 is the padded pairwise tree (§7.1): the lane's E leaves by qkn_tree (E a
// power of two: neighbours at every level), then the lanes' sums by shuffle-xor at distances
// 1, 2, 4, ... (at distance m the two sums added are the subtrees of lanes r and r ^ m: the same
// neighbours the tree joins; RN(a + b) = RN(b + a), so both lanes hold the node).
// - keys, k8v4: code_i = e4m3fn(x_i) by the satfinite conversion with no scale (fp8.cuh).
// - keys, MSE: ss = the tree of RN(x_i^2); n = RN(sqrt(ss)); den = RN(n + 1e-8f);
//   u_i = RN(x_i / den); y_j = the tree over i of RN(u_i * PiT[i, j]) by one of two paths, the
//   call's choice from the table's values, every call (tq_check_kernel's flags where the launcher
//   ran it, else each CTA's own check of every entry, its threads together):
//   * Hadamard (D a power of two and PiT[i, j] = (-1)^popcount(i & j) * PiT[0, 0] bit for bit):
//     p_i = RN(u_i * h), h = PiT[0, 0], then the fast Walsh-Hadamard transform of p, strides
//     1, 2, 4, ... (lane-local strides < E, then shuffles), each butterfly (a, b) -> (RN(a + b),
//     RN(a - b)). Why it is the tree: RN is sign-symmetric (RN(-a) = -RN(a), RN(-a - b) =
//     -RN(a + b)), so the leaf RN(u_i * PiT[i, j]) is sigma(i & j) * p_i (sigma(x) =
//     (-1)^popcount(x)), and by induction on the level L the tree's node over leaves
//     [m*2^L, (m+1)*2^L) for output j is sigma(m*2^L & j) times the butterfly's value at position
//     m*2^L + (j mod 2^L) after L stages (joining blocks 2m and 2m + 1 multiplies by
//     sigma(2m*2^L & j) a sum or a difference as bit L of j says: the stage's butterfly). The
//     two agree as real numbers; only a zero's sign may differ (RN(a - a) = +0 whatever the
//     sign outside), and a NaN stays a NaN; the count of step 4 reads nothing else of y_j.
//   * generic (any other table): u in shared memory, lane r computes its E outputs, each the
//     tree over i of RN(u_i * PiT[i, j]) read from global memory: chunks of 8 leaves by qkn_tree,
//     the chunks joined by a binary counter (tq_rotate_one).
//   idx_j = #{k : y_j >= m_k} (NaN: 0): a binary search over the midpoints when they ascend
//   (m_k <= m_{k+1} for all k, a NaN failing it; then {k : m_k <= y_j} is a prefix and the search
//   finds its length), else the count itself; the CTA checks the order once. fp16(n) after the
//   field.
// - values: mn, mx over the non-NaN elements (the GPU's min and max ignore NaN; lane-local, then
//   shuffles), both 0 if none, a zero mn +0; s = RN(RN(mx - mn) / L), FL unless s > FL;
//   q_i = clamp(rhu(RN(RN(v_i - mn) / s)), 0, L) (NaN -> 0): the quotient's steps
//   (tq_quotient) and two sums rounded toward -inf (round.cuh's rhu_bits; tq_value_codes has
//   the proof); fp16(s), fp16(mn) after the codes.
// - b-bit fields: code i in bits [b*i, b*i + b) of the field read as one little-endian integer;
//   lane r's E codes are the field's bytes [r*E*b/8, (r+1)*E*b/8) (E*b a multiple of 8: 3-bit
//   fields need D % 8 == 0, so E >= 8 there), stored with the widest accesses their address
//   allows; k8v4 in calls of more than TQ_STAGE_PASSES passes: a warp's slots assembled in
//   shared memory and stored word by word by consecutive lanes (tq_stage_words).
// Only the slot's slot_size bytes are written (the pad byte of slot_size_aligned never is).
// Shapes the launcher checks: D even, D <= TQ_MAXP (3-bit fields: D % 8 == 0), P / E <= 32.
// With KVWRITE_HOST_TEST (tests/test_turboquant_kernels.py's SIMT emulation, tests/gather_emu.h)
// the kernel runs on the CPU as written, the float16 widening in software.
#include "kvw/common.cuh"
#include "kvw/fp8.cuh"
#include "kvw/qk_norm.cuh"
#include "kvw/round.cuh"
#include "kvw/slot.cuh"
#include "kvw/vec_io.cuh"
#include "kvw/warp.cuh"

#define TQ_MAXP 1024  // the padded head size P (a power of two >= D) at most
// tq_kernel's own table check's 16-byte loads in flight a thread: 4096 a CTA where the registers
// allow (E <= 16: 8 a thread at 512 threads, 16 at 256: D = 128's table in one round trip), 8 at
// E = 32 (255 registers already).
template <int E, int CTA>
__host__ __device__ constexpr u32 tq_check_batch() { return E <= 16 ? 4096u / CTA : 8u; }
// k8v4 stages its stores (tq_stage_words) in calls of more than this many passes a warp: H200,
// H = 8, D = 128, tuning-log 115: 0.82-0.85 of the time at T >= 16384 (15.5 passes and more),
// cold and hot; at T = 3072 and 4096 (2.9, 3.9 passes) 0.90 cold but 1.28-1.29 hot, at fewer
// passes up to 1.19 slower (a pass's latency is the call's).
#define TQ_STAGE_PASSES 8
#define TQ_EPS 1e-8f  // float32(1e-8): bits 0x322BCC77 (den = n + eps; the scale floor FL)

// Both kernels' trailing arguments, fixed by a call's signature (cuda_impl.fixed_args, in this
// order): H, D, P (the power of two >= D; tq_split_kernel's P is 32 E), the key's and value's
// token and head strides in elements, the cache's block, page and head strides in bytes, the
// block size, its log2 (or -1), the slots, the table's strides and the midpoints' (0 for k8v4).
// In a build specialized for one signature (-D KVWRITE_FIXED_ARGS=v0,...,v15) they are
// compile-time constants: H200, H = 8, D = 128, calls of T <= 512 0.40-0.88 us faster (0.78-0.89
// of the time; docs/tuning-log.md 123), the MSE presets' larger ones 0.89-0.94 of it (124).
#define TQ_FIXED_PARAMS                                                                         \
  i64 num_heads, i64 head_size, i64 p2, i64 k_tok, i64 k_head, i64 v_tok, i64 v_head,          \
      i64 c_blk, i64 c_page, i64 c_head, i64 block_size, i64 block_shift, i64 num_slots,       \
      i64 pit_s0, i64 pit_s1, i64 mid_s
#define TQ_FIXED_PROLOGUE()                                                                     \
  KVW_ASSIGN_FIXED_ARGS(num_heads, head_size, p2, k_tok, k_head, v_tok, v_head, c_blk, c_page, \
                        c_head, block_size, block_shift, num_slots, pit_s0, pit_s1, mid_s)

KVW_HD u32 tq_popc(u32 x) {
#ifdef KVWRITE_HOST_TEST
  return static_cast<u32>(__builtin_popcount(x));
#else
  return static_cast<u32>(__popc(x));
#endif
}

KVW_HD float tq_shfl_xor(float v, int m) { return __shfl_xor_sync(0xFFFFFFFFu, v, m); }

// Element i of a row of kind IN at p, as float32 (exact).
template <int IN>
KVW_HD float tq_elem(const u8* p, i64 i) {
  if constexpr (IN == DT_F32) {
    return reinterpret_cast<const float*>(p)[i];
  } else {
    return half_f32<IN>(reinterpret_cast<const u16*>(p)[i]);
  }
}

// The raw bytes of a lane's chunk (E elements of kind IN from element i0 of a row), fetched one
// pass ahead where they fit in 32 bytes (TqRaw<IN, E>::PF): the 16-byte loads of the next row are
// in flight while the lane quantizes this one. `vec`: the chunk is whole and 16-byte aligned (else
// tq_unpack_chunk reads it element by element, unfetched).
template <int IN, int E>
struct TqRaw {
  static constexpr int NB = E * elem_bytes(IN);
  static constexpr bool PF = NB % 16 == 0 && NB <= 32;
  uint4 q[PF ? NB / 16 : 1];
  const u8* p;
  bool vec;
};

template <int IN, int E>
KVW_HD void tq_fetch_chunk(const u8* row, u32 i0, u32 d, TqRaw<IN, E>& raw) {
  raw.p = row + static_cast<i64>(i0) * elem_bytes(IN);
  raw.vec = false;
  if constexpr (TqRaw<IN, E>::PF) {
    raw.vec = i0 + E <= d && (reinterpret_cast<unsigned long long>(raw.p) & 15u) == 0;
    // Every word assigned on both sides (zeros where not loaded): the last pass's words are dead
    // here, so the compiler keeps no copy of them across the loop.
#pragma unroll
    for (int c = 0; c < TqRaw<IN, E>::NB / 16; ++c)
      raw.q[c] = raw.vec ? reinterpret_cast<const uint4*>(raw.p)[c] : make_uint4(0, 0, 0, 0);
  }
}

// x[e] = element i0 + e of the row (kind IN) for i0 + e < d, else `pad`: from the fetched words
// where raw.vec, else 16-byte loads where the chunk is whole and aligned, else one element at a
// time (exact either way).
template <int IN, int E>
KVW_HD void tq_unpack_chunk(const TqRaw<IN, E>& raw, u32 i0, u32 d, float pad, float (&x)[E]) {
  constexpr int NB = TqRaw<IN, E>::NB;
  const u8* p = raw.p;
  if constexpr (NB % 16 == 0) {
    if (raw.vec || (!TqRaw<IN, E>::PF && i0 + E <= d &&
                    (reinterpret_cast<unsigned long long>(p) & 15u) == 0)) {
#pragma unroll
      for (int c = 0; c < NB / 16; ++c) {
        uint4 q;
        if constexpr (TqRaw<IN, E>::PF) {
          q = raw.q[c];
        } else {
          q = reinterpret_cast<const uint4*>(p)[c];
        }
        const u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if constexpr (IN == DT_F32) {
            x[c * 4 + k] = bits_f32(w[k]);
          } else {
            x[c * 8 + 2 * k] = half_f32<IN>(w[k] & 0xFFFFu);
            x[c * 8 + 2 * k + 1] = half_f32<IN>(w[k] >> 16);
          }
        }
      }
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = i0 + e < d ? tq_elem<IN>(p, e) : pad;
}

// y_j = the tree over i < P of RN(u_i * PiT[i, j]) (+0 for i >= D): chunks of CH leaves (CH =
// min(8, P)) summed by qkn_tree, chunk sums combined by a binary counter (level l's pending
// left subtree in stk[l]).
template <int CH>
KVW_HD float tq_rotate_one(const float* u, const float* pit, i64 s0, i64 s1, u32 j, u32 d, u32 p) {
  float stk[11];
  const u32 chunks = p / CH;
  u32 top = 0;
  // Not unrolled where a specialized build knows P: unrolled, the counter's stack took 480-856
  // bytes of local memory a thread (sm_90, D = 128, E = 8 and 16, against 48).
#pragma unroll 1
  for (u32 c = 0; c < chunks; ++c) {
    float leaf[CH];
#pragma unroll
    for (int e = 0; e < CH; ++e) {
      const u32 i = c * CH + e;
      leaf[e] = i < d ? mul_rn(u[i], pit[static_cast<i64>(i) * s0 + static_cast<i64>(j) * s1])
                      : 0.0f;
    }
    float v = qkn_tree<CH>(leaf);
    u32 lvl = 0;
    for (u32 k = c; k & 1u; k >>= 1) v = add_rn(stk[lvl++], v);
    stk[lvl] = v;
    top = lvl;
  }
  return stk[top];
}

// The E codes c (each below 2^B) as a field of E*B/8 bytes in 32-bit words (little endian), from
// t[e] = BIAS + c[e] (BIAS 0, or KVW_2P23_BITS: floor_bits' 2^23 + c, taken off here). Groups
// of G = min(E, 8) codes (G*B <= 32 bits) by Horner's scheme mod 2^32, acc = acc * 2^B + t[e]
// from the group's last code down, one multiply-add a code: the group's value is sum t[e]
// 2^(B e) = sum c[e] 2^(B e) + BIAS * sum 2^(B e), and the codes' sum is below 2^(G B), so
// subtracting the constant mod 2^32 leaves it exactly. The groups are then placed at bit G*B*g
// of the field.
template <int B, int E>
struct TqField {
  static constexpr int NB = E * B / 8;
  u32 w[(NB + 3) / 4];
};
template <int B, int E, u32 BIAS = 0>
KVW_HD TqField<B, E> tq_pack(const u32 (&t)[E]) {
  constexpr int G = E < 8 ? E : 8;
  u32 bias_sum = 0;  // BIAS * sum over e < G of 2^(B e), mod 2^32 (folded by the compiler)
#pragma unroll
  for (int e = 0; e < G; ++e) bias_sum += BIAS << (B * e);  // B * e <= 28
  TqField<B, E> f;
#pragma unroll
  for (int k = 0; k < (TqField<B, E>::NB + 3) / 4; ++k) f.w[k] = 0;
#pragma unroll
  for (int g = 0; g < E / G; ++g) {
    u32 acc = t[g * G + G - 1];
#pragma unroll
    for (int e = G - 2; e >= 0; --e) acc = acc * (1u << B) + t[g * G + e];
    acc -= bias_sum;
    const int bit = B * G * g;
    f.w[bit / 32] |= acc << (bit % 32);
    if (bit % 32 + B * G > 32) f.w[bit / 32 + 1] |= acc >> (32 - bit % 32);
  }
  return f;
}

// The first n (<= NB) bytes of words w (little endian) at p: whole words or halves where the
// address allows, else bytes.
template <int NB>
KVW_HD void tq_store_bytes(u8* p, const u32* w, u32 n) {
  const unsigned long long a = reinterpret_cast<unsigned long long>(p);
  if (n == NB && NB % 4 == 0 && (a & 3u) == 0) {
#pragma unroll
    for (int k = 0; k < NB / 4; ++k) reinterpret_cast<u32*>(p)[k] = w[k];
  } else if (n == NB && NB % 2 == 0 && (a & 1u) == 0) {
#pragma unroll
    for (int k = 0; k < NB / 2; ++k)
      reinterpret_cast<u16*>(p)[k] = static_cast<u16>(w[k / 2] >> (16 * (k % 2)));
  } else {
#pragma unroll
    for (int k = 0; k < NB; ++k)
      if (static_cast<u32>(k) < n) p[k] = static_cast<u8>(w[k / 4] >> (8 * (k % 4)));
  }
}

// Lane r's part of a field of B-bit codes (d codes in all): its bytes [r*E*B/8, ...) that lie
// in the field's ceil(d*B/8).
template <int B, int E>
KVW_HD void tq_store_field(u8* field, const TqField<B, E>& f, u32 r, u32 d) {
  constexpr u32 NB = E * B / 8;
  const u32 total = (d * B + 7) / 8, start = r * NB;
  if (start < total) tq_store_bytes<NB>(field + start, f.w, total - start < NB ? total - start : NB);
}
template <int B, int E, u32 BIAS = 0>
KVW_HD void tq_store_field(u8* field, const u32 (&t)[E], u32 r, u32 d) {
  tq_store_field<B, E>(field, tq_pack<B, E, BIAS>(t), r, d);
}

// k8v4's key field: e4m3fn(x_e) by the satfinite conversion, two a conversion, in little-endian
// words; a NaN's code 0x7F whatever its sign (the contract leaves it free; one pattern for all).
// The conversion gives a NaN one of e4m3fn's two NaN codes, 0x7F or 0xFF, and nothing else
// 0xFF (satfinite takes ±inf to ±448), so each 0xFF byte loses its sign bit: with t = ~w, the
// bytes of ~((t & 0x7F..) + 0x7F.. | t | 0x7F..) are 0x80 exactly where t's byte is 0.
template <int E>
KVW_HD TqField<8, E> tq_e4m3_field(const float (&x)[E]) {
  TqField<8, E> f;
#pragma unroll
  for (int k = 0; k < (E + 3) / 4; ++k) f.w[k] = 0;
#pragma unroll
  for (int e = 0; e < E; e += 2) f.w[e / 4] |= fp8x2_from_f32<DT_E4M3>(x[e], x[e + 1]) << (8 * (e % 4));
#pragma unroll
  for (int k = 0; k < (E + 3) / 4; ++k) {
    const u32 t = ~f.w[k];
    f.w[k] ^= ~(((t & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) | t | 0x7F7F7F7Fu);
  }
  return f;
}

// Entry (i, j) of the Sylvester Hadamard times h, as bits (hb: h's): h with its sign flipped
// where popcount(i & j) is odd.
KVW_HD u32 tq_sylvester_bits(u32 hb, u32 i, u32 j) { return hb ^ ((tq_popc(i & j) & 1u) << 31); }

// The table check's test of one 16-byte load of PiT (d >= 4 a power of two, row-major and
// contiguous): entries kk .. kk + 3 of the flattened [d, d] table (kk % 4 == 0: one row i,
// columns j .. j + 3 with j % 4 == 0) against the Sylvester Hadamard times h (its bits hb),
// whose entry (i, j + c) is hb ^ parity(i & (j + c)) << 31. As c < 4 shares no bit with j,
// parity(i & (j + c)) = parity(i & j) ^ parity(i & c): one popcount for the four. Nonzero iff
// any entry differs.
KVW_HD u32 tq_hadamard_misses(uint4 w, u32 kk, u32 lg_d, u32 hb) {
  const u32 i = kk >> lg_d, j = kk & ((1u << lg_d) - 1u);
  const u32 e0 = tq_sylvester_bits(hb, i, j);
  const u32 s1 = (i & 1u) << 31, s2 = (i & 2u) << 30;
  return (w.x ^ e0) | (w.y ^ e0 ^ s1) | (w.z ^ e0 ^ s2) | (w.w ^ e0 ^ s1 ^ s2);
}

// The table check, a kernel of its own ahead of tq_kernel (MSE presets, D a power of two): each
// thread compares entries 4q .. 4q + 3 of the flattened [D, D] table (q its index in the grid;
// one 16-byte load where the table is contiguous and 16-byte aligned) with the Sylvester
// Hadamard times PiT[0, 0]; flags[blockIdx.x] = 1 where any entry of the CTA's differs, else 0.
// The grid covers the table once (D = 128: 16 CTAs of 256), so no SM streams all of it, and
// tq_kernel's CTAs only OR the flags: small calls then spread over more CTAs (tuning-log 121).
// Large calls check in tq_kernel instead, where the check's loads overlap the rows'.
template <int CTA>
__global__ void __launch_bounds__(CTA) tq_check_kernel(
    const float* __restrict__ pit,  // [D, D] via (pit_s0, pit_s1)
    i64 head_size, i64 pit_s0, i64 pit_s1,
    int* __restrict__ flags) {  // [gridDim.x]
  KVW_PDL_ENTRY();
  const u32 d = static_cast<u32>(head_size);
  const u32 lg_d = 31u - static_cast<u32>(__clz(d));
  const u32 dd = d * d;
  const u32 q = blockIdx.x * CTA + threadIdx.x;
  const u32 hb = f32_bits(pit[0]);
  u32 misses = 0u;
  if (4u * q < dd) {
    if (pit_s1 == 1 && pit_s0 == d && d >= 4 &&
        (reinterpret_cast<unsigned long long>(pit) & 15u) == 0) {
      misses = tq_hadamard_misses(reinterpret_cast<const uint4*>(pit)[q], 4u * q, lg_d, hb);
    } else {
      for (u32 k = 4u * q; k < 4u * q + 4u && k < dd; ++k) {
        const u32 i = k >> lg_d, j = k & (d - 1u);
        const u32 w = f32_bits(pit[static_cast<i64>(i) * pit_s0 + static_cast<i64>(j) * pit_s1]);
        misses |= w ^ tq_sylvester_bits(hb, i, j);
      }
    }
  }
  const int bad = __syncthreads_or(misses != 0u ? 1 : 0);
  if (threadIdx.x == 0) flags[blockIdx.x] = bad;
}

// tq_div_row's steps alone: q0 = RN(a * yb), then two corrections (RN(a / b) under tq_div_row's
// conditions; the sign is the steps', not yet a's). tq_value_codes takes them too.
KVW_HD float tq_quotient(float a, float b, float yb) {
  float x = mul_rn(a, yb);
  float r = fma_rn(-b, x, a);
  x = fma_rn(r, yb, x);
  r = fma_rn(-b, x, a);
  return fma_rn(r, yb, x);
}

// q[e] = RN(a[e] / b) for a row's divisor b > 0, with yb = RN(1 / b) (rcp.rn, once a row).
// Where b is in [2^-60, 2^60] (`fast`, the row's) and every |a[e]| is 0 or in [2^-60, 2^60]:
// q0 = RN(a * yb) (within 1.5 ulp of a / b), one correction q1 = RN(q0 + RN(a - b*q0) * yb)
// (within 1 ulp: the remainder's own rounding is far below it), then Markstein's step
// q2 = RN(q1 + r1 * yb) with r1 = a - b*q1, exact by the FMA (the remainder of a quotient within
// 1 ulp is a float; where it would be below 2^-126, q1 is already within 2^-40 ulp of a / b and
// the step cannot move it): with yb within half an ulp of 1 / b and q1 within 1 ulp,
// q2 = RN(a / b) (Markstein 1990; Muller et al., Handbook of Floating-Point Arithmetic, the
// division theorems). Quotients and remainders stay normal in those ranges. The sign is then
// a's (b > 0; the FMAs would turn a -0 quotient into +0). Otherwise (a subnormal, tiny, huge,
// inf or NaN element; b out of range) the lane takes div.rn for all E. One predicate and one
// branch a lane, not one a division. tests/test_turboquant_kernels.py compares it with the
// host's division on 6 * 10^6 pairs.
template <int E>
KVW_HD void tq_div_row(float (&q)[E], const float (&a)[E], float b, float yb, bool fast) {
  const float lo = bits_f32(0x21800000u), hi = bits_f32(0x5D800000u);  // 2^-60, 2^60
  bool ok = fast;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const float aa = fabsf(a[e]);
    ok = ok && aa <= hi && !(aa < lo && aa > 0.0f);  // a NaN fails aa <= hi
    const float x = tq_quotient(a[e], b, yb);
    q[e] = bits_f32((f32_bits(x) & 0x7FFFFFFFu) | (f32_bits(a[e]) & 0x80000000u));
  }
  if (!ok) {
#pragma unroll
    for (int e = 0; e < E; ++e) q[e] = div_rn(a[e], b);
  }
}

// The value codes q[e] = KVW_2P23_BITS + clamp(rhu(RN(w[e] / s)), 0, L) of a row whose range is
// R = RN(mx - mn): w[e] = RN(v[e] - mn) in [0, R] or NaN, s >= RN(R / L) (the row's scale,
// floored: s >= FL = 1e-8), ys = RN(1 / s). Where s <= 2^60 (`fast`; so s is in [2^-60, 2^60])
// the quotient is tq_div_row's steps (tq_quotient) without its element test, which keeps the
// steps' operands normal: here every element whose code is not 0 has them so. Q = w / s <=
// L (1 + 2^-24) (w <= R, s >= (R / L)(1 - 2^-24)), so RN(Q) <= L (L (1 + 2^-24) is within half
// an ulp of L for L = 7 and 15) and no clamp above is needed. An element with Q >= 1/4 has w >=
// s / 4 >= 2^-62 and w <= 2^64, the steps' products below 2^64 and a nonzero remainder at least
// s ulp(Q) / 2 >= 2^-88: the steps' proof holds (tq_div_row), q = RN(Q). An element with Q < 1/4
// (w tiny, subnormal or 0) gets some q within 2^-22 Q + 2^-140 of Q, below 1/2: code 0 as RN(Q)
// gives. A NaN w gives a NaN q, taken to 0 by the max (code 0); w = -0 (v = -0, mn = +0) gives
// q = -0, code 0. The code, floor(q + 1/2) exactly, is round.cuh's rhu_bits (2^23 + the code,
// its bias taken off in tq_pack). Eight
// instructions an element, no branch, no comparison. Rows not `fast` (s huge, inf or NaN) take
// tq_div_row and rhu_clamp_code. tests/test_turboquant_kernels.py puts values within ulps of
// every code boundary (+1/2 rounded to nearest, or no max, fails them); tq_div_row's test checks
// the steps on 6 * 10^6 pairs.
template <int E>
KVW_HD void tq_value_codes(u32 (&q)[E], const float (&w)[E], float s, float ys, bool fast,
                           float L) {
  if (fast) {
#pragma unroll
    for (int e = 0; e < E; ++e)
      q[e] = rhu_bits(fmaxf(tq_quotient(w[e], s, ys), 0.0f));
  } else {
    float qv[E];
    tq_div_row<E>(qv, w, s, ys, false);
#pragma unroll
    for (int e = 0; e < E; ++e) q[e] = KVW_2P23_BITS + rhu_clamp_code(qv[e], 0.5f, L);
  }
}

// The row-level half of tq_div_row's condition: b in [2^-60, 2^60] (a NaN b fails it).
KVW_HD bool tq_div_fast(float b) {
  return b >= bits_f32(0x21800000u) && b <= bits_f32(0x5D800000u);
}

// fp16(v)'s bits (tq_f16_bits), little-endian at p (tq_store_f16); a NaN as 0x7E00 (the
// contract leaves a NaN norm's encoding free: one fixed pattern makes every implementation's
// bytes equal).
KVW_HD u32 tq_f16_bits(float v) { return v == v ? f16ish_from_f32<DT_F16>(v) : 0x7E00u; }
KVW_HD void tq_store_f16(u8* p, float v) {
  const u32 h = tq_f16_bits(v);
  p[0] = static_cast<u8>(h & 0xFFu);  // little-endian; the field may be at an odd byte
  p[1] = static_cast<u8>(h >> 8);
}

// A row's key norm n = RN(sqrt(ss)), ss the tree of RN(x_i^2) over the row's `lanes` lanes (E
// leaves each, +0 padding): the lane's tree, then shuffles at distances 1, 2, ... < lanes.
template <int E>
KVW_HD float tq_key_norm(const float (&x)[E], u32 lanes) {
  float sq[E];
#pragma unroll
  for (int e = 0; e < E; ++e) sq[e] = mul_rn(x[e], x[e]);  // padding: +0 * +0 = +0
  float ss = qkn_tree<E>(sq);
  for (u32 m = 1; m < lanes; m <<= 1) ss = add_rn(ss, tq_shfl_xor(ss, static_cast<int>(m)));
  return sqrt_rn(ss);
}

// A row's value scale s (returned) and zero mn over its `lanes` lanes: mn, mx the min and max
// of the non-NaN elements (the GPU's min and max skip NaN, the NaN padding too; lane-local,
// then shuffles), both 0 if none, a zero mn +0; s = RN(RN(mx - mn) / L), FL unless s > FL.
template <int E>
KVW_HD float tq_value_scale(const float (&v)[E], u32 lanes, float L, float& mn_out) {
  float mn = bits_f32(0x7F800000u), mx = -mn;  // +inf, -inf: no value yet
#pragma unroll
  for (int e = 0; e < E; ++e) {
    mn = fminf(mn, v[e]);
    mx = fmaxf(mx, v[e]);
  }
  for (u32 m = 1; m < lanes; m <<= 1) {
    mn = fminf(mn, tq_shfl_xor(mn, static_cast<int>(m)));
    mx = fmaxf(mx, tq_shfl_xor(mx, static_cast<int>(m)));
  }
  if (!(mn <= mx)) mn = mx = 0.0f;  // no non-NaN value
  if (mn == 0.0f) mn = 0.0f;        // a zero mn is +0
  float s = div_rn(sub_rn(mx, mn), L);
  if (!(s > TQ_EPS)) s = TQ_EPS;
  mn_out = mn;
  return s;
}

// k8v4's staging (E >= 8, whole rows of 4-byte aligned slots): a warp's rows' slots are
// assembled in shared memory and then stored word by word, consecutive lanes on consecutive
// words, instead of each lane storing its own bytes (E / 4 key words and E / 8 value words at a
// stride of E and E / 2 bytes, every store instruction writing a part of each sector of its
// rows). Words a warp: rows (32 E / P) times slot words ((1.5 P + 4) / 4), at most 12 E + 32
// (P >= E).
template <int E>
__host__ __device__ constexpr int tq_stage_words() { return 12 * E + 32; }

template <int IN, int KB, int VB, typename SlotT, int E, int CTA>
__global__ void __launch_bounds__(CTA, 1) tq_kernel(
    const u8* __restrict__ key,    // [T_pad, H, D] of kind IN via (k_tok, k_head, 1) elements
    const u8* __restrict__ value,  // [T_pad, H, D] via (v_tok, v_head, 1)
    u8* __restrict__ cache,        // [num_blocks, block_size, H, S] bytes via (c_blk, c_page, c_head, 1)
    const SlotT* __restrict__ slot_mapping,  // [T]
    const float* __restrict__ pit,  // MSE: [D, D] via (pit_s0, pit_s1); k8v4: unused
    const float* __restrict__ mid,  // MSE: [2^KB - 1] via mid_s; k8v4: unused
    const int* __restrict__ flags,  // tq_check_kernel's (num_flags > 0) or unused
    i64 num_tokens,
    i64 row_warps_log2,  // MSE: log2 of the warps of a CTA that take rows (k8v4: every one)
    i64 num_flags,       // flags' entries (0: the CTA checks the table itself)
    TQ_FIXED_PARAMS) {
  KVW_PDL_ENTRY();
  TQ_FIXED_PROLOGUE()
  static_assert(KB == 8 || KB == 4 || KB == 3, "key bits");
  static_assert(VB == 4 || VB == 3, "value bits");
  static_assert(E >= 2 && E <= 32 && (E & (E - 1)) == 0, "elements per lane");
  constexpr bool MSE = KB != 8;
  static_assert(CTA % 32 == 0 && CTA >= 32 && CTA <= 512, "threads of a CTA");
  static_assert(!MSE || CTA * (E + 1) * 4 <= 40 * 1024, "the MSE rows' shared u (s_u) fit");
  constexpr u32 NM = MSE ? (1u << KB) - 1u : 1u;  // midpoints
  // The generic rotation's u rows (row stride P + 1: the warp's rows in different banks).
  __shared__ float s_u[MSE ? CTA * (E + 1) : 1];
  constexpr bool STAGE = !MSE && E >= 8;
  __shared__ u32 s_stage[STAGE ? (CTA / 32) * tq_stage_words<E>() : 1];
  __shared__ float s_mid[16];
  __shared__ int s_sorted;

  const u32 d = static_cast<u32>(head_size), p = static_cast<u32>(p2);
  const u32 tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
  const u32 lpr = p / E;  // lanes per row, a power of two <= 32
  const u32 lg_lpr = 31u - static_cast<u32>(__clz(lpr));
  const u32 r = lane & (lpr - 1u);  // the lane's place in its row
  const u32 sub = lane >> lg_lpr;   // the row's place in the warp
  const u32 rpw = 32u >> lg_lpr;    // rows per warp
  const u32 lg_rpw = 5u - lg_lpr;
  const u32 i0 = r * E;             // the lane's first element

  // A lane's rows: first + sub, then rows_per_pass apart, each a (token t, head hh): the first
  // by one division, each later one by a step of (rows_per_pass / H, rows_per_pass % H) with
  // one carry. A row is fetched a pass ahead (TqRaw): its slot and, where they fit, its chunks'
  // bytes. Past D: key +0 (the trees' padding leaves), value NaN (min and max skip it; its codes
  // land in no stored byte); a row past the rows (t >= T) has slot -1 and zeros.
  const i64 rows = num_tokens * num_heads;
  // MSE: warps from 2^row_warps_log2 on take no rows; they share the CTA's setup (the
  // midpoints, and the flags or the table check's loads) and leave, so a small call's few rows
  // spread over more CTAs. Shifts, not products: the first row's index is on a small call's critical path
  // (products cost k8v4 0.5-2.5%, tuning-log 120). k8v4 (no table): every warp, as constants.
  const u32 lg_rw = MSE ? static_cast<u32>(row_warps_log2) : 0u;
  const i64 rows_per_pass = MSE ? static_cast<i64>(gridDim.x) << (lg_rw + lg_rpw)
                                : static_cast<i64>(gridDim.x) * (CTA / 32) * rpw;
  const bool small = rows + rows_per_pass <= 0xFFFFFFFFll;  // every row index and the step fit
  auto divmod_heads = [&](i64 n, i64& q, i64& m) {
    q = small ? static_cast<i64>(static_cast<u32>(n) / static_cast<u32>(num_heads))
              : n / num_heads;
    m = n - q * num_heads;
  };
  struct Row {
    i64 t, hh, slot;
    TqRaw<IN, E> k, v;
  };
  auto fetch = [&](Row& w) {
    if (w.t < num_tokens) {
      w.slot = static_cast<i64>(slot_mapping[w.t]);
      tq_fetch_chunk<IN, E>(key + (w.t * k_tok + w.hh * k_head) * elem_bytes(IN), i0, d, w.k);
      tq_fetch_chunk<IN, E>(value + (w.t * v_tok + w.hh * v_head) * elem_bytes(IN), i0, d, w.v);
    } else {
      w.slot = -1;
      if constexpr (TqRaw<IN, E>::PF) {  // zeros, unpacked as a whole chunk: no branch a pass
        w.k.vec = w.v.vec = true;
#pragma unroll
        for (int c = 0; c < TqRaw<IN, E>::NB / 16; ++c) w.k.q[c] = w.v.q[c] = make_uint4(0, 0, 0, 0);
      }
    }
  };
  const i64 first =
      !MSE               ? (static_cast<i64>(blockIdx.x) * (CTA / 32) + warp) * rpw
      : warp < (1u << lg_rw) ? ((static_cast<i64>(blockIdx.x) << lg_rw) + warp) << lg_rpw
                             : rows;
  i64 step_t, step_h;
  divmod_heads(rows_per_pass, step_t, step_h);
  Row cur;
  divmod_heads(first + sub, cur.t, cur.hh);
  // The first pass's rows are fetched before the setup's loads, so that at a few tokens the
  // round trips overlap.
  fetch(cur);

  // ---- the CTA's setup (MSE): the midpoints, their order, the table's structure ----
  bool hadamard = false;
  float h = 0.0f;
  if constexpr (MSE) {
    // The midpoints' load is issued here and waited for after the table's or the flags' (their
    // order is checked once both have arrived): at a few tokens the setup is one round trip.
    const float mid_t = tid < NM ? mid[static_cast<i64>(tid) * mid_s] : 0.0f;
    int bad = 1;
    if (d == p && num_flags > 0) {  // tq_check_kernel's verdict: any flag set
      bad = 0;
      for (u32 k = tid; k < num_flags; k += CTA) bad |= flags[k];
      h = pit[0];
    } else if (d == p) {  // compare every entry with its Sylvester sign times PiT[0, 0]
      bad = 0;
      const u32 hb = f32_bits(pit[0]);
      const u32 lg_d = 31u - static_cast<u32>(__clz(d));
      const u32 dd = d * d;
      u32 misses = 0u;
      const bool vec = pit_s1 == 1 && pit_s0 == d && d >= 4 &&
                       (reinterpret_cast<unsigned long long>(pit) & 15u) == 0;
      if (vec) {
        // B 16-byte loads in flight per thread before any compare (at T = 1 this check is on
        // the critical path: D = 128 takes 8 a thread of a 512-thread CTA, one round trip).
        const uint4* p4 = reinterpret_cast<const uint4*>(pit);
        const u32 n4 = dd / 4;
        constexpr u32 B = tq_check_batch<E, CTA>();
        for (u32 q0 = tid; q0 < n4; q0 += B * CTA) {
          uint4 w4[B];
#pragma unroll
          for (u32 k = 0; k < B; ++k)
            if (q0 + k * CTA < n4) w4[k] = p4[q0 + k * CTA];
#pragma unroll
          for (u32 k = 0; k < B; ++k) {
            const u32 q = q0 + k * CTA;
            if (q < n4) misses |= tq_hadamard_misses(w4[k], 4 * q, lg_d, hb);
          }
        }
        bad = misses != 0u ? 1 : 0;
      } else {
        for (u32 k = tid; k < dd; k += CTA) {
          const u32 i = k >> lg_d, j = k & (d - 1u);
          const u32 w = f32_bits(pit[static_cast<i64>(i) * pit_s0 + static_cast<i64>(j) * pit_s1]);
          bad |= w != tq_sylvester_bits(hb, i, j) ? 1 : 0;
        }
      }
      h = bits_f32(hb);
    }
    if (tid < NM) s_mid[tid] = mid_t;
    __syncthreads();
    if (tid == 0) {
      int sorted = 1;
      for (u32 k = 0; k + 1 < NM; ++k) sorted &= s_mid[k] <= s_mid[k + 1] ? 1 : 0;
      s_sorted = sorted;
    }
    hadamard = __syncthreads_or(bad) == 0;  // CTA-uniform (s_sorted is visible after it too)
  }
  const bool sorted = MSE && s_sorted != 0;
  // k8v4's slot words (key d bytes, value d VB / 8, scale and zero 4), and whether the stores are
  // staged (tq_stage_words): more than TQ_STAGE_PASSES passes, whole rows (d == P) and every
  // slot 4-byte aligned.
  const u32 slot_words = (d + d * VB / 8 + 4) / 4;
  const bool stage = STAGE && rows > TQ_STAGE_PASSES * rows_per_pass && d == p &&
      ((reinterpret_cast<unsigned long long>(cache) | static_cast<unsigned long long>(
           c_blk | c_page | c_head)) & 3u) == 0;

  for (i64 base = first; base < rows; base += rows_per_pass) {  // warp-uniform
    float x[E], v[E];
    if (TqRaw<IN, E>::PF || cur.t < num_tokens) {
      tq_unpack_chunk<IN, E>(cur.k, i0, d, 0.0f, x);
      tq_unpack_chunk<IN, E>(cur.v, i0, d, bits_f32(0x7FC00000u), v);
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) x[e] = v[e] = 0.0f;
    }
    const i64 slot = cur.slot, hh = cur.hh;
    // The next pass's row, fetched while this one is quantized.
    cur.hh += step_h;
    cur.t += step_t;
    if (cur.hh >= num_heads) {
      cur.hh -= num_heads;
      ++cur.t;
    }
    if (base + rows_per_pass < rows) fetch(cur);  // warp-uniform
    const bool write = slot >= 0 && slot < num_slots;
    u8* dst = cache + (write ? slot_offset(slot, c_blk, c_page, block_size, block_shift,
                                           num_slots <= 0xFFFFFFFFll) + hh * c_head : 0);

    // ---- keys ----
    u32 kps;  // the key part's bytes
    if constexpr (!MSE) {
      if (write && !stage) tq_store_field<8, E>(dst, tq_e4m3_field<E>(x), r, d);
      kps = d;
    } else {
      // tq_key_norm's steps, written out: the call compiles the E = 32 variants to other
      // integer instructions (same count), not yet run on a GPU.
      float sq[E];
#pragma unroll
      for (int e = 0; e < E; ++e) sq[e] = mul_rn(x[e], x[e]);  // padding: +0 * +0 = +0
      float ss = qkn_tree<E>(sq);
      for (u32 m = 1; m < lpr; m <<= 1) ss = add_rn(ss, tq_shfl_xor(ss, static_cast<int>(m)));
      const float n = sqrt_rn(ss);
      const float den = add_rn(n, TQ_EPS);
      const bool kfast = tq_div_fast(den);
      const float yd = rcp_rn(den);
      float y[E], u[E];
      tq_div_row<E>(u, x, den, yd, kfast);
      if (hadamard) {
#pragma unroll
        for (int e = 0; e < E; ++e) y[e] = mul_rn(u[e], h);
#pragma unroll
        for (int st = 1; st < E; st <<= 1) {
#pragma unroll
          for (int e = 0; e < E; ++e) {
            if (e & st) continue;
            const float a = y[e], b = y[e + st];
            y[e] = add_rn(a, b);
            y[e + st] = sub_rn(a, b);
          }
        }
        for (u32 m = 1; m < lpr; m <<= 1) {
          // (a, b) -> (a + b, a - b): the lower lane adds its partner's value, the upper one
          // adds its own negated (RN(o + (-y)) is RN(o - y), IEEE's subtraction).
          const u32 neg = (r & m) != 0 ? 0x80000000u : 0u;
#pragma unroll
          for (int e = 0; e < E; ++e) {
            const float o = tq_shfl_xor(y[e], static_cast<int>(m));
            y[e] = add_rn(bits_f32(f32_bits(y[e]) ^ neg), o);
          }
        }
      } else {
        float* urow = s_u + (warp * rpw + sub) * (p + 1u);
        __syncwarp();  // the warp's rows of the last pass are read
#pragma unroll
        for (int e = 0; e < E; ++e)
          urow[i0 + e] = u[e];  // +0 past D (0 / den)
        __syncwarp();
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const u32 j = i0 + e;
          // Chunks of min(8, E) leaves (E < 8 only where P = E).
          y[e] = j < d ? tq_rotate_one<(E < 8 ? E : 8)>(urow, pit, pit_s0, pit_s1, j, d, p) : 0.0f;
        }
      }
      u32 c[E];
      if (sorted) {
        // The search's first two levels from registers (their three midpoints read once a
        // row), the rest from shared memory.
        constexpr u32 H1 = (NM + 1) / 2, H2 = H1 / 2;
        const float m1 = s_mid[H1 - 1], m2lo = s_mid[H2 - 1], m2hi = s_mid[H1 + H2 - 1];
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const bool up = y[e] >= m1;
          u32 idx = up ? H1 : 0u;
          idx += y[e] >= (up ? m2hi : m2lo) ? H2 : 0u;
#pragma unroll
          for (u32 step = H2 / 2; step; step >>= 1)
            idx += y[e] >= s_mid[idx + step - 1] ? step : 0u;
          c[e] = idx;
        }
      } else {
#pragma unroll
        for (int e = 0; e < E; ++e) {
          u32 idx = 0;
#pragma unroll
          for (u32 k = 0; k < NM; ++k) idx += y[e] >= s_mid[k] ? 1u : 0u;
          c[e] = idx;
        }
      }
      // (Codes past D land in no stored byte: the field ends with element D - 1's bits.)
      const u32 nb = d * KB / 8;
      if (write) {
        tq_store_field<KB, E>(dst, c, r, d);
        if (r == 0) tq_store_f16(dst + nb, n);
      }
      kps = nb + 2;
    }

    // ---- values ----
    constexpr float L = static_cast<float>((1 << VB) - 1);
    float mn;
    const float s = tq_value_scale<E>(v, lpr, L, mn);
    const bool vfast = tq_div_fast(s);
    const float ys = rcp_rn(s);
    float w[E];
#pragma unroll
    for (int e = 0; e < E; ++e) w[e] = sub_rn(v[e], mn);
    u32 q[E];
    tq_value_codes<E>(q, w, s, ys, vfast, L);
    if constexpr (STAGE) {
      if (stage) {  // warp-uniform
        constexpr int KW = E / 4, VW = E * VB / 32;  // a lane's key and value words
        u32* mine = s_stage + warp * tq_stage_words<E>();
        u32* row = mine + sub * slot_words;
        const TqField<8, E> kf = tq_e4m3_field<E>(x);
        const TqField<VB, E> vf = tq_pack<VB, E, KVW_2P23_BITS>(q);
        __syncwarp();  // the last pass's rows are stored
#pragma unroll
        for (int k = 0; k < KW; ++k) row[r * KW + k] = kf.w[k];
#pragma unroll
        for (int k = 0; k < VW; ++k) row[d / 4 + r * VW + k] = vf.w[k];
        if (r == 0) row[slot_words - 1] = tq_f16_bits(s) | tq_f16_bits(mn) << 16;
        __syncwarp();
        const i64 at = write ? reinterpret_cast<i64>(dst) : 0;
        for (u32 j = 0; j < rpw; ++j) {
          const i64 pj = shfl_i64(at, static_cast<int>(j << lg_lpr));
          if (pj == 0) continue;  // warp-uniform: row j writes nothing
          const u32* src = mine + j * slot_words;
          for (u32 k = lane; k < slot_words; k += 32u) reinterpret_cast<u32*>(pj)[k] = src[k];
        }
        continue;
      }
    }
    if (write) {
      const u32 vdb = d * VB / 8;
      u8* vdst = dst + kps;
      tq_store_field<VB, E, KVW_2P23_BITS>(vdst, q, r, d);
      if (r == 0) {
        tq_store_f16(vdst + vdb, s);
        tq_store_f16(vdst + vdb + 2, mn);
      }
    }
  }
}

// ---- small calls of the MSE presets: tq_split_kernel ----
// One warp a (row, slice): the slice is TQ_SPLIT_J = 8 of the row's output coordinates
// [j0, j0 + 8), so a row's rotation is spread over ceil(D / 8) warps, each reading only its
// 8 columns of PiT (D = 128: 4 KiB of the 64 KiB) and no warp waiting for a check of the whole
// table: every output is the tree of its products whatever the table (the generic path of
// tq_kernel, without the Hadamard shortcut and hence without its check). For calls of a few
// rows (the launcher's split_warps), where tq_kernel's chain (the table check, then each row on
// one warp) is the call's time.
// Layout: lane l holds elements [l*E, l*E + E) of the row (32 lanes, P = 32 E, the padded head
// size; +0 past D in the key, NaN in the value), so every sum is the lane's tree of E leaves
// then shuffles at distances 1 .. 16 (the same neighbours as §7.1's tree, as in tq_kernel).
// Each warp recomputes the row's norm and the value's range (a few instructions). A CTA's warps
// take neighbouring rows of one slice (slice-major), so they read the same 8 columns.
// - The 8 outputs' trees: the lane's products u_i * PiT[i, j0 + c] (its E rows i, 8 columns)
//   summed by qkn_tree, then a reduce-scatter: at distance 1, 2, 4 each lane keeps the half of
//   the coordinates its bit 1, 2, 4 selects and adds its partner's partial of that half (the
//   partner's subtree: the tree's neighbour); lane l then holds coordinate c(l) = 4 b0 + 2 b1 +
//   b2 (b_k bit k of l) over 8 lanes, and distances 8 and 16 finish the tree. 7 + 2 shuffles
//   for 8 outputs instead of 40.
// - idx = #{k : y >= m_k}, counted against every midpoint (no order assumed, so no order check);
//   the 8 codes OR-ed over lanes 0..7 into one field of KB bytes: field bytes [j0 KB / 8,
//   (j0 + 8) KB / 8), stored by lane 0 (fewer where D - j0 < 8: whole bytes, as D is even and
//   3-bit fields need D % 8 == 0).
// - values: each lane's E codes as tq_kernel's (tq_value_codes), those of [j0, j0 + 8) OR-ed
//   over the 8 / E lanes holding them into VB bytes, stored by the first of those lanes.
// - slice 0 also stores the norm, the scale and the zero.
// The launcher's conditions (split_elems): the MSE presets, P = 32 E (E = 2, 4), rows * slices
// < 2^31.
#define TQ_SPLIT_J 8u

KVW_HD float tq_shfl(float v, int src) {
  return bits_f32(__shfl_sync(0xFFFFFFFFu, f32_bits(v), src));
}
KVW_HD u32 tq_or_xor(u32 v, int m) { return v | __shfl_xor_sync(0xFFFFFFFFu, v, m); }

// x[e] = element i0 + e of a row (kind IN) for i0 + e < d, else pad: one load of the lane's
// E * elem_bytes(IN) bytes where they are whole and aligned, else element by element.
template <int IN, int E>
KVW_HD void tq_load_lane(const u8* row, u32 i0, u32 d, float pad, float (&x)[E]) {
  constexpr int N = E * elem_bytes(IN);
  constexpr unsigned long long A = N < 16 ? N : 16;
  const u8* p = row + static_cast<i64>(i0) * elem_bytes(IN);
  if (i0 + E <= d && (reinterpret_cast<unsigned long long>(p) & (A - 1u)) == 0) {
    const Raw<N> r = load_raw<N>(p);
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = elem_f32<IN, N>(r, e);
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = i0 + e < d ? tq_elem<IN>(p, e) : pad;
  }
}

template <int IN, int KB, int VB, typename SlotT, int E, int CTA>
__global__ void __launch_bounds__(CTA) tq_split_kernel(
    const u8* __restrict__ key,    // [T_pad, H, D] of kind IN via (k_tok, k_head, 1) elements
    const u8* __restrict__ value,  // [T_pad, H, D] via (v_tok, v_head, 1)
    u8* __restrict__ cache,        // [num_blocks, block_size, H, S] bytes via (c_blk, c_page, c_head, 1)
    const SlotT* __restrict__ slot_mapping,  // [T]
    const float* __restrict__ pit,  // [D, D] via (pit_s0, pit_s1)
    const float* __restrict__ mid,  // [2^KB - 1] via mid_s
    i64 num_tokens, TQ_FIXED_PARAMS) {
  KVW_PDL_ENTRY();
  TQ_FIXED_PROLOGUE()
  static_assert(KB == 4 || KB == 3, "key bits (the MSE presets)");
  static_assert(VB == 4 || VB == 3, "value bits");
  static_assert(E == 2 || E == 4, "elements per lane");
  static_assert(CTA % 32 == 0 && CTA <= 1024, "threads of a CTA");
  constexpr u32 J = TQ_SPLIT_J, NM = (1u << KB) - 1u;
  const u32 d = static_cast<u32>(head_size), lane = threadIdx.x & 31u, i0 = lane * E;
  const u32 h = static_cast<u32>(num_heads);
  const u32 rows = static_cast<u32>(num_tokens) * h;
  const u32 g = blockIdx.x * (CTA / 32) + (threadIdx.x >> 5);
  const u32 slice = g / rows, row = g - slice * rows;  // slice-major: a CTA's warps share columns
  const u32 j0 = slice * J;
  if (j0 >= d) return;  // warp-uniform: the grid's last CTA
  const u32 t = row / h, hh = row - t * h;
  const i64 slot = static_cast<i64>(slot_mapping[t]);
  float x[E], v[E];
  tq_load_lane<IN, E>(key + (t * k_tok + hh * k_head) * elem_bytes(IN), i0, d, 0.0f, x);
  tq_load_lane<IN, E>(value + (t * v_tok + hh * v_head) * elem_bytes(IN), i0, d,
                      bits_f32(0x7FC00000u), v);
  // The lane's part of the slice's columns: a[e][c] = PiT[i0 + e, j0 + c], 0 past D (the
  // padding leaves are +0: u = +0 there).
  float a[E][J];
  const bool tvec = pit_s1 == 1 && (pit_s0 & 3) == 0 && j0 + J <= d &&
                    (reinterpret_cast<unsigned long long>(pit) & 15u) == 0;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const u32 i = i0 + e;
    const float* prow = pit + static_cast<i64>(i) * pit_s0 + static_cast<i64>(j0) * pit_s1;
    if (i < d && tvec) {
      const uint4 q0 = reinterpret_cast<const uint4*>(prow)[0];
      const uint4 q1 = reinterpret_cast<const uint4*>(prow)[1];
      const u32 w[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
      for (u32 c = 0; c < J; ++c) a[e][c] = bits_f32(w[c]);
    } else {
#pragma unroll
      for (u32 c = 0; c < J; ++c)
        a[e][c] = i < d && j0 + c < d ? prow[static_cast<i64>(c) * pit_s1] : 0.0f;
    }
  }
  const float mid_t = lane < NM ? mid[static_cast<i64>(lane) * mid_s] : 0.0f;

  // ---- keys: the norm, u, the slice's outputs, their codes ----
  const float n = tq_key_norm<E>(x, 32u);
  const float den = add_rn(n, TQ_EPS);
  float u[E];
  tq_div_row<E>(u, x, den, rcp_rn(den), tq_div_fast(den));
  float part[J];
#pragma unroll
  for (u32 c = 0; c < J; ++c) {
    float leaf[E];
#pragma unroll
    for (int e = 0; e < E; ++e) leaf[e] = mul_rn(u[e], a[e][c]);
    part[c] = qkn_tree<E>(leaf);
  }
  // The reduce-scatter (distances 1, 2, 4), then the tree's last two levels.
  const bool b0 = (lane & 1u) != 0, b1 = (lane & 2u) != 0, b2 = (lane & 4u) != 0;
  float r1[4], r2[2];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    r1[k] = add_rn(b0 ? part[k + 4] : part[k], tq_shfl_xor(b0 ? part[k] : part[k + 4], 1));
#pragma unroll
  for (int k = 0; k < 2; ++k)
    r2[k] = add_rn(b1 ? r1[k + 2] : r1[k], tq_shfl_xor(b1 ? r1[k] : r1[k + 2], 2));
  float y = add_rn(b2 ? r2[1] : r2[0], tq_shfl_xor(b2 ? r2[0] : r2[1], 4));
  y = add_rn(y, tq_shfl_xor(y, 8));
  y = add_rn(y, tq_shfl_xor(y, 16));
  const u32 c_mine = (b0 ? 4u : 0u) + (b1 ? 2u : 0u) + (b2 ? 1u : 0u);
  u32 idx = 0;
#pragma unroll
  for (u32 k = 0; k < NM; ++k) idx += y >= tq_shfl(mid_t, static_cast<int>(k)) ? 1u : 0u;
  u32 kf = idx << (KB * c_mine);
  kf = tq_or_xor(kf, 1);
  kf = tq_or_xor(kf, 2);
  kf = tq_or_xor(kf, 4);

  // ---- values: the range over the row, the lane's codes, the slice's field ----
  constexpr float L = static_cast<float>((1 << VB) - 1);
  float mn;
  const float s = tq_value_scale<E>(v, 32u, L, mn);
  float w[E];
#pragma unroll
  for (int e = 0; e < E; ++e) w[e] = sub_rn(v[e], mn);
  u32 q[E];
  tq_value_codes<E>(q, w, s, rcp_rn(s), tq_div_fast(s), L);
  u32 vf = 0;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const u32 j = i0 + e;
    if (j >= j0 && j < j0 + J) vf |= (q[e] - KVW_2P23_BITS) << (VB * (j - j0));
  }
#pragma unroll
  for (int m = 1; m < static_cast<int>(J) / E; m <<= 1) vf = tq_or_xor(vf, m);

  if (slot < 0 || slot >= num_slots) return;
  u8* dst = cache + slot_offset(slot, c_blk, c_page, block_size, block_shift,
                                num_slots <= 0xFFFFFFFFll) + hh * c_head;
  const u32 nb = d * KB / 8, vdb = d * VB / 8;
  u8* vdst = dst + nb + 2;
  const u32 left = d - j0 < J ? d - j0 : J;  // the slice's coordinates below D
  if (lane == 0) {
    tq_store_bytes<KB>(dst + j0 * KB / 8, &kf, left * KB / 8);
    if (slice == 0) {
      tq_store_f16(dst + nb, n);
      tq_store_f16(vdst + vdb, s);
      tq_store_f16(vdst + vdb + 2, mn);
    }
  }
  if (lane == j0 / E) tq_store_bytes<VB>(vdst + j0 * VB / 8, &vf, left * VB / 8);
}
