// kvwrite: MXFP8 / MXFP4 cache writes (SPEC §10.3, docs/ops/mx.md): each group of 32 elements of
// a key or value head becomes 32 E4M3 code bytes (mxfp8) or 16 bytes of E2M1 codes (mxfp4) and
// one E8M0 scale byte (kvw/mx.cuh's group rule), stored through four byte views: K data, V data
// ([num_blocks, block_size, H, F] by four strides each, the last one the byte's), K scales, V
// scales (by six strides each, below).
//
// Compiled at run time with NVRTC (see cuda_impl.py): one module per instantiation and, by
// default, per call signature, with the arguments fixed by the views and the inputs' layout
// compiled in (KVWRITE_FIXED_ARGS).
//
// Scale byte of group g, token offset o, head h, block b: b*sb + h*sh + (o/128)*s128 +
// (o%32)*s32 + ((o%128)/32)*s4 + g*sg. The "interleaved128" layout [num_blocks, H,
// block_size/128, 32, 4, 4] gives its strides as they are; "linear" ([num_blocks, block_size,
// H, D/32], slot stride ss) gives (sb, sh, 128*ss, ss, 32*ss, sg), the same address since
// o = 128*(o/128) + 32*((o%128)/32) + o%32: one code path for both.
#include "kvw/common.cuh"
#include "kvw/fp8.cuh"
#include "kvw/mx.cuh"
#include "kvw/vec_io.cuh"

#ifndef KVWRITE_HOST_TEST

#define KVW_MX_PARAMS                                                                             \
    const u8* __restrict__ key,           /* [T_pad, H, D]; token stride key_stride (elements) */  \
    const u8* __restrict__ value,         /* [T_pad, H, D]; token stride value_stride */           \
    u8* __restrict__ k_data,              /* [num_blocks, block_size, H, F] via strides */         \
    u8* __restrict__ v_data,                                                                      \
    u8* __restrict__ k_sf,                /* scale bytes via six strides (above) */               \
    u8* __restrict__ v_sf,                                                                        \
    const SlotT* __restrict__ slot_mapping,  /* [num_tokens] */                                   \
    i64 num_tokens,                                                                               \
    i64 key_stride, i64 value_stride,     /* token strides in input elements */                   \
    i64 groups, i64 head_groups,          /* H * D/32, D/32 */                                    \
    i64 kd_sb, i64 kd_ss, i64 kd_sh, i64 kd_se,  /* K data strides (block, slot, head, byte) */   \
    i64 vd_sb, i64 vd_ss, i64 vd_sh, i64 vd_se,                                                   \
    i64 ks_sb, i64 ks_sh, i64 ks_128, i64 ks_32, i64 ks_4, i64 ks_g,  /* K scale strides */       \
    i64 vs_sb, i64 vs_sh, i64 vs_128, i64 vs_32, i64 vs_4, i64 vs_g,                              \
    i64 block_size, i64 block_shift,      /* block_shift = log2(block_size), or -1 */             \
    i64 num_slots,                        /* num_blocks * block_size */                           \
    i64 floor_rule                        /* 1: "floor", 0: "ceil" */

// In a build specialized for one call signature (-D KVWRITE_FIXED_ARGS=v0,...,v27) the arguments
// from key_stride on are compile-time constants: none is read from the parameter bank.
#define KVW_MX_FIXED_PROLOGUE() KVW_ASSIGN_FIXED_ARGS(key_stride, value_stride, groups,         \
    head_groups, kd_sb, kd_ss, kd_sh, kd_se, vd_sb, vd_ss, vd_sh, vd_se, ks_sb, ks_sh, ks_128,  \
    ks_32, ks_4, ks_g, vs_sb, vs_sh, vs_128, vs_32, vs_4, vs_g, block_size, block_shift,        \
    num_slots, floor_rule)

// The 32 elements of a group at p (IN_ALIGN-byte aligned) as float32 (exact): 16-byte chunks,
// each as the widest loads IN_ALIGN allows.
template <int IN, int IN_ALIGN>
KVW_HD void mx_load_group(const u8* p, float (&x)[KVW_MX_GROUP]) {
  constexpr int PER = 16 / elem_bytes(IN);  // elements a chunk
#pragma unroll
  for (int c = 0; c < KVW_MX_GROUP / PER; ++c) {
    const Raw<16> r = load_aligned<16, IN_ALIGN>(p + c * 16);
#pragma unroll
    for (int i = 0; i < PER; ++i) x[c * PER + i] = elem_f32<IN, 16>(r, i);
  }
}

// N code bytes (words w, little endian) at p: 16-byte stores (ALIGNED: p 16-byte aligned, unit
// byte stride), else one byte at a time, byte j at p + j * se.
template <int N, bool ALIGNED>
KVW_HD void mx_store_codes(u8* p, i64 se, const u32 (&w)[N / 4]) {
  if constexpr (ALIGNED) {
#pragma unroll
    for (int c = 0; c < N / 16; ++c) {
      Raw<16> r;
#pragma unroll
      for (int k = 0; k < 4; ++k) r.w[k] = w[4 * c + k];
      store_raw<16>(p + 16 * c, r);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) p[j * se] = static_cast<u8>(w[j >> 2] >> (8 * (j & 3)));
  }
}

// (block, offset in block) of slot s (0 <= s < num_slots).
KVW_HD void mx_block_of(i64 s, i64 block_size, i64 block_shift, i64 num_slots, i64* blk,
                        i64* pg) {
  if (block_shift >= 0) {
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

// mx_kernel<IN, FP4, ALIGNED, SlotT>: a flat grid of threads, one per group of 32 elements of a
// token's H * D/32, K and V together; consecutive threads take consecutive groups, so a warp's
// data stores are contiguous where a token's heads are adjacent (NHD).
// ALIGNED: inputs 16-byte aligned (rows and token strides), data 16-byte aligned with a unit
//   byte stride: 16-byte loads and stores. Else element loads and byte stores.
// Order (one memory round trip; tests/test_mx_kernels.py reads the machine code): the rows'
// loads, the slot's (kernel notes: the index after the rows), the whole rule, then the slot's
// test (a skipped slot, rare padding, computes codes it does not store), the stores. With the
// slot loaded first and tested after the amax (E and the codes after the test), ptxas sank the
// row loads and the amax below the test: every variant waited for the slot before loading.
template <int IN, bool FP4, bool ALIGNED, typename SlotT>
__global__ void __launch_bounds__(256) mx_kernel(KVW_MX_PARAMS) {
  KVW_PDL_ENTRY();
  KVW_MX_FIXED_PROLOGUE()
  constexpr int IB = elem_bytes(IN);
  constexpr int IN_ALIGN = ALIGNED ? 16 : IB;
  constexpr int NB = FP4 ? 16 : 32;  // code bytes a group
  // 32-bit: the host launches at most 2^32 - 1 threads (cuda_impl.py checks).
  const u32 gid = blockIdx.x * blockDim.x + threadIdx.x;
  const u32 t32 = gid / static_cast<u32>(groups);
  if (t32 >= num_tokens) return;
  const u32 q = gid - t32 * static_cast<u32>(groups);
  const i64 t = t32;
  float xk[KVW_MX_GROUP], xv[KVW_MX_GROUP];
  mx_load_group<IN, IN_ALIGN>(key + (t * key_stride + static_cast<i64>(q) * KVW_MX_GROUP) * IB,
                              xk);
  mx_load_group<IN, IN_ALIGN>(
      value + (t * value_stride + static_cast<i64>(q) * KVW_MX_GROUP) * IB, xv);
  const i64 s = static_cast<i64>(load_index(slot_mapping + t));
  const bool fl = floor_rule != 0;
  const int ek = mx_scale_exp<FP4>(mx_amax(xk), fl), ev = mx_scale_exp<FP4>(mx_amax(xv), fl);
  u32 ck[NB / 4], cv[NB / 4];
  mx_codes<FP4>(xk, mx_rcp(ek), ck);
  mx_codes<FP4>(xv, mx_rcp(ev), cv);
  if (static_cast<u64>(s) >= static_cast<u64>(num_slots)) return;  // also s < 0

  i64 blk, pg;
  mx_block_of(s, block_size, block_shift, num_slots, &blk, &pg);
  const u32 h = q / static_cast<u32>(head_groups);
  const u32 g = q - h * static_cast<u32>(head_groups);
  const i64 hh = h, gg = g;
  mx_store_codes<NB, ALIGNED>(k_data + blk * kd_sb + pg * kd_ss + hh * kd_sh + gg * NB * kd_se,
                              kd_se, ck);
  mx_store_codes<NB, ALIGNED>(v_data + blk * vd_sb + pg * vd_ss + hh * vd_sh + gg * NB * vd_se,
                              vd_se, cv);
  const i64 o128 = pg >> 7, o32 = pg & 31, o4 = (pg >> 5) & 3;
  k_sf[blk * ks_sb + hh * ks_sh + o128 * ks_128 + o32 * ks_32 + o4 * ks_4 + gg * ks_g] =
      static_cast<u8>(ek + 127);
  v_sf[blk * vs_sb + hh * vs_sh + o128 * vs_128 + o32 * vs_32 + o4 * vs_4 + gg * vs_g] =
      static_cast<u8>(ev + 127);
}
#endif  // KVWRITE_HOST_TEST
