// kvwrite: write new key/value rows into a paged KV cache (reshape_and_cache_flash,
// docs/ops/reshape_and_cache_flash.md).
//
// Compiled at run time with NVRTC (see cuda_impl.py); one module per instantiation of
// `reshape_and_cache_flash_kernel<IN, OUT, VEC, SlotT>` (no loops; every call whose row fits
// its grid) or `reshape_and_cache_flash_grid_stride_kernel<...>` (the rest), and per call
// signature when the fixed arguments are compiled in (KVWRITE_FIXED_ARGS). The shared parts
// (element kinds, fp8 quantization, vector I/O, slot addressing) come from kvwrite's kernel
// headers (src/kvwrite/kernels/include/kvw), found through NVRTC's include path; nothing else is
// included (neither torch nor CUDA), so NVRTC needs no toolkit include directory.
#include "kvw/common.cuh"
#include "kvw/fp8.cuh"
#include "kvw/vec_io.cuh"
#include "kvw/slot.cuh"

#ifndef KVWRITE_HOST_TEST
// ------------------------------------------------------------------------------------------
// The kernels.
//
// Work split: a token row is C = H*D/VEC chunks. A CTA is a [blockDim.y tokens, blockDim.x =
// row <= C chunks] grid of threads: several tokens per CTA when C is small, and grid.y > 1 CTAs
// per token when C is large. Both kernels take the same arguments and CTA shape:
// - reshape_and_cache_flash_kernel (every call whose row fits in grid.y CTAs): no loops, each
//   thread writes one chunk of one token. Its slot, K, V (and fp8 scale) loads are issued
//   together, before the slot is tested, so a thread's time is one memory round trip, the
//   conversion and the stores.
// - reshape_and_cache_flash_grid_stride_kernel (rows longer than the grid can hold): each thread
//   owns one chunk index c of the row (so one head, one scale, token-invariant offsets computed
//   once) and walks the tokens with a grid stride, two tokens per step: the slots and both
//   tokens' K and V chunks are loaded before anything is converted or stored.
// In both, the prologue before the first loads has no division (2D CTAs; the head index is a
// shift when D/VEC is a power of two) and issues the fp8 scale loads too, so their latency
// overlaps the data's; the scales' constants are computed once the data loads are in flight.
// Slots < 0 (padding) or >= num_slots are skipped; rows of key/value past num_tokens are never
// read. No shared memory, no barriers: a thread whose chunk is past C simply exits.
// ------------------------------------------------------------------------------------------

// The parameters of both kernels (cuda_impl.py passes the same arguments to either).
#define KVW_KERNEL_PARAMS                                                                       \
    const u8* __restrict__ key,           /* [T_pad, H, D]; token stride key_stride (elements) */ \
    const u8* __restrict__ value,         /* [T_pad, H, D]; token stride value_stride */        \
    u8* __restrict__ key_cache,           /* [num_blocks, block_size, H, D] via strides */      \
    u8* __restrict__ value_cache,         /* same strides as key_cache */                       \
    const SlotT* __restrict__ slot_mapping,  /* [num_tokens] */                                 \
    const float* __restrict__ k_scale,    /* [1] or [H] (fp8 only, else unused) */              \
    const float* __restrict__ v_scale,    /* [1] or [H] */                                      \
    i64 num_tokens,                                                                             \
    i64 k_scale_stride, i64 v_scale_stride,  /* 0 (per tensor) or 1 (per head) */               \
    i64 key_stride, i64 value_stride,     /* token strides of key and value, in elements */     \
    i64 block_stride, i64 page_stride, i64 head_stride,  /* cache strides in elements */        \
    i64 block_size, i64 block_shift,      /* block_shift = log2(block_size), or -1 */           \
    i64 num_slots,                        /* num_blocks * block_size */                         \
    i64 chunks_per_head,                  /* D / VEC */                                         \
    i64 chunks_per_token,                 /* H * D / VEC */                                     \
    i64 head_shift                        /* log2(chunks_per_head), or -1 */

// Element sizes of a variant, and (in a build specialized for one call signature, -D
// KVWRITE_FIXED_ARGS=v0,...,v10) the arguments from key_stride on replaced by compile-time
// constants, so that none of them is read from the parameter bank and the index math folds.
// FAST_SCALE: the fp8 scales' reciprocals without a branch (rcp_rn_s2) for chunks of at most 8
// input bytes (the small calls' chunks: 0.015-0.05 us less per call). Wider chunks keep div_rn:
// without its branch, ptxas issues loads in the middle of the conversion (to save registers), a
// memory round trip more per thread: the second 16-byte loads of K and V of 32-byte chunks
// (H=8 T=4096 5.4 -> 6.0 us), V's load after K's conversion in 16-byte chunks (H=128 T=32
// 2.1 -> 3.2 us, also with ld.volatile); it keeps loads above a branch. docs/tuning-log.md,
// changes 28 and 31. The wider chunks also quantize by kvw/fp8.cuh's bracket (make_fp8_scale's
// BRACKET = !FAST_SCALE), where the GPU converts to fp8 in hardware; div_rn then serves only
// the threads whose bracket holds a rounding boundary (change 33).
#define KVW_FIXED_ARGS_PROLOGUE() KVW_ASSIGN_FIXED_ARGS(key_stride, value_stride,               \
    block_stride, page_stride, head_stride, block_size, block_shift, num_slots,                 \
    chunks_per_head, chunks_per_token, head_shift)
#define KVW_KERNEL_PROLOGUE()                                                                   \
  constexpr int IB = elem_bytes(IN);                                                            \
  constexpr int OB = OUT == DT_COPY ? IB : elem_bytes(OUT);                                     \
  constexpr int IN_BYTES = VEC * IB;                                                            \
  constexpr int OUT_BYTES = VEC * OB;                                                           \
  constexpr bool FP8 = OUT == DT_E4M3 || OUT == DT_E5M2;                                        \
  constexpr bool FAST_SCALE = IN_BYTES <= 8;                                                   \
  KVW_FIXED_ARGS_PROLOGUE()                                                                     \
  const bool slots_fit_u32 = (static_cast<u64>(num_slots) >> 32) == 0;

template <int IN, int OUT, int VEC, typename SlotT>
__global__ void __launch_bounds__(256)
reshape_and_cache_flash_grid_stride_kernel(KVW_KERNEL_PARAMS) {
  KVW_PDL_ENTRY();
  KVW_KERNEL_PROLOGUE()

  const u32 row = blockDim.x;
  const u32 tx = threadIdx.x;
  const i64 t_first = static_cast<i64>(blockIdx.x) * blockDim.y + threadIdx.y;
  const i64 t_step = static_cast<i64>(gridDim.x) * blockDim.y;

  if (t_first >= num_tokens) return;

  for (i64 c = static_cast<i64>(blockIdx.y) * row + tx; c < chunks_per_token;
       c += static_cast<i64>(gridDim.y) * row) {
    const i64 in_off = c * VEC * IB;  // bytes; heads are dense
    // Slots and both tokens' K and V chunks are loaded before anything is stored.
    i64 s0, s1;
    Raw<IN_BYTES> k0, v0, k1, v1;
    auto load = [&](i64 t0) {
      const i64 t1 = t0 + t_step;
      const bool has1 = t1 < num_tokens;
      s0 = static_cast<i64>(slot_mapping[t0]);
      s1 = has1 ? static_cast<i64>(slot_mapping[t1]) : -1;
      k0 = load_raw<IN_BYTES>(key + t0 * key_stride * IB + in_off);
      v0 = load_raw<IN_BYTES>(value + t0 * value_stride * IB + in_off);
      k1 = k0;
      v1 = v0;
      if (has1) {
        k1 = load_raw<IN_BYTES>(key + t1 * key_stride * IB + in_off);
        v1 = load_raw<IN_BYTES>(value + t1 * value_stride * IB + in_off);
      }
    };
    // The head of chunk c. 32-bit: c < H * D / VEC fits, and a 64-bit division is a long
    // subroutine on the GPU.
    const u32 h32 = head_shift >= 0 ? static_cast<u32>(c) >> head_shift
                                    : static_cast<u32>(c) / static_cast<u32>(chunks_per_head);
    const i64 h = h32;
    float k_s = 0.0f, v_s = 0.0f;
    if constexpr (FP8) {  // issued now, used after the data loads below
      k_s = k_scale[h * k_scale_stride];
      v_s = v_scale[h * v_scale_stride];
    }
    i64 t0 = t_first;
    load(t0);

    // Per-thread constants, computed while the first loads are in flight (code placed before
    // them would delay them: the division's branches end the region loads can be scheduled in).
    const i64 d =
        static_cast<i64>(static_cast<u32>(c) - h32 * static_cast<u32>(chunks_per_head)) * VEC;
    const i64 cache_off = (h * head_stride + d) * OB;  // bytes
    Fp8Scale ks{}, vs{};
    if constexpr (FP8) {
      ks = make_fp8_scale<FAST_SCALE, !FAST_SCALE>(k_s);
      vs = make_fp8_scale<FAST_SCALE, !FAST_SCALE>(v_s);
    }

    // Writes one token's chunk of K and V to slot s (skipped unless 0 <= s < num_slots).
    // A lambda called twice, not a conditional picking the chunk: NVRTC 13.5 narrowed
    // `const Raw<16>& kin = u == 0 ? k0 : k1;` to 4-byte loads and stores (seen in its PTX).
    auto put = [&](i64 s, const Raw<IN_BYTES>& kin, const Raw<IN_BYTES>& vin) {
      if (static_cast<u64>(s) >= static_cast<u64>(num_slots)) return;  // also s < 0
      const i64 off = slot_offset(s, block_stride, page_stride, block_size, block_shift,
                                  slots_fit_u32) * OB + cache_off;
      if constexpr (OUT == DT_COPY) {
        store_raw<OUT_BYTES>(key_cache + off, kin);
        store_raw<OUT_BYTES>(value_cache + off, vin);
      } else {
        store_raw<OUT_BYTES>(key_cache + off, convert_chunk<IN, OUT, VEC>(kin, ks));
        store_raw<OUT_BYTES>(value_cache + off, convert_chunk<IN, OUT, VEC>(vin, vs));
      }
    };

    while (true) {
      put(s0, k0, v0);
      put(s1, k1, v1);
      t0 += 2 * t_step;
      if (t0 >= num_tokens) break;
      load(t0);
    }
  }
}
// ------------------------------------------------------------------------------------------
// The loop-free kernel (see "The kernels" above). Against the grid-stride kernel it saves small
// calls about 0.1-0.2 us of index and loop control and large ones 1-3% (docs/tuning-log.md).
// ------------------------------------------------------------------------------------------
template <int IN, int OUT, int VEC, typename SlotT>
__global__ void __launch_bounds__(256) reshape_and_cache_flash_kernel(KVW_KERNEL_PARAMS) {
  KVW_PDL_ENTRY();
  KVW_KERNEL_PROLOGUE()
  const i64 t = static_cast<i64>(blockIdx.x) * blockDim.y + threadIdx.y;
  const u32 c = blockIdx.y * blockDim.x + threadIdx.x;  // < 65535 * 256
  if (t >= num_tokens || c >= chunks_per_token) return;
  const u32 h = head_shift >= 0 ? c >> head_shift : c / static_cast<u32>(chunks_per_head);
  const i64 in_off = static_cast<i64>(c) * VEC * IB;
  const i64 s = static_cast<i64>(slot_mapping[t]);
  float k_s = 0.0f, v_s = 0.0f;
  if constexpr (FP8) {
    k_s = k_scale[h * k_scale_stride];
    v_s = v_scale[h * v_scale_stride];
  }
  // The chunks must be loaded before the slot's test, not after it (that would make them wait
  // for the slot's load, a memory round trip): copies load with ld.volatile (load_raw_for).
  Raw<IN_BYTES> kin = load_raw_for<IN_BYTES, OUT == DT_COPY>(key + t * key_stride * IB + in_off);
  Raw<IN_BYTES> vin =
      load_raw_for<IN_BYTES, OUT == DT_COPY>(value + t * value_stride * IB + in_off);
  const bool valid = static_cast<u64>(s) < static_cast<u64>(num_slots);  // also s < 0
  const i64 d = static_cast<i64>(c - h * static_cast<u32>(chunks_per_head)) * VEC;
  const i64 off = (slot_offset(s, block_stride, page_stride, block_size, block_shift,
                               slots_fit_u32) + static_cast<i64>(h) * head_stride + d) * OB;
  if constexpr (OUT == DT_COPY) {
    if (valid) {
      store_raw<OUT_BYTES>(key_cache + off, kin);
      store_raw<OUT_BYTES>(value_cache + off, vin);
    }
  } else {
    Fp8Scale ks{}, vs{};
    if constexpr (FP8) {
      ks = make_fp8_scale<FAST_SCALE, !FAST_SCALE>(k_s);
      vs = make_fp8_scale<FAST_SCALE, !FAST_SCALE>(v_s);
    }
    const auto kout = convert_chunk<IN, OUT, VEC>(kin, ks);
    const auto vout = convert_chunk<IN, OUT, VEC>(vin, vs);
    if (valid) {
      store_raw<OUT_BYTES>(key_cache + off, kout);
      store_raw<OUT_BYTES>(value_cache + off, vout);
    }
  }
}
#endif  // KVWRITE_HOST_TEST
