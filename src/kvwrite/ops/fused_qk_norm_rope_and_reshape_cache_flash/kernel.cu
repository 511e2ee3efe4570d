// kvwrite: fused_qk_norm_rope_and_reshape_cache_flash (docs/ops/fused_qk_norm_rope.md): QK-norm
// and RoPE of every query and key head of the packed qkv, the query written back (or to
// query_out, plain or fp8), the key written back (unless rotate_key_in_place is false), and the
// key and value rows written into the paged caches, in one launch. Compiled at run time with
// NVRTC (cuda_impl.py), one module per instantiation of qk_norm_rope_cache_kernel<IN, CS, WQ, WK,
// OUT, QO, E, L, SEG, V, VW, VT, NEOX, PS, PosT, SlotT, CTA, MIN_BLOCKS, VALUE_FIRST>.
//
// Work split as fused_qk_norm_rope's kernel: one group of L lanes per (token, head) of the
// Hq + Hk query and key heads (kvw/qk_norm.cuh's lane layout), CTAs of CTA threads. A key
// head's group also carries its value head (Hv == Hk): it loads the value's chunks with the
// key's (tokens t < num_tokens), and for a slot in [0, num_slots) stores Q(key as rounded to
// qkv's dtype) and Q(value) chunk by chunk (kvw/vec_io.cuh's convert_chunk: copies, casts, fp8
// by the contract's rule with scales read on the device; convert_fp8_chunks: a power-of-two
// scale by one product an element, 16-bit rows under fp8_fast16_scale's scales by three). A
// token whose position is outside the table is not touched at all. The large-call build
// (VALUE_FIRST) converts the value before it requests the table's entries and stores it then,
// or right after the key's chunks where a head's cache row is 128 bytes (value_after below);
// the small-call build requests the table's entries first and converts the value while they
// are in flight.
#include "kvw/common.cuh"
#include "kvw/fp8.cuh"
#include "kvw/vec_io.cuh"
#include "kvw/slot.cuh"
#include "kvw/rope.cuh"
#include "kvw/qk_norm.cuh"

// In a build specialized for one call signature (-D KVWRITE_FIXED_ARGS=v0,...,v17) the arguments
// from qkv_stride on are compile-time constants: none is read from the parameter bank and the
// index math (the division by the heads per token, the slot's block split) folds.
#define KVW_QKN_CACHE_FIXED_PROLOGUE() KVW_ASSIGN_FIXED_ARGS(qkv_stride, qkv_head_stride,       \
    qo_stride, max_position, block_stride, page_stride, head_stride, block_size, block_shift,   \
    num_slots, num_q_heads, num_k_heads, head_size, rot, eps_bits, offset_bits, add_offset,     \
    store_key)

// IN: qkv's element kind; CS: the table's; WQ, WK: the weights' (QKN_NO_WEIGHT: none); OUT: the
// caches' element (DT_COPY: qkv's own dtype); QO: the query's destination (QKN_IN_PLACE, DT_COPY:
// query_out of qkv's dtype, DT_E4M3 / DT_E5M2: an fp8 query_out scaled by q_scale); E, L, SEG,
// V, VW, VT, PS: the lane layout and widths (kvw/qk_norm.cuh); CTA, MIN_BLOCKS: the CTA's
// threads and __launch_bounds__'s minimum of resident CTAs; VALUE_FIRST: the large-call order.
template <int IN, int CS, int WQ, int WK, int OUT, int QO, int E, int L, int SEG, int V, int VW,
          int VT, bool NEOX, int PS, typename PosT, typename SlotT, int CTA, int MIN_BLOCKS,
          bool VALUE_FIRST>
__global__ void __launch_bounds__(CTA, MIN_BLOCKS) qk_norm_rope_cache_kernel(
    const PosT* __restrict__ positions,   // [T_rot]
    u8* qkv,                              // [T_pad, Hq + Hk + Hv, D]; token stride qkv_stride,
                                          // head stride qkv_head_stride (elements)
    u8* query_out,                        // [T_pad, Hq, D] of QO's kind; token stride qo_stride,
                                          // dense heads
    const u8* __restrict__ cos_sin,       // [max_position, rot], elements of kind CS
    const u8* __restrict__ q_weight,      // [D] of kind WQ
    const u8* __restrict__ k_weight,      // [D] of kind WK
    u8* __restrict__ key_cache,           // [num_blocks, block_size, Hk, D] via strides
    u8* __restrict__ value_cache,         // same strides as key_cache
    const SlotT* __restrict__ slot_mapping,  // [num_tokens]
    const float* __restrict__ k_scale,    // [1] or [Hk] (fp8 caches only)
    const float* __restrict__ v_scale,
    const float* __restrict__ q_scale,    // [1] or [Hq] (fp8 query_out only)
    i64 num_rot, i64 num_tokens, i64 k_scale_stride, i64 v_scale_stride, i64 q_scale_stride,
    // the fixed arguments (KVWRITE_FIXED_ARGS above)
    i64 qkv_stride, i64 qkv_head_stride, i64 qo_stride, i64 max_position, i64 block_stride,
    i64 page_stride, i64 head_stride, i64 block_size, i64 block_shift, i64 num_slots,
    i64 num_q_heads, i64 num_k_heads, i64 head_size, i64 rot, i64 eps_bits, i64 offset_bits,
    i64 add_offset, i64 store_key) {
  KVW_PDL_ENTRY();
  KVW_QKN_CACHE_FIXED_PROLOGUE()
  using LY = QknLayout<E, L, SEG>;
  constexpr int IB = elem_bytes(IN);
  constexpr int OB = OUT == DT_COPY ? IB : elem_bytes(OUT);
  constexpr bool FP8 = OUT == DT_E4M3 || OUT == DT_E5M2;
  constexpr bool QFP8 = QO == DT_E4M3 || QO == DT_E5M2;
  constexpr int QB = QFP8 ? 1 : IB;
  const u64 units_per_token = static_cast<u64>(num_q_heads + num_k_heads);
  const u64 thread = static_cast<u64>(blockIdx.x) * CTA + threadIdx.x;
  const u64 grp = thread / L;
  const u64 t = grp / units_per_token;
  if (t >= static_cast<u64>(num_rot)) return;  // whole groups: every lane of one leaves
  const u32 j = static_cast<u32>(grp - t * units_per_token);
  const u32 i0 = (static_cast<u32>(thread) & (L - 1)) * SEG;
  const bool is_q = j < static_cast<u64>(num_q_heads);
  const i64 h = static_cast<i64>(j) - (is_q ? 0 : num_q_heads);  // the head within its kind
  u8* row = qkv + static_cast<i64>(t) * qkv_stride * IB +
            static_cast<i64>(j) * qkv_head_stride * IB;
  const bool cached = !is_q && t < static_cast<u64>(num_tokens);
  // The rows first (volatile: not sunk below the position's test; a key group's value row too,
  // Hk heads after its key), then the scales (load_scale: used only after the rotation, but
  // needed in flight now), the weights, and the position and slot (load_index: nothing computed
  // from them placed before the rows' loads).
  const QknRow<IN, E, V> x = qkn_load_row<IN, LY, V>(row, i0, head_size);
  QknRow<IN, E, V> v = qkn_zero_row<IN, E, V>();
  if (cached) v = qkn_load_row<IN, LY, V>(row + num_k_heads * qkv_head_stride * IB, i0, head_size);
  // The scales by every lane, branch-free (a query group reads head 0's k and v scales, a key
  // group head 0's q scale: always there).
  float k_s = 0.0f, v_s = 0.0f, q_s = 0.0f;
  if constexpr (FP8) {
    const i64 hk = is_q ? 0 : h;
    k_s = load_scale(k_scale + hk * k_scale_stride);
    v_s = load_scale(v_scale + hk * v_scale_stride);
  }
  if constexpr (QFP8) {
    q_s = load_scale(q_scale + (is_q ? h : 0) * q_scale_stride);
  }
  const i64 pos = static_cast<i64>(load_index(positions + t));
  const i64 s = cached ? static_cast<i64>(load_index(slot_mapping + t)) : -1;
  const auto w = qkn_load_weights<WQ, WK, LY, VW>(q_weight, k_weight, is_q, i0, head_size);
  if (static_cast<u64>(pos) >= static_cast<u64>(max_position)) return;  // also pos < 0
  const u32 half = static_cast<u32>(rot) / 2;
  const bool valid = static_cast<u64>(s) < static_cast<u64>(num_slots);  // also s < 0: a query
  // value_after: the value's chunks are stored right after the key's (the small-call build,
  // and the large-call one where a head's cache row is 128 bytes of fp8: D = 128), so that K
  // and V of a (slot, head), adjacent in the packed layout, are written together (as
  // fused_rope_and_reshape_cache_flash's kernel, tuning-log change 53). Not for 16-bit caches
  // with D = 64 (the fused RoPE kernel holds those too): the 32 bytes held per lane spilled 40
  // bytes under the large-call build's 48 registers.
  const bool value_after = !VALUE_FIRST || (OB == 1 && head_size == 128);
  i64 coff = 0;  // the (slot, head) row's element offset in either cache
  // fp8 scales: the quotient's constants (ks, vs, qs); in the large-call build (P2, without an
  // fp8 query) instead, a cache scale's exact reciprocal where it is a power of two (kr, vr;
  // else 0: one product an element, vLLM's default 1.0) and fp8_fast16_scale's constants (kf,
  // vf: 16-bit rows in its scale range, three operations an element), the quotient (under
  // fp8_fast16_fallback's constants) for the rest. The choice is a head's: uniform within a
  // group. Measured (H200, Qwen3-8B, docs/tuning-log.md changes 100 and 112): scales 1.0
  // 0.88-0.97 of the quotient's time from T = 1024; scales 0.05 / 0.04, the three operations
  // against the quotient, hot, 0.95 at T = 1024 and 2048, 1.007-1.010 from T = 4096 (cold
  // 0.996-1.008). In the small-call build the scales' test lengthened a small call's chain
  // (other scales +2-4% at T <= 256); the fp8-query builds already spill under the bound
  // (bfloat16 D = 128: 32 bytes, float16 D = 64: 16) and the second branch spilled more
  // (float16 D = 64: 36); holding the quotient's constants beside kf, vf spilled 8 bytes.
  constexpr bool P2 = VALUE_FIRST && !QFP8;
  Fp8Scale ks{}, vs{}, qs{};
  float kr = 0.0f, vr = 0.0f;
  Fp8Fast16 kf{}, vf{};
  Raw<V * OB> cv[E / V];  // the value's chunks converted to the cache's kind
  const auto converted = [&](const Raw<V * IB>& in, const Fp8Scale& sc) -> Raw<V * OB> {
    if constexpr (OUT == DT_COPY) {
      return in;
    } else {
      return convert_chunk<IN, OUT, V>(in, sc);
    }
  };
  // A valid slot's offset, the fp8 scales' constants and the value's conversion.
  const auto prepare_value = [&]() {
    coff = slot_offset(s, block_stride, page_stride, block_size, block_shift,
                       (static_cast<u64>(num_slots) >> 32) == 0) + h * head_stride;
    if constexpr (P2 && FP8) {
      kr = pow2_scale_reciprocal(k_s);
      vr = pow2_scale_reciprocal(v_s);
      kf = fp8_fast16_scale<IN>(k_s);
      vf = fp8_fast16_scale<IN>(v_s);
      convert_fp8_chunks<IN, OUT, V>(v.c, vr, vf, cv);
    } else {
      if constexpr (FP8) {
        ks = make_fp8_scale<true>(k_s);
        vs = make_fp8_scale<true>(v_s);
      }
#pragma unroll
      for (int k = 0; k < E / V; ++k) cv[k] = converted(v.c[k], vs);
    }
  };
  const auto store_value = [&]() {
#pragma unroll
    for (int k = 0; k < E / V; ++k) {
      const u32 b = LY::off(i0, k * V);
      if (b < static_cast<u64>(head_size))
        store_raw<V * OB>(value_cache + (coff + b) * OB, cv[k]);
    }
  };
  if constexpr (VALUE_FIRST) {
    // A key group converts its value (and stores it, unless value_after) before it requests
    // the table's entries, so that it does not hold the value's input and the entries at once.
    if (valid) {
      prepare_value();
      if (!value_after) store_value();
    }
  }
  const auto tb = qkn_load_table<CS, LY, VT, NEOX, PS>(cos_sin + pos * rot * elem_bytes(CS), i0,
                                                       half, static_cast<u32>(rot));
  if constexpr (!VALUE_FIRST) {
    // While the table's entries are in flight: the stores' offset, the fp8 scales' constants
    // and the value's conversion (after the rotation, they were on a small call's latency path).
    if (valid) prepare_value();
  }
  if constexpr (QFP8) qs = make_fp8_scale<true>(q_s);
  const float offset = bits_f32(static_cast<u32>(offset_bits));
  float* group = nullptr;
  if constexpr (NEOX && PS == 0) group = qkn_exchange<E, L, CTA>();
  float n[E];
  qkn_norm_rope<IN, CS, LY, V, VT, NEOX, PS, WQ, WK, VW, (MIN_BLOCKS > 1)>(
      x, w, is_q, add_offset != 0, offset, tb, i0, head_size, half, static_cast<u32>(rot),
      bits_f32(static_cast<u32>(eps_bits)), group, qkn_group_mask<L>(), n);
  const QknRow<IN, E, V> out = qkn_round<IN, E, V>(n);
  if (is_q) {
    if constexpr (QO == QKN_IN_PLACE) {
      qkn_store_row<IN, LY, V>(row, out, i0, head_size);
    } else {
      u8* qrow = query_out + (static_cast<i64>(t) * qo_stride + h * head_size) * QB;
#pragma unroll
      for (int k = 0; k < E / V; ++k) {
        const u32 b = LY::off(i0, k * V);
        if (b >= static_cast<u64>(head_size)) continue;
        if constexpr (QFP8) {
          store_raw<V>(qrow + b, convert_chunk<IN, QO, V>(out.c[k], qs));
        } else {
          store_raw<V * IB>(qrow + static_cast<i64>(b) * IB, out.c[k]);
        }
      }
    }
    return;
  }
  if (store_key) qkn_store_row<IN, LY, V>(row, out, i0, head_size);
  if (!valid) return;
#pragma unroll
  for (int k = 0; k < E / V; ++k) {
    const u32 b = LY::off(i0, k * V);
    if (b >= static_cast<u64>(head_size)) continue;
    const i64 c = (coff + b) * OB;
    if constexpr (P2 && FP8) {
      // A chunk at a time (a row's chunks held at once spilled under the large-call bound).
      const Raw<V * IB> in[1] = {out.c[k]};
      Raw<V * OB> ck[1];
      convert_fp8_chunks<IN, OUT, V>(in, kr, kf, ck);
      store_raw<V * OB>(key_cache + c, ck[0]);
    } else {
      store_raw<V * OB>(key_cache + c, converted(out.c[k], ks));
    }
    if (value_after) store_raw<V * OB>(value_cache + c, cv[k]);
  }
}
