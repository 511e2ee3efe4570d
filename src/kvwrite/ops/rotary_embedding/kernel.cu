// kvwrite: rotary_embedding (docs/ops/rotary_embedding.md), in place. Compiled at run time with
// NVRTC (cuda_impl.py), one module per instantiation of rotary_embedding_kernel<IN, CS, W, NEOX,
// PosT, LINEAR>.
//
// Work split: a token's work is (Hq + H) heads x units_per_head units (kvw/rope.cuh). A CTA is a
// [blockDim.y tokens, blockDim.x units] grid of threads: several tokens per CTA when a token has
// few units, grid.y CTAs per token when it has many. LINEAR (large calls, one token per CTA): a
// 1-D grid of tokens x parts CTAs, a token's parts adjacent in launch order (cuda_impl.py). Each
// thread loads its token's position, and (for a position inside the table) its chunk(s) and
// table entries, rotates and stores back.
// Pass-through units have nothing to do in place. No loops, no shared memory.
#include "kvw/common.cuh"
#include "kvw/vec_io.cuh"
#include "kvw/rope.cuh"

// In a build specialized for one call signature (-D KVWRITE_FIXED_ARGS=v0,...,v10) the arguments
// from q_stride on are compile-time constants: none is read from the parameter bank and the
// index math (the division by units_per_head included) folds. Dense heads pass head strides equal
// to head_size, so their builds fold to the code of a kernel without head strides.
#define KVW_ROPE_FIXED_PROLOGUE() KVW_ASSIGN_FIXED_ARGS(q_stride, k_stride, max_position,       \
    num_q_heads, head_size, rot, units_per_head, rot_units, units_per_token, q_head_stride,     \
    k_head_stride)

template <int IN, int CS, int W, bool NEOX, typename PosT, bool LINEAR>
__global__ void __launch_bounds__(256) rotary_embedding_kernel(
    const PosT* __restrict__ positions,  // [T_rot]
    u8* query,                 // [T_pad, Hq, D]; token, head strides q_stride, q_head_stride
    u8* key,                   // [T_pad, H, D]; k_stride, k_head_stride (unused when H == 0)
    const u8* __restrict__ cos_sin,  // [max_position, rot]: cos | sin, elements of kind CS
    i64 num_rot, i64 q_stride, i64 k_stride, i64 max_position,
    i64 num_q_heads, i64 head_size, i64 rot, i64 units_per_head, i64 rot_units,
    i64 units_per_token, i64 q_head_stride, i64 k_head_stride) {
  KVW_PDL_ENTRY();
  KVW_ROPE_FIXED_PROLOGUE()
  constexpr int IB = elem_bytes(IN);
  i64 t;
  u32 c;
  if constexpr (LINEAR) {  // blockIdx.x = token * parts + part, blockDim.y = 1
    const u32 parts = (static_cast<u32>(units_per_token) + blockDim.x - 1) / blockDim.x;
    const u32 tok = blockIdx.x / parts;
    t = tok;
    c = (blockIdx.x - tok * parts) * blockDim.x + threadIdx.x;
  } else {
    t = static_cast<i64>(blockIdx.x) * blockDim.y + threadIdx.y;
    c = blockIdx.y * blockDim.x + threadIdx.x;
  }
  if (t >= num_rot || c >= static_cast<u64>(units_per_token)) return;
  const i64 p = static_cast<i64>(positions[t]);
  const u32 j = c / static_cast<u32>(units_per_head);
  const u32 u = c - j * static_cast<u32>(units_per_head);
  u32 oa, ob;
  const u32 half = static_cast<u32>(rot) / 2;
  if (!rope_unit_offsets<W, NEOX>(u, rot_units, half, rot, oa, ob)) return;
  const bool is_q = j < static_cast<u64>(num_q_heads);
  const i64 h = is_q ? j : j - num_q_heads;
  const i64 head_stride = is_q ? q_head_stride : k_head_stride;
  u8* row = (is_q ? query + t * q_stride * IB : key + t * k_stride * IB) + h * head_stride * IB;
  // Loaded before the position's test (volatile: ptxas may not sink them below it), so the
  // data's memory round trip overlaps the position's.
  Raw<W * IB> a = load_raw_volatile<W * IB>(row + static_cast<i64>(oa) * IB), b = a;
  if constexpr (NEOX) b = load_raw_volatile<W * IB>(row + static_cast<i64>(ob) * IB);
  if (static_cast<u64>(p) >= static_cast<u64>(max_position)) return;  // also p < 0
  rope_rotate_unit<IN, CS, W, NEOX>(a, b, cos_sin + p * rot * elem_bytes(CS), half, oa);
  store_raw<W * IB>(row + static_cast<i64>(oa) * IB, a);
  if constexpr (NEOX) store_raw<W * IB>(row + static_cast<i64>(ob) * IB, b);
}
