// kvwrite: fused_qk_norm_rope (docs/ops/fused_qk_norm_rope.md): every query and key head of the
// packed qkv RMS-normalized with its weight, then rotated (RoPE), in place. Compiled at run time
// with NVRTC (cuda_impl.py), one module per instantiation of
// qk_norm_rope_kernel<IN, CS, WQ, WK, E, L, SEG, V, VW, VT, NEOX, PS, PosT, CTA, MIN_BLOCKS>.
//
// Work split: a token's work is Hq + Hk heads; one group of L lanes per (token, head), lane l
// holding E elements of the row in segments of SEG (kvw/qk_norm.cuh's QknLayout), as chunks of V
// elements. CTAs of CTA threads, groups in order of (token, head); MIN_BLOCKS: __launch_bounds__'s
// minimum of resident CTAs (1 in the small-call build, cuda_impl.CudaTuning's in the large-call
// one). Each lane loads its chunks, the position after them (load_index), its weights, and for
// a position inside the table the table's entries; the sum of squares is the group's tree; the
// rotation's neox partners are in the lane (PS > 0) or come through shared memory; the rounded
// chunks are stored back. Value heads are not touched.
#include "kvw/common.cuh"
#include "kvw/vec_io.cuh"
#include "kvw/rope.cuh"
#include "kvw/qk_norm.cuh"

// In a build specialized for one call signature (-D KVWRITE_FIXED_ARGS=v0,...,v9) the arguments
// from qkv_stride on are compile-time constants: none is read from the parameter bank, the
// division by the heads per token and the one by D fold, and a head row's offset is the same
// constant multiple whether the heads are dense (qkv_head_stride == head_size) or padded.
#define KVW_QKN_FIXED_PROLOGUE() KVW_ASSIGN_FIXED_ARGS(qkv_stride, qkv_head_stride,             \
    max_position, num_q_heads, units_per_token, head_size, rot, eps_bits, offset_bits,          \
    add_offset)

template <int IN, int CS, int WQ, int WK, int E, int L, int SEG, int V, int VW, int VT, bool NEOX,
          int PS, typename PosT, int CTA, int MIN_BLOCKS>
__global__ void __launch_bounds__(CTA, MIN_BLOCKS) qk_norm_rope_kernel(
    const PosT* __restrict__ positions,   // [T_rot]
    u8* qkv,                              // [T_pad, Hq + Hk + Hv, D]; token stride qkv_stride,
                                          // head stride qkv_head_stride (elements)
    const u8* __restrict__ cos_sin,       // [max_position, rot], elements of kind CS
    const u8* __restrict__ q_weight,      // [D] of kind WQ (unused for QKN_NO_WEIGHT)
    const u8* __restrict__ k_weight,      // [D] of kind WK
    i64 num_rot,
    // the fixed arguments (KVWRITE_FIXED_ARGS above)
    i64 qkv_stride, i64 qkv_head_stride, i64 max_position, i64 num_q_heads, i64 units_per_token,
    i64 head_size, i64 rot, i64 eps_bits, i64 offset_bits, i64 add_offset) {
  KVW_PDL_ENTRY();
  KVW_QKN_FIXED_PROLOGUE()
  using LY = QknLayout<E, L, SEG>;
  constexpr int IB = elem_bytes(IN);
  const u64 thread = static_cast<u64>(blockIdx.x) * CTA + threadIdx.x;
  const u64 grp = thread / L;
  const u64 t = grp / static_cast<u64>(units_per_token);
  if (t >= static_cast<u64>(num_rot)) return;  // whole groups: every lane of one leaves
  const u32 j = static_cast<u32>(grp - t * static_cast<u64>(units_per_token));
  const u32 i0 = (static_cast<u32>(thread) & (L - 1)) * SEG;
  const bool is_q = j < static_cast<u64>(num_q_heads);
  u8* row = qkv + static_cast<i64>(t) * qkv_stride * IB +
            static_cast<i64>(j) * qkv_head_stride * IB;
  // The row first (volatile: not sunk below the position's test), then the position
  // (load_index: nothing computed from it placed before the row's loads), then the weights
  // (before the position, ptxas placed the position's test before the row's loads in some
  // variants).
  const QknRow<IN, E, V> x = qkn_load_row<IN, LY, V>(row, i0, head_size);
  const i64 pos = static_cast<i64>(load_index(positions + t));
  const auto w = qkn_load_weights<WQ, WK, LY, VW>(q_weight, k_weight, is_q, i0, head_size);
  if (static_cast<u64>(pos) >= static_cast<u64>(max_position)) return;  // also pos < 0
  const u32 half = static_cast<u32>(rot) / 2;
  const auto tb = qkn_load_table<CS, LY, VT, NEOX, PS>(cos_sin + pos * rot * elem_bytes(CS), i0,
                                                       half, static_cast<u32>(rot));
  const float offset = bits_f32(static_cast<u32>(offset_bits));
  float* group = nullptr;
  if constexpr (NEOX && PS == 0) group = qkn_exchange<E, L, CTA>();
  float n[E];
  qkn_norm_rope<IN, CS, LY, V, VT, NEOX, PS, WQ, WK, VW, (MIN_BLOCKS > 1)>(
      x, w, is_q, add_offset != 0, offset, tb, i0, head_size, half, static_cast<u32>(rot),
      bits_f32(static_cast<u32>(eps_bits)), group, qkn_group_mask<L>(), n);
  qkn_store_row<IN, LY, V>(row, qkn_round<IN, E, V>(n), i0, head_size);
}
