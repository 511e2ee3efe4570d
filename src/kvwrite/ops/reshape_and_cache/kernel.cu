// kvwrite: reshape_and_cache (docs/ops/reshape_and_cache.md): write new key/value rows into the
// legacy paged-attention layout, key_cache [num_blocks, H, D/x, block_size, x] and value_cache
// [num_blocks, H, D, block_size], any strides.
//
// Compiled at run time with NVRTC (see cuda_impl.py): one module per instantiation of
// reshape_and_cache_kernel<IN, OUT, VEC, KP, PAIR, SlotT> and, by default, per call signature,
// with the arguments fixed by the caches and the inputs' layout compiled in (KVWRITE_FIXED_ARGS).
// The shared parts (element kinds, the fp8 rule, vector I/O, slot addressing) come from kvwrite's
// kernel headers; nothing else is included.
//
// Work split: a thread writes one chunk of VEC elements of one head of one token, K and V. A CTA
// is [blockDim.x tokens, blockDim.y chunks], tokens fastest: the lanes of a warp are consecutive
// tokens at one (head, chunk). The value cache is d-major and slot-minor, so a token's V
// elements lie block_size elements apart; consecutive tokens with consecutive slots (a prefill)
// write one element each of one contiguous run, and the warp's stores coalesce (the key's
// x-element pieces too: slot-minor runs of x elements). Small calls (T < 32) take fewer token
// lanes and more chunks a warp, in CTAs of one warp (cuda_impl.py: a CTA's stores all pass
// through one SM's load/store unit, so a small call in one CTA of 256 threads took 3.6 µs).
// Every head is written (the grid's y covers H * D / VEC chunks), heads take their own scale
// (k_scale_stride 1), and slots < 0 (padding) or >= num_slots are skipped; rows of key/value
// past num_tokens are never read.
//
// PAIR (1-byte cache elements, VEC = 8): the two lanes of a pair (lane ids 2m, 2m + 1) take one
// token's chunks 2c and 2c + 1, 16 consecutive elements, and swap bytes (one shuffle) so that the
// even lane holds the even d of the 16 and the odd lane the odd d. Each value store then writes
// d and d + 1 of one token side by side: rows block_size bytes apart, one 32-byte sector for
// block size 16, where tokens-fastest lanes at random slots write a sector per lane. The warp
// covers 16 tokens x 2 chunks, so a prefill's consecutive slots still fill whole sectors, and
// the key pieces and the input rows of a pair are 16 contiguous bytes as well.
//
// VEC elements are loaded as one access (16 bytes at most), converted (kvw/vec_io.cuh's
// convert_chunk: copy, float cast, or the fp8 rule of kvw/fp8.cuh), and stored as VEC / KP
// pieces of KP elements into the key cache (cuda_impl.py launches KP = VEC, VEC dividing x and
// kc_elem == 1, or KP = 1) and as VEC single elements into the value cache.
#include "kvw/common.cuh"
#include "kvw/fp8.cuh"
#include "kvw/vec_io.cuh"
#include "kvw/slot.cuh"

#ifndef KVWRITE_HOST_TEST

#define KVW_LEGACY_PARAMS                                                                       \
    const u8* __restrict__ key,           /* [T_pad, H, D]; token stride key_stride (elements) */ \
    const u8* __restrict__ value,         /* [T_pad, H, D]; token stride value_stride */        \
    u8* __restrict__ key_cache,           /* [num_blocks, H, D/x, block_size, x] via strides */ \
    u8* __restrict__ value_cache,         /* [num_blocks, H, D, block_size] via strides */      \
    const SlotT* __restrict__ slot_mapping,  /* [num_tokens] */                                 \
    const float* __restrict__ k_scale,    /* [1] or [H] (fp8 only, else unused) */              \
    const float* __restrict__ v_scale,    /* [1] or [H] */                                      \
    i64 num_tokens,                                                                             \
    i64 k_scale_stride, i64 v_scale_stride,  /* 0 (per tensor) or 1 (per head) */               \
    i64 key_stride, i64 value_stride,     /* token strides of key and value, in elements */     \
    i64 kc_block, i64 kc_head, i64 kc_group, i64 kc_slot, i64 kc_elem,  /* key_cache strides */ \
    i64 vc_block, i64 vc_head, i64 vc_dim, i64 vc_slot,  /* value_cache strides (elements) */   \
    i64 block_size, i64 block_shift,      /* block_shift = log2(block_size), or -1 */           \
    i64 num_slots,                        /* num_blocks * block_size */                         \
    i64 x,                                /* key_cache.size(4) */                               \
    i64 chunks_per_head,                  /* D / VEC */                                         \
    i64 chunks                            /* H * D / VEC */

// In a build specialized for one call signature (-D KVWRITE_FIXED_ARGS=v0,...,v16) the
// arguments from key_stride on are compile-time constants: none is read from the parameter bank
// and the index math (the divisions by chunks_per_head and x included) folds.
#define KVW_LEGACY_FIXED_PROLOGUE() KVW_ASSIGN_FIXED_ARGS(key_stride, value_stride, kc_block,   \
    kc_head, kc_group, kc_slot, kc_elem, vc_block, vc_head, vc_dim, vc_slot, block_size,        \
    block_shift, num_slots, x, chunks_per_head, chunks)

// Bytes [j * P, j * P + P) of a chunk (P = 1, 2 or a multiple of 4).
template <int P, int N>
KVW_HD Raw<P> raw_piece(const Raw<N>& r, int j) {
  Raw<P> p;
  if constexpr (P >= 4) {
#pragma unroll
    for (int i = 0; i < P / 4; ++i) p.w[i] = r.w[j * (P / 4) + i];
  } else {
    p.w[0] = (r.w[(j * P) / 4] >> (8 * ((j * P) & 3))) & ((1u << (8 * P)) - 1u);
  }
  return p;
}

template <int IN, int OUT, int VEC, int KP, bool PAIR, typename SlotT>
__global__ void __launch_bounds__(256) reshape_and_cache_kernel(KVW_LEGACY_PARAMS) {
  KVW_PDL_ENTRY();
  KVW_LEGACY_FIXED_PROLOGUE()
  constexpr int IB = elem_bytes(IN);
  constexpr int OB = OUT == DT_COPY ? IB : elem_bytes(OUT);
  constexpr int IN_BYTES = VEC * IB;
  constexpr bool FP8 = OUT == DT_E4M3 || OUT == DT_E5M2;
  // As reshape_and_cache_flash's kernel: branch-free scale reciprocals for chunks of at most 8
  // input bytes, the bracket (where the GPU converts in hardware) for wider ones.
  constexpr bool FAST_SCALE = IN_BYTES <= 8;
  static_assert(VEC % KP == 0, "key pieces tile the chunk");
  static_assert(!PAIR || (OB == 1 && VEC == 8), "pairs swap 8 one-byte elements");
  // The thread's token lane and chunk row: threadIdx as is, or (PAIR) the linear thread id's
  // bit 0 is the chunk row's (blockDim.y and chunks_per_head are even: a pair never straddles a
  // head or the last chunk, and both of its lanes pass or fail the bounds test below).
  const u32 lin = threadIdx.y * blockDim.x + threadIdx.x;
  u32 tx = threadIdx.x, ty = threadIdx.y;
  if constexpr (PAIR) {
    tx = (lin >> 1) % blockDim.x;
    ty = (((lin >> 1) / blockDim.x) << 1) | (lin & 1u);
  }
  const i64 t = static_cast<i64>(blockIdx.x) * blockDim.x + tx;
  const u32 u = blockIdx.y * blockDim.y + ty;  // < 65535 * 256
  if (t >= num_tokens || u >= static_cast<u64>(chunks)) return;
  const u32 h = u / static_cast<u32>(chunks_per_head);
  const i64 d0 = static_cast<i64>(u - h * static_cast<u32>(chunks_per_head)) * VEC;
  const i64 in_off = static_cast<i64>(u) * VEC * IB;  // heads are dense: h * D + d0
  i64 s = SLOT_FIRST<SlotT> ? static_cast<i64>(slot_mapping[t]) : 0;
  float k_s = 0.0f, v_s = 0.0f;
  if constexpr (FP8) {
    k_s = k_scale[h * k_scale_stride];
    v_s = v_scale[h * v_scale_stride];
  }
  // Copies load with ld.volatile (load_raw_for), loads ptxas may not move below the slot's test.
  Raw<IN_BYTES> kin = load_raw_for<IN_BYTES, OUT == DT_COPY>(key + t * key_stride * IB + in_off);
  Raw<IN_BYTES> vin =
      load_raw_for<IN_BYTES, OUT == DT_COPY>(value + t * value_stride * IB + in_off);
  if constexpr (!SLOT_FIRST<SlotT>) s = static_cast<i64>(load_index(slot_mapping + t));
  const bool valid = static_cast<u64>(s) < static_cast<u64>(num_slots);  // also s < 0
  const bool slots_fit_u32 = (static_cast<u64>(num_slots) >> 32) == 0;
  const i64 kbase = slot_offset(s, kc_block, kc_slot, block_size, block_shift, slots_fit_u32) +
                    static_cast<i64>(h) * kc_head;
  const i64 vbase = slot_offset(s, vc_block, vc_slot, block_size, block_shift, slots_fit_u32) +
                    static_cast<i64>(h) * vc_head;
  Raw<VEC * OB> kout, vout;
  if constexpr (OUT == DT_COPY) {
    kout = kin;
    vout = vin;
  } else {
    Fp8Scale ks{}, vs{};
    if constexpr (FP8) {
      ks = make_fp8_scale<FAST_SCALE, !FAST_SCALE>(k_s);
      vs = make_fp8_scale<FAST_SCALE, !FAST_SCALE>(v_s);
    }
    kout = convert_chunk<IN, OUT, VEC>(kin, ks);
    vout = convert_chunk<IN, OUT, VEC>(vin, vs);
  }
  // PAIR: the even lane gives its odd elements for its partner's even ones; afterwards value
  // byte i of either lane is element d_pair + 2 i + odd. Both lanes of the pair are here (same
  // token, same slot), and only they take part in the shuffle.
  const u32 odd = PAIR ? (lin & 1u) : 0u;
  if constexpr (PAIR) {
    const u32 evens = __byte_perm(vout.w[0], vout.w[1], 0x6420);  // bytes 0, 2, 4, 6
    const u32 odds = __byte_perm(vout.w[0], vout.w[1], 0x7531);   // bytes 1, 3, 5, 7
    const u32 got = __shfl_xor_sync(3u << (lin & 30u), odd ? evens : odds, 1);
    vout.w[0] = odd ? got : evens;
    vout.w[1] = odd ? odds : got;
  }
  if (!valid) return;
#pragma unroll
  for (int j = 0; j < VEC / KP; ++j) {
    const u32 d = static_cast<u32>(d0) + j * KP;
    const u32 grp = d / static_cast<u32>(x);
    const i64 off = kbase + static_cast<i64>(grp) * kc_group +
                    static_cast<i64>(d - grp * static_cast<u32>(x)) * kc_elem;
    store_raw<KP * OB>(key_cache + off * OB, raw_piece<KP * OB>(kout, j));
  }
  const i64 vd0 = PAIR ? d0 - 8 * odd : d0;   // the pair's first element
  constexpr i64 VD_STEP = PAIR ? 2 : 1;
#pragma unroll
  for (int i = 0; i < VEC; ++i)
    store_raw<OB>(value_cache + (vbase + (vd0 + i * VD_STEP + odd) * vc_dim) * OB,
                  raw_piece<OB>(vout, i));
}
#endif  // KVWRITE_HOST_TEST
