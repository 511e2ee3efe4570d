// kvwrite: reshape_and_cache_turboquant: quantize each (token, head) of key and value into one
// TurboQuant slot of a paged byte cache (SPEC 10.1-10.2).
//
// Compiled at run time with NVRTC (see cuda_impl.py), one module per variant
// tq_kernel<IN, KB, VB, SlotT>: IN the input kind (DT_F16, DT_BF16, DT_F32), KB the key's bits
// (8: k8v4's e4m3fn codes; 4 or 3: MSE indices), VB the value's bits (4 or 3), SlotT the slot
// type (int or long long).
//
// One CTA of TQ_THREADS threads per (token, head), blockIdx.x = token * H + head. The slot is
// read first (a negative or out-of-range slot returns the whole CTA before anything is read or
// written); thread k holds elements k, k + TQ_THREADS, ... of the rows. Every float32 step is one
// explicitly rounded PTX instruction (common.cuh's add_rn, mul_rn, div_rn; qk_norm.cuh's
// sqrt_rn), so no compiler flag can contract or flush anything:
// - keys, k8v4: code_i = e4m3fn(x_i) by the satfinite conversion with no scale (fp8.cuh).
// - keys, MSE: ss = the padded pairwise tree (§7.1) of RN(x_i^2) in shared memory (level by
//   level, each node the sum of its left and right subtrees: the contract's tree);
//   n = RN(sqrt(ss)); den = RN(n + 1e-8f); u_i = RN(x_i / den) (u_i = +0 for i >= D, the padding
//   leaves); then thread j computes y_j = the same tree over i of RN(u_i * PiT[i, j]): subtrees
//   of 8 leaves in registers (qkn_tree) combined by a binary counter (the subtree of chunks c and
//   c + 1 is formed when chunk c + 1 ends: the same neighbours at every level); idx_j = the count
//   of midpoints m_k <= y_j (NaN: 0); the fields packed (below); fp16(n) after them.
// - values: mn, mx over the non-NaN elements (the GPU's min and max ignore NaN), both 0 if none,
//   a zero mn +0; s = RN(RN(mx - mn) / L), FL unless s > FL; q_i = clamp(rhu(RN(RN(v_i - mn) /
//   s)), 0, L) (round.cuh's rhu_clamp_code; NaN -> 0); fp16(s), fp16(mn) after the codes.
// - b-bit fields: code i in bits [b*i, b*i + b) of the field read as one little-endian integer;
//   byte B of a 3-bit field is byte B % 3 of the 24-bit group B / 3 (8 codes), of a 4-bit field
//   codes 2B (low nibble) and 2B + 1.
// Only the slot's slot_size bytes are written (the pad byte of slot_size_aligned never is).
// Shapes the launcher checks: D even, D <= TQ_MAXP (3-bit fields: D % 8 == 0).
// With KVWRITE_HOST_TEST (tests/test_turboquant_kernels.py's SIMT emulation, tests/gather_emu.h)
// the kernel runs on the CPU as written, the float16 widening in software.
#include "kvw/common.cuh"
#include "kvw/fp8.cuh"
#include "kvw/qk_norm.cuh"
#include "kvw/round.cuh"
#include "kvw/slot.cuh"
#include "kvw/vec_io.cuh"

#define TQ_THREADS 128
#define TQ_MAXP 1024  // the padded head size P (a power of two >= D) at most
#define TQ_EPS 1e-8f  // float32(1e-8): bits 0x322BCC77 (den = n + eps; the scale floor FL)

// Element i of a row of kind IN at p, as float32 (exact).
template <int IN>
KVW_HD float tq_elem(const u8* p, i64 i) {
  if constexpr (IN == DT_F32) {
    return reinterpret_cast<const float*>(p)[i];
  } else {
    const u32 h = reinterpret_cast<const u16*>(p)[i];
    if constexpr (IN == DT_BF16) {
      return bits_f32(h << 16);
    } else {
#ifdef KVWRITE_HOST_TEST
      _Float16 f;  // the SIMT emulation's host build (tests): exact
      __builtin_memcpy(&f, &h, 2);
      return static_cast<float>(f);
#else
      float f;
      asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<u16>(h)));
      return f;
#endif
    }
  }
}

// In place, the tree over buf[0 .. P) (P a power of two): at stride st, node i*2st becomes
// RN(left + right) of its two subtrees. The CTA's threads; buf[0] ends with the sum.
KVW_HD void tq_tree_shared(float* buf, u32 p) {
  for (u32 st = 1; st < p; st <<= 1) {
    __syncthreads();
    for (u32 i = threadIdx.x; i * 2 * st < p; i += TQ_THREADS)
      buf[i * 2 * st] = add_rn(buf[i * 2 * st], buf[i * 2 * st + st]);
  }
  __syncthreads();
}

// y_j = the tree over i < P of RN(u_i * PiT[i, j]) (+0 for i >= D): chunks of CH leaves (CH =
// min(8, P)) summed by qkn_tree, chunk sums combined by a binary counter (level l's pending
// left subtree in stk[l]).
template <int CH>
KVW_HD float tq_rotate_one(const float* u, const float* pit, i64 s0, i64 s1, u32 j, u32 d, u32 p) {
  float stk[11];
  const u32 chunks = p / CH;
  u32 top = 0;
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

// Byte B of a field of b-bit codes (b = 3 or 4) held one per byte in `codes`.
template <int B>
KVW_HD u32 tq_field_byte(const u8* codes, u32 byte) {
  if constexpr (B == 4) {
    return codes[2 * byte] | (static_cast<u32>(codes[2 * byte + 1]) << 4);
  } else {
    const u32 g = byte / 3;
    u32 w = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) w |= static_cast<u32>(codes[8 * g + k]) << (3 * k);
    return (w >> (8 * (byte - 3 * g))) & 0xFFu;
  }
}

// fp16(v) little-endian at p; a NaN as 0x7E00 (the contract leaves a NaN norm's encoding free:
// one fixed pattern makes every implementation's bytes equal).
KVW_HD void tq_store_f16(u8* p, float v) {
  const u32 h = v == v ? f16ish_from_f32<DT_F16>(v) : 0x7E00u;
  p[0] = static_cast<u8>(h & 0xFFu);  // little-endian; the field may be at an odd byte
  p[1] = static_cast<u8>(h >> 8);
}

template <int IN, int KB, int VB, typename SlotT>
__global__ void __launch_bounds__(TQ_THREADS) tq_kernel(
    const u8* __restrict__ key,    // [T_pad, H, D] of kind IN via (k_tok, k_head, 1) elements
    const u8* __restrict__ value,  // [T_pad, H, D] via (v_tok, v_head, 1)
    u8* __restrict__ cache,        // [num_blocks, block_size, H, S] bytes via (c_blk, c_page, c_head, 1)
    const SlotT* __restrict__ slot_mapping,  // [T]
    const float* __restrict__ pit,  // MSE: [D, D] via (pit_s0, pit_s1); k8v4: unused
    const float* __restrict__ mid,  // MSE: [2^KB - 1] via mid_s; k8v4: unused
    i64 num_heads, i64 head_size, i64 p2,  // H, D, P (the power of two >= D)
    i64 k_tok, i64 k_head, i64 v_tok, i64 v_head,
    i64 c_blk, i64 c_page, i64 c_head, i64 block_size, i64 block_shift, i64 num_slots,
    i64 pit_s0, i64 pit_s1, i64 mid_s) {
  KVW_PDL_ENTRY();
  static_assert(KB == 8 || KB == 4 || KB == 3, "key bits");
  static_assert(VB == 4 || VB == 3, "value bits");
  __shared__ float s_x[TQ_MAXP];   // the key row (then u)
  __shared__ float s_sq[TQ_MAXP];  // the squares' tree
  __shared__ u8 s_kc[TQ_MAXP];     // key indices
  __shared__ u8 s_vc[TQ_MAXP];     // value codes
  __shared__ float s_mid[16];
  __shared__ float s_mn[TQ_THREADS / 32], s_mx[TQ_THREADS / 32];

  const i64 row = blockIdx.x;
  const i64 t = row / num_heads, h = row - t * num_heads;
  const i64 slot = static_cast<i64>(slot_mapping[t]);
  if (slot < 0 || slot >= num_slots) return;  // padding: the whole CTA leaves
  const u32 d = static_cast<u32>(head_size), p = static_cast<u32>(p2);
  const u32 tid = threadIdx.x;
  u8* dst = cache + slot_offset(slot, c_blk, c_page, block_size, block_shift,
                                num_slots <= 0xFFFFFFFFll) + h * c_head;
  const u8* krow = key + (t * k_tok + h * k_head) * elem_bytes(IN);
  const u8* vrow = value + (t * v_tok + h * v_head) * elem_bytes(IN);

  // ---- keys ----
  constexpr u32 KF = KB == 8 ? 0 : (KB * 1u);  // MSE field bits
  u32 kps;  // the key part's bytes
  if constexpr (KB == 8) {
    for (u32 i = tid; i < d; i += TQ_THREADS) {
      // A NaN's code 0x7F whatever its sign (the contract leaves it free; one pattern for all).
      const float x = tq_elem<IN>(krow, i);
      dst[i] = x == x ? static_cast<u8>(fp8x2_from_f32<DT_E4M3>(x, 0.0f) & 0xFFu) : 0x7F;
    }
    kps = d;
  } else {
    constexpr u32 NM = (1u << KF) - 1u;
    if (tid < NM) s_mid[tid] = mid[static_cast<i64>(tid) * mid_s];
    for (u32 i = tid; i < p; i += TQ_THREADS) {
      const float x = i < d ? tq_elem<IN>(krow, i) : 0.0f;
      s_x[i] = x;
      s_sq[i] = i < d ? mul_rn(x, x) : 0.0f;
    }
    tq_tree_shared(s_sq, p);
    const float n = sqrt_rn(s_sq[0]);
    const float den = add_rn(n, TQ_EPS);
    for (u32 i = tid; i < p; i += TQ_THREADS) s_x[i] = i < d ? div_rn(s_x[i], den) : 0.0f;
    __syncthreads();
    for (u32 j = tid; j < d; j += TQ_THREADS) {
      float y;
      if (p >= 8) y = tq_rotate_one<8>(s_x, pit, pit_s0, pit_s1, j, d, p);
      else if (p == 4) y = tq_rotate_one<4>(s_x, pit, pit_s0, pit_s1, j, d, p);
      else y = tq_rotate_one<2>(s_x, pit, pit_s0, pit_s1, j, d, p);
      u32 idx = 0;
#pragma unroll
      for (u32 k = 0; k < NM; ++k) idx += y >= s_mid[k] ? 1u : 0u;
      s_kc[j] = static_cast<u8>(idx);
    }
    __syncthreads();
    const u32 nb = d * KF / 8;
    for (u32 b = tid; b < nb; b += TQ_THREADS) dst[b] = static_cast<u8>(tq_field_byte<KF>(s_kc, b));
    if (tid == 0) tq_store_f16(dst + nb, n);
    kps = nb + 2;
  }

  // ---- values ----
  constexpr float L = static_cast<float>((1 << VB) - 1);
  float mn = bits_f32(0x7F800000u), mx = -mn;  // +inf, -inf: no value yet
  for (u32 i = tid; i < d; i += TQ_THREADS) {
    const float v = tq_elem<IN>(vrow, i);
    s_sq[i] = v;  // s_sq is free again (the key's last read was before a barrier)
    mn = fminf(mn, v);  // NaN ignored
    mx = fmaxf(mx, v);
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) {
    mn = fminf(mn, __shfl_xor_sync(0xFFFFFFFFu, mn, m));
    mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, m));
  }
  if ((tid & 31u) == 0) {
    s_mn[tid >> 5] = mn;
    s_mx[tid >> 5] = mx;
  }
  __syncthreads();
#pragma unroll
  for (int w = 0; w < TQ_THREADS / 32; ++w) {
    mn = fminf(mn, s_mn[w]);
    mx = fmaxf(mx, s_mx[w]);
  }
  if (!(mn <= mx)) mn = mx = 0.0f;  // no non-NaN value
  if (mn == 0.0f) mn = 0.0f;        // a zero mn is +0
  float s = div_rn(sub_rn(mx, mn), L);
  if (!(s > TQ_EPS)) s = TQ_EPS;
  for (u32 i = tid; i < d; i += TQ_THREADS)
    s_vc[i] = static_cast<u8>(rhu_clamp_code(div_rn(sub_rn(s_sq[i], mn), s), 0.5f, L));
  __syncthreads();
  const u32 vdb = d * VB / 8;
  u8* vdst = dst + kps;
  for (u32 b = tid; b < vdb; b += TQ_THREADS) vdst[b] = static_cast<u8>(tq_field_byte<VB>(s_vc, b));
  if (tid == 0) {
    tq_store_f16(vdst + vdb, s);
    tq_store_f16(vdst + vdb + 2, mn);
  }
}
