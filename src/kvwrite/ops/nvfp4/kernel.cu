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
// nvfp4_kernel<IN, ALIGNED, SlotT, FOUR_OVER_SIX>: a flat grid of threads, one per (token, group
// of the token's H * D/16): a thread loads its group of K and of V (32 bytes each of 16-bit
// input: two 16-byte loads), then the slot, runs the rule for both and stores 8 bytes of codes
// (one 8-byte store) and one scale byte for each. ALIGNED = false (an input group not 16-byte
// aligned, or a data address not 8-byte aligned: never in vLLM's or FlashInfer's allocations with
// block_size 16, nor for slices of a fused qkv) loads element by element and stores byte by byte. Consecutive threads
// take consecutive groups, so a warp's data stores are 256 contiguous bytes where a token's heads
// are adjacent (NHD) and whole heads' D/2 bytes otherwise (HND). v_swizzle: V's scale byte of
// group g at offset t goes to row 4*(t/4) + g/(G/4), byte 4*(g % (G/4)) + t % 4 (G = D/16).
// Slots < 0 (padding) or >= num_slots are skipped; rows past num_tokens are never read.
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
#ifdef KVWRITE_FIXED_ARGS
#define KVW_NVFP4_FIXED_PROLOGUE()                                                              \
  {                                                                                             \
    KVW_FIXED_ARGS_ARRAY(20);                                                                   \
    key_stride = fixed[0]; value_stride = fixed[1]; groups = fixed[2]; head_groups = fixed[3];  \
    kd_sb = fixed[4]; kd_ss = fixed[5]; kd_sh = fixed[6];                                       \
    ks_sb = fixed[7]; ks_ss = fixed[8]; ks_sh = fixed[9];                                       \
    vd_sb = fixed[10]; vd_ss = fixed[11]; vd_sh = fixed[12];                                    \
    vs_sb = fixed[13]; vs_ss = fixed[14]; vs_sh = fixed[15];                                    \
    block_size = fixed[16]; block_shift = fixed[17]; num_slots = fixed[18];                     \
    v_swizzle = fixed[19];                                                                      \
  }
#else
#define KVW_NVFP4_FIXED_PROLOGUE()
#endif

// N bytes at an A-byte aligned address, as the widest accesses A allows (A a power of two), with
// ld.volatile: the compiler may not sink a row's load below the work on the row before it (it
// did: V's loads waited for K's rule, the slot's for V's; one memory round trip became three).
template <int N, int A>
KVW_HD Raw<N> nvfp4_load(const u8* p) {
  if constexpr (A >= 16 || A >= N) {
    return load_raw_volatile<N>(p);
  } else {
    Raw<N> r;
#pragma unroll
    for (int i = 0; i < N / 4; ++i) r.w[i] = 0;
#pragma unroll
    for (int i = 0; i < N / A; ++i) {
      const Raw<A> piece = load_raw_volatile<A>(p + i * A);
      if constexpr (A >= 4) {
#pragma unroll
        for (int k = 0; k < A / 4; ++k) r.w[i * A / 4 + k] = piece.w[k];
      } else {
        r.w[(i * A) / 4] |= piece.w[0] << (8 * ((i * A) & 3));
      }
    }
    return r;
  }
}

// A scale: *p where p is not null (read on the device: a graph replay sees a new value), else
// the float32 whose bits are `bits` (a Python number's, FlashInfer's form). An asm volatile load
// (load_index), so it stays with the rows' loads.
KVW_HD float nvfp4_scale(const float* p, i64 bits) {
  return p != nullptr ? bits_f32(load_index(reinterpret_cast<const u32*>(p)))
                      : bits_f32(static_cast<u32>(bits));
}

template <int A>
KVW_HD void nvfp4_store8(u8* p, const u32 (&w)[2]) {
  if constexpr (A >= 8) {
    Raw<8> r;
    r.w[0] = w[0];
    r.w[1] = w[1];
    store_raw<8>(p, r);
  } else {
#pragma unroll
    for (int i = 0; i < 8 / A; ++i) {
      Raw<A> piece;
      if constexpr (A == 4) {
        piece.w[0] = w[i];
      } else {
        piece.w[0] = (w[(i * A) / 4] >> (8 * ((i * A) & 3))) & ((1u << (8 * A)) - 1u);
      }
      store_raw<A>(p + i * A, piece);
    }
  }
}

// A group of 16 input elements (16 * IB bytes) at an IN_ALIGN-aligned address, as float32.
template <int IN, int IN_ALIGN>
KVW_HD void nvfp4_load_group(const u8* p, float (&x)[16]) {
  constexpr int IB = elem_bytes(IN);
  if constexpr (IB == 4) {  // two 32-byte halves
    const Raw<32> a = nvfp4_load<32, IN_ALIGN>(p);
    const Raw<32> b = nvfp4_load<32, IN_ALIGN>(p + 32);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      x[i] = bits_f32(a.w[i]);
      x[8 + i] = bits_f32(b.w[i]);
    }
  } else {
    const Raw<32> a = nvfp4_load<32, IN_ALIGN>(p);
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = elem_f32<IN>(a, i);
  }
}

template <int IN, bool ALIGNED, typename SlotT, bool FOUR_OVER_SIX>
__global__ void __launch_bounds__(256) nvfp4_kernel(KVW_NVFP4_PARAMS) {
  KVW_PDL_ENTRY();
  KVW_NVFP4_FIXED_PROLOGUE()
  constexpr int IB = elem_bytes(IN);
  constexpr int IN_ALIGN = ALIGNED ? 16 : IB;
  constexpr int OUT_ALIGN = ALIGNED ? 8 : 1;
  constexpr int STEPS = IN == DT_F32 ? 2 : 1;  // the exact quotient's corrections (kvw/fp8.cuh)
  // 32-bit: the host launches at most 2^32 - 1 threads (cuda_impl.py checks).
  const u32 gid = blockIdx.x * blockDim.x + threadIdx.x;
  const u32 t32 = gid / static_cast<u32>(groups);
  if (t32 >= num_tokens) return;
  const u32 q = gid - t32 * static_cast<u32>(groups);
  const i64 t = t32;
  // The rows first (ld.volatile: in flight before anything waits), then the scales and the slot
  // (load_index). A skipped slot leaves before the rule; a kept one waits for its slot and its
  // rows together: one memory round trip. Tested after the rule, the slot's load was issued after
  // it (the stores were its only use), a second round trip.
  float xk[16], xv[16];
  nvfp4_load_group<IN, IN_ALIGN>(key + (t * key_stride + static_cast<i64>(q) * 16) * IB, xk);
  nvfp4_load_group<IN, IN_ALIGN>(value + (t * value_stride + static_cast<i64>(q) * 16) * IB, xv);
  const float k = nvfp4_scale(k_scale, k_scale_bits);
  const float v = nvfp4_scale(v_scale, v_scale_bits);
  const i64 s = static_cast<i64>(load_index(slot_mapping + t));
  if (static_cast<u64>(s) >= static_cast<u64>(num_slots)) return;  // also s < 0

  const u32 h = q / static_cast<u32>(head_groups);
  const u32 g = q - h * static_cast<u32>(head_groups);
  const Fp8Scale k6 = make_fp8_scale(mul_rn(k, 6.0f)), v6 = make_fp8_scale(mul_rn(v, 6.0f));
  Fp8Scale k4 = k6, v4 = v6;
  if constexpr (FOUR_OVER_SIX) {
    k4 = make_fp8_scale(mul_rn(k, 4.0f));
    v4 = make_fp8_scale(mul_rn(v, 4.0f));
  }
  u32 ck[2], cv[2], sk, sv;
  nvfp4_group_pair<FOUR_OVER_SIX, STEPS>(xk, xv, k, v, k6, k4, v6, v4, ck, cv, &sk, &sv);

  i64 blk, pg;
  if (block_shift >= 0) {
    blk = s >> block_shift;
    pg = s & (block_size - 1);
  } else if ((static_cast<u64>(num_slots) >> 32) == 0) {
    const u32 b32 = static_cast<u32>(s) / static_cast<u32>(block_size);
    blk = b32;
    pg = s - static_cast<i64>(b32) * block_size;
  } else {
    blk = s / block_size;
    pg = s - blk * block_size;
  }
  const i64 hh = h, gg = g;
  nvfp4_store8<OUT_ALIGN>(k_data + blk * kd_sb + pg * kd_ss + hh * kd_sh + gg * 8, ck);
  nvfp4_store8<OUT_ALIGN>(v_data + blk * vd_sb + pg * vd_ss + hh * vd_sh + gg * 8, cv);
  k_sf[blk * ks_sb + pg * ks_ss + hh * ks_sh + gg] = static_cast<u8>(sk);
  i64 vt = pg, vg = gg;
  if (v_swizzle) {
    const u32 quarter = static_cast<u32>(head_groups) >> 2;  // D/64
    const u32 row = g / quarter;
    vt = (pg & ~3ll) + row;
    vg = 4 * static_cast<i64>(g - row * quarter) + (pg & 3);
  }
  v_sf[blk * vs_sb + vt * vs_ss + hh * vs_sh + vg] = static_cast<u8>(sv);
}
#endif  // KVWRITE_HOST_TEST
