// kvwrite: concat_and_cache_mla (docs/ops/concat_and_cache_mla.md): write one MLA latent row (kv_c
// then k_pe) per token into a paged cache [num_blocks, block_size, E].
//
// Compiled at run time with NVRTC (see cuda_impl.py): one module per instantiation and, by
// default, per call signature, with the arguments fixed by the caches and the inputs' layout
// compiled in (KVWRITE_FIXED_ARGS). The shared parts (element kinds, fp8 quantization, vector
// I/O, slot addressing) come from kvwrite's kernel headers; nothing else is included.
//
// - concat_and_cache_mla_kernel<IN, OUT, VEC, SlotT> ("auto", "fp8_e4m3", "fp8_e5m2"): a flat
//   grid of threads, one per (token, chunk of VEC elements) of the row kv_c ++ k_pe
//   (chunks = (L + P) / VEC, the first l_chunks from kv_c). Loads are issued before the slot is
//   tested, so a thread's time is one memory round trip, the conversion and the store.
// - concat_and_cache_ds_mla_kernel<IN, ALIGN, SlotT, BRACKET, POW2> ("fp8_ds_mla", L = 512,
//   P = 64 or 0, 16-bit): one warp per token. Lane i holds kv_c elements [8i, 8i + 8) and
//   [256 + 8i, 256 + 8i + 8), so lanes 0-15 hold tiles 0 and 2, lanes 16-31 tiles 1 and 3; each
//   tile's amax is a 16-lane xor-shuffle reduction (fmaxf, which ignores NaN) over data already
//   in registers. Lanes 0-7 carry the 128 bytes of k_pe (the argument l_chunks: the lanes that
//   load them, 8, or 0 for NoPE layers (P = 0), whose rotary bytes are stored as zeros). POW2:
//   the tile scale rule "pow2" (the smallest power of two >= max(amax / 448, float32(1e-4)),
//   kvw/fp8.cuh's ue8m0_round_up), else "amax" (max(amax / 448, FLT_MIN)). ALIGN (16, 8, 4, 2
//   or 1) is the alignment in bytes of every row start (inputs and cache): accesses are 16-byte
//   ones at 16, narrower below.
//   BRACKET (large calls, cuda_impl.py): the tiles are quantized through kvw/fp8.cuh's bracket
//   (two products per element, the exact quotient only where the bracket cannot decide) instead
//   of the exact quotient for every element: fewer instructions per token where throughput
//   counts, a longer chain where latency does (small calls keep the quotient).
// Slots < 0 (padding) or >= num_slots are skipped; rows past num_tokens are never read.
#include "kvw/common.cuh"
#include "kvw/fp8.cuh"
#include "kvw/vec_io.cuh"
#include "kvw/slot.cuh"

#ifndef KVWRITE_HOST_TEST

#define KVW_MLA_PARAMS                                                                          \
    const u8* __restrict__ kv_c,          /* [T_pad, L]; token stride kv_c_stride (elements) */ \
    const u8* __restrict__ k_pe,          /* [T_pad, P]; token stride k_pe_stride */            \
    u8* __restrict__ cache,               /* [num_blocks, block_size, E] via strides */         \
    const SlotT* __restrict__ slot_mapping,  /* [num_tokens] */                                 \
    const float* __restrict__ scale,      /* [1] (fp8_e4m3/e5m2 only, else unused) */           \
    i64 num_tokens,                                                                             \
    i64 kv_c_stride, i64 k_pe_stride,     /* token strides in input elements */                 \
    i64 block_stride, i64 page_stride,    /* cache strides in cache elements */                 \
    i64 block_size, i64 block_shift,      /* block_shift = log2(block_size), or -1 */           \
    i64 num_slots,                        /* num_blocks * block_size */                         \
    i64 l_chunks, i64 chunks              /* L / VEC, (L + P) / VEC; fp8_ds_mla: 2P / 16, 0 */

// In a build specialized for one call signature (-D KVWRITE_FIXED_ARGS=v0,...,v8) the
// arguments from kv_c_stride on are compile-time constants: none is read from the parameter
// bank and the index math (the division by `chunks` included) folds.
#define KVW_MLA_FIXED_PROLOGUE() KVW_ASSIGN_FIXED_ARGS(kv_c_stride, k_pe_stride, block_stride,  \
    page_stride, block_size, block_shift, num_slots, l_chunks, chunks)

template <int IN, int OUT, int VEC, typename SlotT>
__global__ void __launch_bounds__(256) concat_and_cache_mla_kernel(KVW_MLA_PARAMS) {
  KVW_PDL_ENTRY();
  KVW_MLA_FIXED_PROLOGUE()
  constexpr int IB = elem_bytes(IN);
  constexpr int OB = OUT == DT_COPY ? IB : elem_bytes(OUT);
  constexpr int IN_BYTES = VEC * IB;
  constexpr int OUT_BYTES = VEC * OB;
  constexpr bool FP8 = OUT == DT_E4M3 || OUT == DT_E5M2;
  // 32-bit: the host launches at most 2^32 - 1 threads (cuda_impl.py checks).
  const u32 gid = blockIdx.x * blockDim.x + threadIdx.x;
  const u32 t32 = gid / static_cast<u32>(chunks);
  if (t32 >= num_tokens) return;
  const u32 c = gid - t32 * static_cast<u32>(chunks);
  const i64 t = t32;
  // The slot: here (int64) or after the row's load (int32; SLOT_FIRST, kvw/slot.cuh).
  i64 s = SLOT_FIRST<SlotT> ? static_cast<i64>(slot_mapping[t]) : 0;
  float sv = 0.0f;
  if constexpr (FP8) sv = scale[0];
  const bool pe = c >= static_cast<u32>(l_chunks);
  const u8* src = pe ? k_pe + (t * k_pe_stride + static_cast<i64>(c - l_chunks) * VEC) * IB
                     : kv_c + (t * kv_c_stride + static_cast<i64>(c) * VEC) * IB;
  // Copies load with ld.volatile (load_raw_for), loads ptxas may not move below the slot's test.
  Raw<IN_BYTES> in = load_raw_for<IN_BYTES, OUT == DT_COPY>(src);
  if constexpr (!SLOT_FIRST<SlotT>) s = static_cast<i64>(load_index(slot_mapping + t));
  const bool valid = static_cast<u64>(s) < static_cast<u64>(num_slots);  // also s < 0
  const bool slots_fit_u32 = (static_cast<u64>(num_slots) >> 32) == 0;
  const i64 off = (slot_offset(s, block_stride, page_stride, block_size, block_shift,
                               slots_fit_u32) + static_cast<i64>(c) * VEC) * OB;
  if constexpr (OUT == DT_COPY) {
    if (valid) store_raw<OUT_BYTES>(cache + off, in);
  } else {
    const Fp8Scale sc = make_fp8_scale<(IN_BYTES <= 16)>(sv);
    const auto out = convert_chunk<IN, OUT, VEC>(in, sc);
    if (valid) store_raw<OUT_BYTES>(cache + off, out);
  }
}

// fp8_ds_mla entry: [0, 512) e4m3 codes of 4 tiles, [512, 528) their float32 scales,
// [528, 656) the 64 k_pe values' 16-bit patterns (zeros for NoPE).
template <int IN, int ALIGN, typename SlotT, bool BRACKET, bool POW2>
__global__ void __launch_bounds__(256) concat_and_cache_ds_mla_kernel(KVW_MLA_PARAMS) {
  KVW_PDL_ENTRY();
  KVW_MLA_FIXED_PROLOGUE()
  constexpr float FLT_MIN_F = 1.17549435082228750797e-38f;  // 2^-126
  const i64 pe_lanes = l_chunks;  // 8, or 0 (NoPE: k_pe is not read, its bytes stay zero)
  const u32 lane = threadIdx.x & 31u;
  const i64 t = static_cast<i64>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (t >= num_tokens) return;  // the whole warp: t is warp-uniform
  i64 s = SLOT_FIRST<SlotT> ? static_cast<i64>(slot_mapping[t]) : 0;  // as above
  const u8* row = kv_c + t * kv_c_stride * 2;
  const Raw<16> x0 = load_aligned<16, ALIGN>(row + 16 * lane);
  const Raw<16> x1 = load_aligned<16, ALIGN>(row + 512 + 16 * lane);
  Raw<16> pe{};
  if (lane < pe_lanes) pe = load_aligned<16, ALIGN>(k_pe + t * k_pe_stride * 2 + 16 * lane);
  if constexpr (!SLOT_FIRST<SlotT>) s = static_cast<i64>(load_index(slot_mapping + t));

  float f0[8], f1[8];
  float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    f0[i] = elem_f32<IN>(x0, i);
    f1[i] = elem_f32<IN>(x1, i);
    a0 = fmaxf(a0, fabsf(f0[i]));  // fmaxf returns the other operand for a NaN
    a1 = fmaxf(a1, fabsf(f1[i]));
  }
#pragma unroll
  for (int m = 8; m >= 1; m >>= 1) {  // within each half warp: one tile per half
    a0 = fmaxf(a0, __shfl_xor_sync(0xFFFFFFFFu, a0, m));
    a1 = fmaxf(a1, __shfl_xor_sync(0xFFFFFFFFu, a1, m));
  }
  float s0 = div_rn(a0, 448.0f);  // tile (lane >> 4)
  float s1 = div_rn(a1, 448.0f);  // tile 2 + (lane >> 4)
  if constexpr (POW2) {
    const float floor = bits_f32(0x38D1B717u);  // float32(1e-4)
    s0 = ue8m0_round_up(fmaxf(s0, floor));
    s1 = ue8m0_round_up(fmaxf(s1, floor));
  } else {
    s0 = fmaxf(s0, FLT_MIN_F);
    s1 = fmaxf(s1, FLT_MIN_F);
  }
  const float s0_hi = __shfl_sync(0xFFFFFFFFu, s0, 16);   // tile 1
  const float s1_hi = __shfl_sync(0xFFFFFFFFu, s1, 16);   // tile 3
  Raw<8> q0, q1;
  if constexpr (POW2) {  // one multiplication an element, the same codes (kvw/fp8.cuh)
    fp8_quantize_pow2<DT_E4M3, 8>(f0, q0.w, pow2_reciprocal(s0));
    fp8_quantize_pow2<DT_E4M3, 8>(f1, q1.w, pow2_reciprocal(s1));
  } else {
    fp8_quantize<DT_E4M3, 8, 1>(f0, q0.w, make_fp8_scale<true, BRACKET>(s0));
    fp8_quantize<DT_E4M3, 8, 1>(f1, q1.w, make_fp8_scale<true, BRACKET>(s1));
  }

  if (static_cast<u64>(s) >= static_cast<u64>(num_slots)) return;  // also s < 0
  const bool slots_fit_u32 = (static_cast<u64>(num_slots) >> 32) == 0;
  u8* entry = cache + slot_offset(s, block_stride, page_stride, block_size, block_shift,
                                  slots_fit_u32);
  store_aligned<8, ALIGN>(entry + 8 * lane, q0);
  store_aligned<8, ALIGN>(entry + 256 + 8 * lane, q1);
  if (lane == 0) {
    Raw<16> sc;
    sc.w[0] = f32_bits(s0);
    sc.w[1] = f32_bits(s0_hi);
    sc.w[2] = f32_bits(s1);
    sc.w[3] = f32_bits(s1_hi);
    store_aligned<16, ALIGN>(entry + 512, sc);
  }
  if (lane < 8) store_aligned<16, ALIGN>(entry + 528 + 16 * lane, pe);
}
#endif  // KVWRITE_HOST_TEST
