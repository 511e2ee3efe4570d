// kvwrite: NVFP4 cache writes (docs/ops/nvfp4.md): each group of 16 elements of a key or value
// head becomes 8 bytes of E2M1 codes and one E4M3 scale byte (kvw/nvfp4.cuh's group rule), stored
// through four byte views: K data, K scales, V data, V scales, each a logical
// [num_blocks, block_size, H, n] array with a unit last stride (n = D/2 or D/16). vLLM's page
// layout and FlashInfer's separate tensors are both such views.
//
// Compiled at run time with NVRTC (see cuda_impl.py): one module per instantiation and, by
// default, per call signature, with the arguments fixed by the views and the inputs' layout
// compiled in (KVWRITE_FIXED_ARGS).
//
// Two kernels take the same arguments: nvfp4_kernel (large calls, and every call of the other
// shapes: one thread per one or two groups, K and V together) and nvfp4_small_kernel (small and
// mid-sized calls of the "nvfp4" rule: a group of one side over 1, 2 or 4 threads); see each
// below. Slots < 0 (padding) or >= num_slots are skipped; rows past num_tokens are never read.
// v_swizzle: V's scale byte of group g at offset t goes to row 4*(t/4) + g/(G/4), byte
// 4*(g % (G/4)) + t % 4 (G = D/16).
#include "kvw/common.cuh"
#include "kvw/fp8.cuh"
#include "kvw/nvfp4.cuh"
#include "kvw/vec_io.cuh"

#ifndef KVWRITE_HOST_TEST

#define KVW_NVFP4_PARAMS                                                                          \
    const u8* __restrict__ key,           /* [T_pad, H, D]; token stride key_stride (elements) */  \
    const u8* __restrict__ value,         /* [T_pad, H, D]; token stride value_stride */           \
    u8* __restrict__ k_data,              /* [num_blocks, block_size, H, D/2] via strides */       \
    u8* __restrict__ k_sf,                /* [num_blocks, block_size, H, D/16] via strides */      \
    u8* __restrict__ v_data,                                                                      \
    u8* __restrict__ v_sf,                                                                        \
    const SlotT* __restrict__ slot_mapping,  /* [num_tokens] */                                   \
    const float* __restrict__ k_scale,    /* [1], or null: k_scale_bits holds k */                 \
    const float* __restrict__ v_scale,                                                            \
    i64 k_scale_bits, i64 v_scale_bits,   /* float32 bits of k and v where the pointers are null */ \
    i64 num_tokens,                                                                               \
    i64 key_stride, i64 value_stride,     /* token strides in input elements */                   \
    i64 groups, i64 head_groups,          /* H * D/16, D/16 */                                    \
    i64 kd_sb, i64 kd_ss, i64 kd_sh,      /* K data strides (block, slot, head) in bytes */       \
    i64 ks_sb, i64 ks_ss, i64 ks_sh,      /* K scale strides */                                   \
    i64 vd_sb, i64 vd_ss, i64 vd_sh,                                                              \
    i64 vs_sb, i64 vs_ss, i64 vs_sh,                                                              \
    i64 block_size, i64 block_shift,      /* block_shift = log2(block_size), or -1 */             \
    i64 num_slots,                        /* num_blocks * block_size */                           \
    i64 v_swizzle                         /* 1: V's scales in the 4-token swizzle */

// In a build specialized for one call signature (-D KVWRITE_FIXED_ARGS=v0,...,v19) the arguments
// from key_stride on are compile-time constants: none is read from the parameter bank and the
// index math (the divisions by groups and head_groups included) folds.
#define KVW_NVFP4_FIXED_PROLOGUE() KVW_ASSIGN_FIXED_ARGS(key_stride, value_stride, groups,      \
    head_groups, kd_sb, kd_ss, kd_sh, ks_sb, ks_ss, ks_sh, vd_sb, vd_ss, vd_sh, vs_sb, vs_ss,   \
    vs_sh, block_size, block_shift, num_slots, v_swizzle)

// N bytes at an A-byte aligned address, as the widest accesses A allows (A a power of two).
// Whole chunks: plain loads of a const __restrict__ row (LDG.CONSTANT, cached in L1, so a
// thread's two 16-byte loads of one 32-byte group are one sector fetched from L2; volatile loads
// skip L1 and fetched it twice, a warp's load instruction taking half of each sector). Pieces
// (MODE 0's element loads, rare): ld.volatile, which ptxas issues in order, all before the work
// on them (plain, it interleaved them with the assembly of the words and waited between them).
template <int N, int A>
KVW_HD Raw<N> nvfp4_load(const u8* p) {
  if constexpr (A >= 16 || A >= N) {
    return load_raw<N>(p);
  } else {
    return load_pieces<N, A>(p, [](const u8* q) { return load_raw_volatile<A>(q); });
  }
}

// A scale: *p where p is not null (read on the device: a graph replay sees a new value), else
// the float32 whose bits are `bits` (a Python number's, FlashInfer's form).
KVW_HD float nvfp4_scale(const float* p, i64 bits) {
  return p != nullptr ? bits_f32(load_index(reinterpret_cast<const u32*>(p)))
                      : bits_f32(static_cast<u32>(bits));
}

// N code bytes (words w, little endian) at an A-aligned address, as the widest stores A allows.
template <int N, int A>
KVW_HD void nvfp4_store(u8* p, const u32* w) {
  constexpr int W = A < N ? A : N;
  if constexpr (W >= 4) {
#pragma unroll
    for (int i = 0; i < N / W; ++i) {
      Raw<W> piece;
#pragma unroll
      for (int k = 0; k < W / 4; ++k) piece.w[k] = w[i * W / 4 + k];
      store_raw<W>(p + i * W, piece);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N / W; ++i) {
      Raw<W> piece;
      piece.w[0] = (w[(i * W) / 4] >> (8 * ((i * W) & 3))) & ((1u << (8 * W)) - 1u);
      store_raw<W>(p + i * W, piece);
    }
  }
}

// N input elements (N * IB bytes) at an IN_ALIGN-aligned address: their raw words.
template <int IN, int N, int IN_ALIGN>
KVW_HD void nvfp4_load_raw(const u8* p, u32 (&w)[N * elem_bytes(IN) / 4]) {
  constexpr int BYTES = N * elem_bytes(IN);
  constexpr int CH = BYTES < 32 ? BYTES : 32;  // bytes per Raw chunk
#pragma unroll
  for (int c = 0; c < BYTES / CH; ++c) {
    const Raw<CH> a = nvfp4_load<CH, IN_ALIGN>(p + c * CH);
#pragma unroll
    for (int i = 0; i < CH / 4; ++i) w[c * (CH / 4) + i] = a.w[i];
  }
}

// The N elements of raw words as float32 (exact).
template <int IN, int N>
KVW_HD void nvfp4_widen(const u32 (&w)[N * elem_bytes(IN) / 4], float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if constexpr (IN == DT_F32) {
      x[i] = bits_f32(w[i]);
    } else if constexpr (IN == DT_BF16) {
      x[i] = bits_f32((i & 1) ? w[i >> 1] & 0xFFFF0000u : w[i >> 1] << 16);
    } else {
      float f;
      asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<u16>(w[i >> 1] >> (16 * (i & 1)))));
      x[i] = f;
    }
  }
}

// nvfp4_amax_nan of a group from its raw words: on sm_90 and later, 16-bit inputs by the 16-bit
// SIMD maximum on the words (nvfp4_amax_nan16), so that the floats are made only when the rule
// needs them; else from the floats.
template <int IN>
KVW_HD float nvfp4_group_amax(const u32 (&w)[4 * elem_bytes(IN)]) {
#if __CUDA_ARCH__ >= 900
  if constexpr (IN != DT_F32) return nvfp4_amax_nan16<IN == DT_BF16>(w);
#endif
  float x[16];
  nvfp4_widen<IN, 16>(w, x);
  return nvfp4_amax_nan(x);
}

// (block, offset in block) of slot s (0 <= s < num_slots), as Off: i64, or u32 where every
// byte offset into the views fits 32 bits (nvfp4_kv_kernel's OFF32; then s < num_slots < 2^32).
template <typename Off>
KVW_HD void nvfp4_block_of(i64 s, i64 block_size, i64 block_shift, i64 num_slots, Off* blk,
                           Off* pg) {
  if constexpr (sizeof(Off) == 4) {
    const u32 s32 = static_cast<u32>(s);
    if (block_shift >= 0) {
      *blk = s32 >> block_shift;
      *pg = s32 & static_cast<u32>(block_size - 1);
    } else {
      *blk = s32 / static_cast<u32>(block_size);
      *pg = s32 - *blk * static_cast<u32>(block_size);
    }
  } else if (block_shift >= 0) {
    *blk = s >> block_shift;
    *pg = s & (block_size - 1);
  } else if ((static_cast<u64>(num_slots) >> 32) == 0) {
    const u32 b32 = static_cast<u32>(s) / static_cast<u32>(block_size);
    *blk = b32;
    *pg = s - static_cast<i64>(b32) * block_size;
  } else {
    *blk = s / block_size;
    *pg = s - *blk * block_size;
  }
}

// V's scale byte of group g at block offset pg: (row, byte) in the 4-token swizzle (G = D/16
// groups a head): row 4*(pg/4) + g/(G/4), byte 4*(g % (G/4)) + pg % 4; linear: (pg, g).
KVW_HD void nvfp4_v_scale_at(i64 pg, u32 g, i64 head_groups, i64 v_swizzle, i64* row, i64* col) {
  *row = pg;
  *col = g;
  if (v_swizzle) {
    const u32 quarter = static_cast<u32>(head_groups) >> 2;  // D/64
    const u32 r = g / quarter;
    *row = (pg & ~3ll) + r;
    *col = 4 * static_cast<i64>(g - r * quarter) + (pg & 3);
  }
}

// The stores of nvfp4_kernel and nvfp4_kv_kernel: NG adjacent groups of K and of V from group q
// (of H * D/16) of slot s (0 <= s < num_slots), their codes (ck, cv: 8 * NG bytes a side, one
// access of ALIGN bytes or narrower, nvfp4_store) and scale bytes (sk, sv; V's in its swizzle).
// Byte offsets as Off (nvfp4_block_of's: i64, or u32 where every offset fits 32 bits).
#define KVW_NVFP4_STORE_ARGS                                                                     \
    k_data, k_sf, v_data, v_sf, head_groups, kd_sb, kd_ss, kd_sh, ks_sb, ks_ss, ks_sh, vd_sb,    \
    vd_ss, vd_sh, vs_sb, vs_ss, vs_sh, block_size, block_shift, num_slots, v_swizzle
template <typename Off, int NG, int ALIGN>
KVW_HD void nvfp4_store_kv(i64 s, u32 q, const u32 (&ck)[2 * NG], const u32 (&cv)[2 * NG],
                           const u32 (&sk)[NG], const u32 (&sv)[NG], u8* k_data, u8* k_sf,
                           u8* v_data, u8* v_sf, i64 head_groups, i64 kd_sb, i64 kd_ss,
                           i64 kd_sh, i64 ks_sb, i64 ks_ss, i64 ks_sh, i64 vd_sb, i64 vd_ss,
                           i64 vd_sh, i64 vs_sb, i64 vs_ss, i64 vs_sh, i64 block_size,
                           i64 block_shift, i64 num_slots, i64 v_swizzle) {
  Off blk, pg;
  nvfp4_block_of(s, block_size, block_shift, num_slots, &blk, &pg);
  const u32 h = q / static_cast<u32>(head_groups);
  const u32 g = q - h * static_cast<u32>(head_groups);
  const Off hh = h, gg = g;
  nvfp4_store<8 * NG, ALIGN>(k_data + (blk * static_cast<Off>(kd_sb) + pg * static_cast<Off>(kd_ss)
                                       + hh * static_cast<Off>(kd_sh) + gg * 8), ck);
  nvfp4_store<8 * NG, ALIGN>(v_data + (blk * static_cast<Off>(vd_sb) + pg * static_cast<Off>(vd_ss)
                                       + hh * static_cast<Off>(vd_sh) + gg * 8), cv);
#pragma unroll
  for (int j = 0; j < NG; ++j) {
    k_sf[blk * static_cast<Off>(ks_sb) + pg * static_cast<Off>(ks_ss)
         + hh * static_cast<Off>(ks_sh) + gg + j] = static_cast<u8>(sk[j]);
    i64 row, col;
    nvfp4_v_scale_at(pg, g + j, head_groups, v_swizzle, &row, &col);
    v_sf[blk * static_cast<Off>(vs_sb) + static_cast<Off>(row) * static_cast<Off>(vs_ss)
         + hh * static_cast<Off>(vs_sh) + static_cast<Off>(col)] = static_cast<u8>(sv[j]);
  }
}

// nvfp4_kernel<IN, MODE, SlotT, FOUR_OVER_SIX>: every call but the small ones (nvfp4_small_kernel
// below). A flat grid of threads, each taking NG consecutive groups of a token's H * D/16, K and
// V together (MODE 2: NG = 2, in one head; else NG = 1). Consecutive threads take consecutive
// groups, so a warp's data stores are contiguous where a token's heads are adjacent (NHD): 256
// bytes per 8-byte store instruction (MODE 1), 512 per 16-byte one (MODE 2).
// MODE 0: inputs not 16-byte aligned, or data addresses not 8-byte aligned (never in vLLM's or
//   FlashInfer's allocations with block_size 16, nor for slices of a fused qkv): element loads,
//   byte stores, NG = 1.
// MODE 1: 16-byte loads, 8-byte stores of codes, NG = 1 (data 8-byte aligned, or D/16 odd).
// MODE 2: 16-byte loads, one 16-byte store of codes a side, NG = 2 (16-bit inputs, data 16-byte
//   aligned and D % 32 == 0): the per-thread work that does not scale with the groups (index
//   math, the scale constants, the slot, the addresses) paid once for two groups. At most 64
//   registers (__launch_bounds__(256, 4): 4 CTAs of 256 threads an SM, 8 bytes spilled in the
//   bfloat16 build: the second group's maxima) where it would take 80 (3 CTAs); the groups' raw
//   words are held until the rule needs their floats (nvfp4_group_amax).
// Order (one memory round trip; tests/test_nvfp4.py reads the machine code): the slot's load,
// the rows' (their first use, the amax, comes before the slot's test, so ptxas issues them all
// before it waits: tested first, the rows were loaded after the test), the scales', the amax,
// then the slot's test (a skipped slot leaves before the rest of the rule), the rule, the stores.
#ifndef KVW_NVFP4_PAIR_MIN_CTAS
#define KVW_NVFP4_PAIR_MIN_CTAS 4  // cuda_impl.CudaTuning.pair_min_ctas
#endif
template <int IN, int MODE, typename SlotT, bool FOUR_OVER_SIX>
__global__ void __launch_bounds__(256, MODE == 2 ? KVW_NVFP4_PAIR_MIN_CTAS : 0)
nvfp4_kernel(KVW_NVFP4_PARAMS) {
  KVW_PDL_ENTRY();
  KVW_NVFP4_FIXED_PROLOGUE()
  constexpr int IB = elem_bytes(IN);
  constexpr int NG = MODE == 2 ? 2 : 1;
  constexpr int IN_ALIGN = MODE ? 16 : IB;
  constexpr int OUT_ALIGN = MODE == 2 ? 16 : MODE == 1 ? 8 : 1;
  constexpr int STEPS = IN == DT_F32 ? 2 : 1;  // the exact quotient's corrections (kvw/fp8.cuh)
  // 32-bit: the host launches at most 2^32 - 1 threads (cuda_impl.py checks).
  const u32 gid = blockIdx.x * blockDim.x + threadIdx.x;
  const u32 units = static_cast<u32>(groups) / NG;
  const u32 t32 = gid / units;
  if (t32 >= num_tokens) return;
  const u32 q = (gid - t32 * units) * NG;  // the first group
  const i64 t = t32;
  const i64 s = static_cast<i64>(load_index(slot_mapping + t));
  constexpr int W = 4 * IB;  // raw words of a group
  u32 wk[NG][W], wv[NG][W];
  const u8* krow = key + (t * key_stride + static_cast<i64>(q) * 16) * IB;
  const u8* vrow = value + (t * value_stride + static_cast<i64>(q) * 16) * IB;
#pragma unroll
  for (int j = 0; j < NG; ++j) nvfp4_load_raw<IN, 16, IN_ALIGN>(krow + j * 16 * IB, wk[j]);
#pragma unroll
  for (int j = 0; j < NG; ++j) nvfp4_load_raw<IN, 16, IN_ALIGN>(vrow + j * 16 * IB, wv[j]);
  const float k = nvfp4_scale(k_scale, k_scale_bits);
  const float v = nvfp4_scale(v_scale, v_scale_bits);
  const bool skip = static_cast<u64>(s) >= static_cast<u64>(num_slots);  // also s < 0
  // MODE 0's volatile element loads stay above any test; tested after the amax, ptxas issued
  // the slot's and the scales' loads after it had begun assembling the rows' words.
  if (MODE == 0 && skip) return;
  float ak[NG], av[NG];
#pragma unroll
  for (int j = 0; j < NG; ++j) {
    ak[j] = nvfp4_group_amax<IN>(wk[j]);
    av[j] = nvfp4_group_amax<IN>(wv[j]);
  }
  if (skip) return;

  const Nvfp4Den k6 = nvfp4_den(mul_rn(k, 6.0f)), v6 = nvfp4_den(mul_rn(v, 6.0f));
  Nvfp4Den k4 = k6, v4 = v6;
  if constexpr (FOUR_OVER_SIX) {
    k4 = nvfp4_den(mul_rn(k, 4.0f));
    v4 = nvfp4_den(mul_rn(v, 4.0f));
  }
  u32 ck[2 * NG], cv[2 * NG], sk[NG], sv[NG];
#pragma unroll
  for (int j = 0; j < NG; ++j) {
    float xk[16], xv[16];
    nvfp4_widen<IN, 16>(wk[j], xk);
    nvfp4_widen<IN, 16>(wv[j], xv);
    u32 a[2], b[2];
    nvfp4_pair_rule<FOUR_OVER_SIX, STEPS>(xk, xv, ak[j], av[j], k, v, k6, k4, v6, v4, a, b,
                                          &sk[j], &sv[j]);
    ck[2 * j] = a[0];
    ck[2 * j + 1] = a[1];
    cv[2 * j] = b[0];
    cv[2 * j + 1] = b[1];
  }

  nvfp4_store_kv<i64, NG, OUT_ALIGN>(s, q, ck, cv, sk, sv, KVW_NVFP4_STORE_ARGS);
}

// nvfp4_small_kernel<IN, SlotT, E>: small and mid-sized calls (cuda_impl.CudaTuning's
// small_call_groups and mid_call_groups) of the "nvfp4" rule with aligned inputs and data (MODE 1's
// conditions). A group's rule for one side spread over P = 16 / E adjacent lanes of a warp, E
// elements each (E = 16: one lane a group of one side): a thread's chain from its rows' arrival
// to its stores is the scale's (amax, quotient, reciprocal) plus E elements, not 32 or 64
// (nvfp4_kernel's thread issues about 470 instructions in MODE 1 and 900 in MODE 2, which at
// T <= 16 is the call's time past the memory round trip, and at mid sizes leaves an SM few warps,
// each with a long chain: H=8 D=128 T=1024 in MODE 2 is 1024 warps, 8 an SM). Thread order:
// token, side (K, V), group, part; a warp's loads are 32 * E * IB contiguous bytes and its code
// stores 32 * E / 2 contiguous bytes (NHD). Where P > 1 the parts' amax are combined by xor
// shuffles of the whole warp, so every lane of it reaches them: lanes past the last token load
// nothing and leave after them, as do the lanes of a skipped slot (a group's lanes share its
// token and slot). Every part computes the group's scale; part 0 stores it. E = 16 takes the
// amax of 16-bit inputs from the raw words (nvfp4_group_amax) and needs no lane's help. Order as
// nvfp4_kernel's: the slot, the row part, the scale, the scale's constants (they wait only for
// the scale), the amax, then the slot's test.
template <int IN, typename SlotT, int E>
__global__ void __launch_bounds__(256) nvfp4_small_kernel(KVW_NVFP4_PARAMS) {
  KVW_PDL_ENTRY();
  KVW_NVFP4_FIXED_PROLOGUE()
  constexpr int IB = elem_bytes(IN);
  constexpr int P = 16 / E;
  constexpr int STEPS = IN == DT_F32 ? 2 : 1;
  static_assert(E == 4 || E == 8 || E == 16, "4, 8 or 16 elements a thread");
  const auto [part, q, live, is_v, t] =
      group_part<P>(blockIdx.x * blockDim.x + threadIdx.x, groups, num_tokens);
  i64 s = -1;
  u32 w[E * IB / 4];
#pragma unroll
  for (int i = 0; i < E * IB / 4; ++i) w[i] = 0;
  if (live) {
    s = static_cast<i64>(load_index(slot_mapping + t));
    const u8* row = is_v ? value + t * value_stride * IB : key + t * key_stride * IB;
    nvfp4_load_raw<IN, E, 16>(row + (static_cast<i64>(q) * 16 + part * E) * IB, w);
  }
  const float k = nvfp4_scale(is_v ? v_scale : k_scale, is_v ? v_scale_bits : k_scale_bits);
  const Nvfp4Den den = nvfp4_den(mul_rn(k, 6.0f));
  float x[E];
  nvfp4_widen<IN, E>(w, x);
  float a_num = 0.0f;
  float a;
  if constexpr (P == 1) {  // the whole group: no lane's help
    a = nvfp4_group_amax<IN>(w);
    if (a != a) a_num = nvfp4_amax_num(x);  // rare: the rule's amax, NaN skipped
  } else {
    a = nvfp4_amax_nan(x);
#pragma unroll
    for (int o = 1; o < P; o <<= 1) a = max_nan(a, __shfl_xor_sync(0xFFFFFFFFu, a, o));
    if (__any_sync(0xFFFFFFFFu, a != a)) {  // rare: the rule's amax, NaN skipped, where needed
      a_num = nvfp4_amax_num(x);
#pragma unroll
      for (int o = 1; o < P; o <<= 1) {
        a_num = max_num(a_num, __shfl_xor_sync(0xFFFFFFFFu, a_num, o));
      }
    }
  }
  if (static_cast<u64>(s) >= static_cast<u64>(num_slots)) return;  // also s < 0 and !live

  u32 codes[(E + 7) / 8];
  const u32 S = nvfp4_part_rule<E, STEPS>(x, a, a_num, k, den, codes);
  i64 blk, pg;
  nvfp4_block_of(s, block_size, block_shift, num_slots, &blk, &pg);
  const u32 h = q / static_cast<u32>(head_groups);
  const u32 g = q - h * static_cast<u32>(head_groups);
  const i64 hh = h, gg = g;
  u8* data = is_v ? v_data + blk * vd_sb + pg * vd_ss + hh * vd_sh
                  : k_data + blk * kd_sb + pg * kd_ss + hh * kd_sh;
  nvfp4_store<E / 2, E / 2>(data + gg * 8 + part * (E / 2), codes);
  if (part == 0) {
    i64 srow = pg, scol = gg;
    if (is_v) nvfp4_v_scale_at(pg, g, head_groups, v_swizzle, &srow, &scol);
    u8* sf = is_v ? v_sf + blk * vs_sb + srow * vs_ss + hh * vs_sh
                  : k_sf + blk * ks_sb + srow * ks_ss + hh * ks_sh;
    sf[scol] = static_cast<u8>(S);
  }
}

// nvfp4_kv_kernel<IN, SlotT, OFF32, TABLE, NG>: wide calls (cuda_impl.CudaTuning's
// wide_call_groups: about 2^18 groups of K, where nvfp4_small_kernel's one group of one side a
// thread issues ~290 instructions a group and nvfp4_kernel's MODE 2, ~212 a group in one wave of
// 32 warps an SM, waits for all its rows before a long chain) of the "nvfp4" rule with 16-bit
// inputs and MODE 1's alignment: one thread a group of K and of V (thread order: token, group),
// each side's rule in turn from its raw words (nvfp4_small_kernel's E = 16 rule: the amax by the
// 16-bit SIMD maximum, nvfp4_part_rule), so that the token's slot, the rows' addresses and the
// stores' block and offset are paid once for two groups while only the raw words of both are
// held; every group's fast path (nvfp4_group_fast), then one rare branch for them all
// (nvfp4_group_rare, the rows loaded again): 48 registers in the specialized bfloat16 build, 5
// CTAs of 256 threads an SM. sm_90, bfloat16, the benchmark's layout, the fast path: ~447
// instructions a thread (~224 a group of one side; nvfp4_small_kernel's E = 16 ~288, MODE 1
// ~229, MODE 2 ~215). NG = 2: two adjacent groups of each side (MODE 2's conditions, and
// TABLE): ~771 (~193), 64 registers, no spill.
// OFF32: every byte offset into the four views fits 32 bits (cuda_impl.py checks their spans):
//   the stores' offsets are 32-bit products added to each view's pointer.
// TABLE: the scale's constants (nvfp4_den of RN(6k), RN(6v)) and the reciprocal of every scale
//   code (nvfp4_scale_rcp, S = 0..0x7E, per side) are computed once per CTA into shared memory,
//   the CTA's threads one entry each, and looked up (a thread's 2 x 12 instructions of constants
//   and 2 x 15 of reciprocal become 4 shared loads and its share of the table). Every thread
//   reaches the barrier: those past the last token leave after it.
// Order: the scales (TABLE), the slot, the rows, the scales (else; all issued before any wait),
// the table, the amax, then the slot's test.
#ifndef KVW_NVFP4_KV_MIN_CTAS
#define KVW_NVFP4_KV_MIN_CTAS 0  // cuda_impl.CudaTuning.kv_min_ctas
#endif

// One side's group of nvfp4_kv_kernel from its raw words and amax (nvfp4_group_amax), by
// nvfp4_group_fast (RARE = false: the codes in two words, S in *S, and whether the group needs
// the rare path) or nvfp4_group_rare (RARE = true).
template <bool RARE, int IN, typename RcpOf>
KVW_HD bool nvfp4_kv_side(const u32 (&w)[4 * elem_bytes(IN)], float a, const Nvfp4Den& den,
                          RcpOf rcp_of, u32 (&codes)[2], u32* S) {
  float x[16];
  nvfp4_widen<IN, 16>(w, x);
  if constexpr (RARE) {
    *S = nvfp4_group_rare<1>(x, a, den, rcp_of, codes);
    return false;
  } else {
    return nvfp4_group_fast<1>(x, a, den, rcp_of, codes, S);
  }
}

template <int IN, typename SlotT, bool OFF32, bool TABLE, int NG>
__global__ void __launch_bounds__(256, KVW_NVFP4_KV_MIN_CTAS) nvfp4_kv_kernel(KVW_NVFP4_PARAMS) {
  KVW_PDL_ENTRY();
  KVW_NVFP4_FIXED_PROLOGUE()
  static_assert(IN != DT_F32, "16-bit inputs");
  static_assert(NG == 1 || NG == 2, "one or two groups of each side");
  using Off = typename IndexType<OFF32>::type;
  constexpr int IB = elem_bytes(IN);
  // 32-bit: the host launches at most 2^32 - 1 threads, so num_tokens < 2^32 here.
  const u32 gid = blockIdx.x * blockDim.x + threadIdx.x;
  const u32 units = static_cast<u32>(groups) / NG;
  const u32 t32 = gid / units;
  const bool live = t32 < static_cast<u32>(num_tokens);
  if (!TABLE && !live) return;
  const u32 q = (gid - t32 * units) * NG;  // the first group
  const i64 t = t32;
  // TABLE: the scales first (loaded after the live lanes' slot, they waited for its sign
  // extension); else after the rows (loaded first, the scale constants' steps waited for them
  // before the rows' loads).
  float k = 0.0f, v = 0.0f;
  if constexpr (TABLE) {
    k = nvfp4_scale(k_scale, k_scale_bits);
    v = nvfp4_scale(v_scale, v_scale_bits);
  }
  i64 s = -1;
  u32 wk[NG][4 * IB], wv[NG][4 * IB];
  if (live) {
    s = static_cast<i64>(load_index(slot_mapping + t));
    const u8* krow = key + (t * key_stride + static_cast<i64>(q) * 16) * IB;
    const u8* vrow = value + (t * value_stride + static_cast<i64>(q) * 16) * IB;
#pragma unroll
    for (int j = 0; j < NG; ++j) nvfp4_load_raw<IN, 16, 16>(krow + j * 16 * IB, wk[j]);
#pragma unroll
    for (int j = 0; j < NG; ++j) nvfp4_load_raw<IN, 16, 16>(vrow + j * 16 * IB, wv[j]);
  }
  if constexpr (!TABLE) {
    k = nvfp4_scale(k_scale, k_scale_bits);
    v = nvfp4_scale(v_scale, v_scale_bits);
  }
  // [side][S]; S = 0x7F, the code of a NaN amax's quotient (nvfp4_group_fast), holds 0: the
  // rare path recomputes such a group.
  __shared__ float rcp_tab[2][128];
  __shared__ float4 den_tab[2];      // [side]: (m, s2, y)
  if constexpr (TABLE) {  // CTAs of 256 threads (cuda_impl.py): one entry each
    const u32 j = threadIdx.x;
    const float ks = j >= 128 ? v : k;
    if ((j & 127) == 127) {
      const Nvfp4Den d = nvfp4_den(mul_rn(ks, 6.0f));
      den_tab[j >> 7] = make_float4(d.m, d.s2, d.y, 0.0f);
      rcp_tab[j >> 7][127] = 0.0f;
    } else {
      rcp_tab[j >> 7][j & 127] = nvfp4_scale_rcp(j & 127, ks);
    }
    __syncthreads();
    if (!live) return;
  }
  float ak[NG], av[NG];
#pragma unroll
  for (int j = 0; j < NG; ++j) {
    ak[j] = nvfp4_group_amax<IN>(wk[j]);
    av[j] = nvfp4_group_amax<IN>(wv[j]);
  }
  // !TABLE: RN(6k) and RN(6v) before the slot's test (after it, ptxas sank a scale's load
  // below the slot's wait).
  const float k6 = mul_rn(k, 6.0f), v6 = mul_rn(v, 6.0f);
  if (static_cast<u64>(s) >= static_cast<u64>(num_slots)) return;  // also s < 0

  u32 ck[2 * NG], cv[2 * NG], sk[NG], sv[NG];
  Nvfp4Den dk, dv;
  if constexpr (TABLE) {
    const float4 tk = den_tab[0], tv = den_tab[1];
    dk = Nvfp4Den{tk.x, tk.y, tk.z};
    dv = Nvfp4Den{tv.x, tv.y, tv.z};
  } else {
    dk = nvfp4_den(k6);
    dv = nvfp4_den(v6);
  }
  const auto rcp_k = [=](u32 S) {
    if constexpr (TABLE) return rcp_tab[0][S & 127];
    else return nvfp4_scale_rcp(S, k);
  };
  const auto rcp_v = [=](u32 S) {
    if constexpr (TABLE) return rcp_tab[1][S & 127];
    else return nvfp4_scale_rcp(S, v);
  };
  // Every group's fast path, then one rare branch for them all that loads the rows again and
  // takes every group by the general path (the same bytes where a group's fast path held): the
  // fast paths are one straight run of code, and the specialized builds keep 48 registers (5
  // CTAs an SM; 64 where the words are held for the rare path). Measured (tuning-log 126)
  // against a rare branch a side: 1-4% faster at 2^17 and 2^18 groups; a branch a pair of groups
  // holding the words (64 registers) was 8% faster at 2^17 but 6% slower at 2^18 (two waves).
  bool rare = false;
#pragma unroll
  for (int j = 0; j < NG; ++j) {
    u32 a[2], b[2];
    rare |= nvfp4_kv_side<false, IN>(wk[j], ak[j], dk, rcp_k, a, &sk[j]);
    rare |= nvfp4_kv_side<false, IN>(wv[j], av[j], dv, rcp_v, b, &sv[j]);
    ck[2 * j] = a[0];
    ck[2 * j + 1] = a[1];
    cv[2 * j] = b[0];
    cv[2 * j + 1] = b[1];
  }
  if (rare) {  // the rows loaded again, so that the fast paths need not hold their words
    const u8* krow = key + (t * key_stride + static_cast<i64>(q) * 16) * IB;
    const u8* vrow = value + (t * value_stride + static_cast<i64>(q) * 16) * IB;
#pragma unroll
    for (int j = 0; j < NG; ++j) {
      u32 a[2], b[2];
      nvfp4_load_raw<IN, 16, 16>(krow + j * 16 * IB, wk[j]);
      nvfp4_load_raw<IN, 16, 16>(vrow + j * 16 * IB, wv[j]);
      nvfp4_kv_side<true, IN>(wk[j], ak[j], dk, rcp_k, a, &sk[j]);
      nvfp4_kv_side<true, IN>(wv[j], av[j], dv, rcp_v, b, &sv[j]);
      ck[2 * j] = a[0];
      ck[2 * j + 1] = a[1];
      cv[2 * j] = b[0];
      cv[2 * j + 1] = b[1];
    }
  }
  // NG = 2: the groups are adjacent in one head (head_groups even) and the data 16-byte aligned
  // (cuda_impl.py): one 16-byte store of codes a side.
  nvfp4_store_kv<Off, NG, 8 * NG>(s, q, ck, cv, sk, sv, KVW_NVFP4_STORE_ARGS);
}
#endif  // KVWRITE_HOST_TEST
