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

// KVWRITE_EMU: tests/test_mx_kernels.py runs the kernels on the CPU over tests/gather_emu.h.
#if !defined(KVWRITE_HOST_TEST) || defined(KVWRITE_EMU)

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

// The 32 elements of a group at p (IN_ALIGN-byte aligned) as 16-byte chunks, each loaded as the
// widest loads IN_ALIGN allows; mx_widen makes their float32 values (exact).
template <int IN, int IN_ALIGN>
KVW_HD void mx_load_group(const u8* p, Raw<16> (&r)[2 * elem_bytes(IN)]) {
#pragma unroll
  for (int c = 0; c < 2 * elem_bytes(IN); ++c) r[c] = load_aligned<16, IN_ALIGN>(p + c * 16);
}

template <int IN, int C>
KVW_HD void mx_widen(const Raw<16> (&r)[C], float (&x)[C * 16 / elem_bytes(IN)]) {
  constexpr int PER = 16 / elem_bytes(IN);  // elements a chunk
#pragma unroll
  for (int c = 0; c < C; ++c) {
#pragma unroll
    for (int i = 0; i < PER; ++i) x[c * PER + i] = elem_f32<IN, 16>(r[c], i);
  }
}

// The NaN-propagating amax (nvfp4_amax_nan) of a group's chunks: 16-bit inputs loaded whole
// (WORDS) by the 16-bit SIMD maximum on their words (kvw/nvfp4.cuh's nvfp4_amax_nan16, two halves
// of 16: 8 VIMNMX.U16x2 and 16 LOP3 for 32 elements where the float tree takes 31 FMNMX), else
// from the floats (element loads: with the words' assembly ahead of the amax, ptxas issued the
// int32 slot's load after it had begun waiting for the rows' pieces).
template <int IN, bool WORDS>
KVW_HD float mx_amax_nan(const Raw<16> (&r)[2 * elem_bytes(IN)], const float (&x)[KVW_MX_GROUP]) {
  if constexpr (IN == DT_F32 || !WORDS) {
    return nvfp4_amax_nan(x);
  } else {
    u32 lo[8], hi[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      lo[i] = r[i >> 2].w[i & 3];
      hi[i] = r[2 + (i >> 2)].w[i & 3];
    }
    return max_nan(nvfp4_amax_nan16<IN == DT_BF16>(lo), nvfp4_amax_nan16<IN == DT_BF16>(hi));
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
// Order (one memory round trip; tests/test_mx_kernels.py reads the machine code): the slot's
// load, the rows', the whole rule, then the slot's test (a skipped slot, rare padding, computes
// codes it does not store), the stores. With the slot loaded after the rows, ptxas issued the
// int32 slot's load after it had begun the 16-bit amax on the rows' words; with the slot tested
// right after its load, it sank the row loads below the test.
// The rule: the NaN-propagating amax (mx_amax_nan), the rule's amax from it (the NaN-skipping
// tree only for a group with a NaN: a cold branch), E, and mxfp4's fast E2M1 path where mx_fast
// allows (every finite group under "ceil"; never under "floor"). sm_90, bfloat16, aligned, the benchmark's fixed
// arguments: 64 registers (92-96 before: 4 CTAs of 256 an SM, not 2), about 360 (mxfp8) and 720
// (mxfp4) instructions on the common path, 472 and 960 before.
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
  constexpr int C = 2 * IB;  // 16-byte chunks a group
  const i64 s = static_cast<i64>(load_index(slot_mapping + t));
  Raw<16> rk[C], rv[C];
  mx_load_group<IN, IN_ALIGN>(key + (t * key_stride + static_cast<i64>(q) * KVW_MX_GROUP) * IB,
                              rk);
  mx_load_group<IN, IN_ALIGN>(
      value + (t * value_stride + static_cast<i64>(q) * KVW_MX_GROUP) * IB, rv);
  float xk[KVW_MX_GROUP], xv[KVW_MX_GROUP];
  mx_widen<IN>(rk, xk);
  mx_widen<IN>(rv, xv);
  const bool fl = floor_rule != 0;
  const float nk = mx_amax_nan<IN, ALIGNED>(rk, xk), nv = mx_amax_nan<IN, ALIGNED>(rv, xv);
  const int ek = mx_scale_exp<FP4>(mx_amax_from(nk, xk), fl);
  const int ev = mx_scale_exp<FP4>(mx_amax_from(nv, xv), fl);
  const float rck = mx_rcp(ek), rcv = mx_rcp(ev);
  u32 ck[NB / 4], cv[NB / 4];
  mx_codes_n<FP4, KVW_MX_GROUP>(xk, rck, FP4 && mx_fast(nk, rck, fl), ck);
  mx_codes_n<FP4, KVW_MX_GROUP>(xv, rcv, FP4 && mx_fast(nv, rcv, fl), cv);
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

// mx_small_kernel<IN, FP4, SlotT>: small calls (cuda_impl.CudaTuning.small_call_groups) with
// mx_kernel's ALIGNED conditions. A group's rule for one side spread over P = 4 adjacent lanes of
// a warp, E = 8 elements each: a thread's chain from its row's arrival to its stores is the
// amax (3 steps and 2 shuffles), E and 8 elements, not 2 * 32 (mx_kernel's thread issues about
// 500 (mxfp8) to 600 (mxfp4) instructions, which at T <= 16 is the call's time past the memory
// round trip: one thread a group, 1 to 16 warps in all). Thread order: token, side (K, V), group,
// part; a warp's loads are 32 * 8 * IB contiguous bytes and its code stores 32 * 8 (mxfp8) or
// 32 * 4 (mxfp4) contiguous bytes (NHD). The parts' amax are combined by xor shuffles of the
// whole warp, so every lane of it reaches them: lanes past the last token load nothing and
// leave after them, as do the lanes of a skipped slot (a group's lanes share its token and
// slot). Every part computes the group's E; part 0 stores the scale byte. Order as mx_kernel's:
// the slot and row part loads, the whole rule, then the slot's test and the stores.
template <int IN, bool FP4, typename SlotT>
__global__ void __launch_bounds__(256) mx_small_kernel(KVW_MX_PARAMS) {
  KVW_PDL_ENTRY();
  KVW_MX_FIXED_PROLOGUE()
  constexpr int IB = elem_bytes(IN);
  constexpr int E = 8, P = KVW_MX_GROUP / E;
  constexpr int C = E * IB / 16;            // 16-byte chunks a part: 1 (16-bit) or 2 (float32)
  constexpr int CB = FP4 ? E / 2 : E;       // code bytes a part
  const auto [part, q, live, is_v, t] =
      group_part<P>(blockIdx.x * blockDim.x + threadIdx.x, groups, num_tokens);
  i64 s = -1;
  Raw<16> r[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
#pragma unroll
    for (int k = 0; k < 4; ++k) r[c].w[k] = 0;
  }
  if (live) {
    const u8* row = is_v ? value + t * value_stride * IB : key + t * key_stride * IB;
    const u8* p = row + (static_cast<i64>(q) * KVW_MX_GROUP + part * E) * IB;
#pragma unroll
    for (int c = 0; c < C; ++c) r[c] = load_raw<16>(p + 16 * c);
    s = static_cast<i64>(load_index(slot_mapping + t));
  }
  float x[E];
  mx_widen<IN>(r, x);
  float an = nvfp4_amax_nan(x);
#pragma unroll
  for (int o = 1; o < P; o <<= 1) an = max_nan(an, __shfl_xor_sync(0xFFFFFFFFu, an, o));
  float a = an;
  if (__ballot_sync(0xFFFFFFFFu, an != an) != 0) {  // rare: the rule's amax, NaN skipped
    float b = mx_amax(x);
#pragma unroll
    for (int o = 1; o < P; o <<= 1) b = max_num(b, __shfl_xor_sync(0xFFFFFFFFu, b, o));
    if (an != an) a = b;
  }
  const int ex = mx_scale_exp<FP4>(a, floor_rule != 0);
  const float rc = mx_rcp(ex);
  u32 codes[CB / 4];
  mx_codes_n<FP4, E>(x, rc, FP4 && mx_fast(an, rc, floor_rule != 0), codes);
  if (static_cast<u64>(s) >= static_cast<u64>(num_slots)) return;  // also s < 0 and !live

  i64 blk, pg;
  mx_block_of(s, block_size, block_shift, num_slots, &blk, &pg);
  const u32 h = q / static_cast<u32>(head_groups);
  const u32 g = q - h * static_cast<u32>(head_groups);
  const i64 hh = h, gg = g;
  u8* data = is_v ? v_data + blk * vd_sb + pg * vd_ss + hh * vd_sh
                  : k_data + blk * kd_sb + pg * kd_ss + hh * kd_sh;
  Raw<CB> out;
#pragma unroll
  for (int k = 0; k < CB / 4; ++k) out.w[k] = codes[k];
  store_raw<CB>(data + gg * (CB * P) + part * CB, out);
  if (part == 0) {
    const i64 o128 = pg >> 7, o32 = pg & 31, o4 = (pg >> 5) & 3;
    u8* sf = is_v ? v_sf + blk * vs_sb + hh * vs_sh + o128 * vs_128 + o32 * vs_32 + o4 * vs_4 +
                        gg * vs_g
                  : k_sf + blk * ks_sb + hh * ks_sh + o128 * ks_128 + o32 * ks_32 + o4 * ks_4 +
                        gg * ks_g;
    *sf = static_cast<u8>(ex + 127);
  }
}
#endif  // !KVWRITE_HOST_TEST || KVWRITE_EMU
