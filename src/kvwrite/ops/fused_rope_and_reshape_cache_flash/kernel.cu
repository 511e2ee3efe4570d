// kvwrite: fused_rope_and_reshape_cache_flash (docs/ops/fused_rope_and_reshape_cache_flash.md):
// RoPE on query and key and the cache write in one launch. Compiled at run time with NVRTC
// (cuda_impl.py), one module per instantiation of fused_rope_cache_kernel<IN, CS, OUT, W, NEOX,
// PosT, SlotT, MIN_BLOCKS>.
//
// Work split as rotary_embedding's kernel: a token's work is (Hq + H) heads x units_per_head
// units (kvw/rope.cuh); one thread per (token, head, unit), [tokens, units] CTAs. A query thread
// rotates its unit and stores it to query_out (query itself when in place; a pass-through unit is
// copied only when query_out is another tensor). A key thread loads its key and value chunks
// together, rotates the key, stores it back (store_key), and for t < num_tokens with a slot in
// [0, num_slots) stores Q(rotated key) and Q(value) into the caches (kvw/vec_io.cuh's
// convert_chunk: copies, casts, fp8 by the fp8 rule with scales read on the device). A token whose
// position is outside the table is not touched at all. The large-call build converts the value
// before it rotates the key (VALUE_FIRST below) and stores it then, or with the key's chunks where
// a head's cache row is 128 bytes (value_after below); the small-call build converts it while the
// table's entries are in flight and stores it after the key's chunks.
#include "kvw/common.cuh"
#include "kvw/fp8.cuh"
#include "kvw/vec_io.cuh"
#include "kvw/slot.cuh"
#include "kvw/rope.cuh"

// In a build specialized for one call signature (-D KVWRITE_FIXED_ARGS=v0,...,v22) the arguments
// from q_stride on are compile-time constants: none is read from the parameter bank and the
// index math (the division by units_per_head, the slot's block split) folds. Dense heads pass
// head strides equal to head_size, so their builds fold to the code of a kernel without them.
#define KVW_FUSED_FIXED_PROLOGUE() KVW_ASSIGN_FIXED_ARGS(q_stride, qo_stride, k_stride,         \
    v_stride, max_position, block_stride, page_stride, head_stride, block_size, block_shift,    \
    num_slots, num_q_heads, head_size, rot, units_per_head, rot_units, units_per_token,         \
    store_key, query_in_place, q_head_stride, qo_head_stride, k_head_stride, v_head_stride)

// MIN_BLOCKS: __launch_bounds__'s minimum of resident CTAs (of at most 256 threads) per SM, 1 (the
// small-call build) or the large-call build's (cuda_impl.CudaTuning). Unbounded, a key thread
// holds its key and value chunks and the table's entries at once (57-62 registers).
template <int IN, int CS, int OUT, int W, bool NEOX, typename PosT, typename SlotT, int MIN_BLOCKS>
__global__ void __launch_bounds__(256, MIN_BLOCKS) fused_rope_cache_kernel(
    const PosT* __restrict__ positions,   // [T_rot]
    // Rows: token stride x_stride, head stride x_head_stride (elements), unit-stride last dim.
    u8* query,                            // [T_pad, Hq, D]; q_stride, q_head_stride
    u8* query_out,                        // [T_pad, Hq, D]; qo_stride, ... (may be query)
    u8* key,                              // [T_pad, H, D]; k_stride, k_head_stride
    const u8* __restrict__ value,         // [T_pad, H, D]; v_stride, v_head_stride
    const u8* __restrict__ cos_sin,       // [max_position, rot], elements of kind CS
    u8* __restrict__ key_cache,           // [num_blocks, block_size, H, D] via strides
    u8* __restrict__ value_cache,         // same strides as key_cache
    const SlotT* __restrict__ slot_mapping,  // [num_tokens]
    const float* __restrict__ k_scale,    // [1] or [H] (fp8 only)
    const float* __restrict__ v_scale,
    i64 num_rot, i64 num_tokens, i64 k_scale_stride, i64 v_scale_stride,
    // the fixed arguments (KVWRITE_FIXED_ARGS below)
    i64 q_stride, i64 qo_stride, i64 k_stride, i64 v_stride, i64 max_position,
    i64 block_stride, i64 page_stride, i64 head_stride, i64 block_size, i64 block_shift,
    i64 num_slots, i64 num_q_heads, i64 head_size, i64 rot, i64 units_per_head, i64 rot_units,
    i64 units_per_token, i64 store_key, i64 query_in_place, i64 q_head_stride,
    i64 qo_head_stride, i64 k_head_stride, i64 v_head_stride) {
  KVW_PDL_ENTRY();
  KVW_FUSED_FIXED_PROLOGUE()
  constexpr int IB = elem_bytes(IN);
  constexpr int OB = OUT == DT_COPY ? IB : elem_bytes(OUT);
  constexpr bool FP8 = OUT == DT_E4M3 || OUT == DT_E5M2;
  // VALUE_FIRST (the large-call build): a key thread converts its value chunks (and stores them,
  // unless value_after below) before it requests the table's entries, so it never holds the
  // value's input and the table's entries at once (48 registers under the bound, none spilled,
  // against 8-16 bytes spilled the other way); H200, T=16384: fp8 GQA 112.5 -> 108.2 us, MHA
  // 228.2 -> 214.7, auto 0.8-1.5% less. Small calls request the table first: its round trip is
  // on their latency path, and value-first cost them 0.04-0.05 us at T=16 (tuning-log change 35).
  constexpr bool VALUE_FIRST = MIN_BLOCKS > 1;
  // value_after: the value's chunks are stored right after the key's, in the small-call build
  // and in the large-call one where a head's cache row is 128 bytes (fp8 with D=128, 16-bit with
  // D=64), whose converted value chunks wait in registers for it. Then K and V of a (slot, head),
  // adjacent 128-byte lines in the packed layout, are written together, not a table round trip
  // apart. Measured, H200, T=4096 / 16384, rotated L2 (tuning-log change 53):
  // fp8 (32,32,128) packed 88.5 -> 91.7% / 90.1 -> 93.3% of the copy bandwidth, (32,8,128) packed
  // 89.4 -> 91.1% / 92.8 -> 94.5%, NHD and HND 0.1-0.3 points more; bfloat16 (32,8,64) packed
  // 86.8 -> 88.7% / 91.5 -> 93.8%. Other rows lost with it: bfloat16 D=128 0.3-0.7 points, fp8
  // D=64 0.5-1.7.
  const bool value_after = !VALUE_FIRST || head_size * OB == 128;
  const i64 t = static_cast<i64>(blockIdx.x) * blockDim.y + threadIdx.y;
  const u32 c = blockIdx.y * blockDim.x + threadIdx.x;
  if (t >= num_rot || c >= static_cast<u64>(units_per_token)) return;
  const u32 j = c / static_cast<u32>(units_per_head);
  const u32 u = c - j * static_cast<u32>(units_per_head);
  const u32 half = static_cast<u32>(rot) / 2;
  u32 oa, ob;
  const bool rotated = rope_unit_offsets<W, NEOX>(u, rot_units, half, rot, oa, ob);
  const i64 ea = static_cast<i64>(oa) * IB, eb = static_cast<i64>(ob) * IB;
  // Each path loads the position (and the key path the slot) after its row's loads (load_index).
  // Loaded first, as a plain load, the position fed the table's address, code common to both
  // paths that ptxas placed before the row's loads and so waited for the position's round trip
  // there: a small call's chain was position -> row -> table -> store, not position -> table ->
  // store with the row alongside (H200, GQA(32,8,128) T=1, rotated L2: 1.86 -> 1.49 us; tuning-log
  // change 52).
  const auto table_row = [&](i64 pos) { return cos_sin + pos * rot * elem_bytes(CS); };
  const auto in_table = [&](i64 pos) {  // also pos < 0
    return static_cast<u64>(pos) < static_cast<u64>(max_position);
  };

  if (j < static_cast<u64>(num_q_heads)) {
    if (!rotated && query_in_place) return;
    const i64 h_off = static_cast<i64>(j) * q_head_stride * IB;
    // query_out's head offset is query's where their head strides agree (in place, always): a
    // build for such strides computes one offset, and dense heads the code they had before head
    // strides were arguments (recomputed, the same product changed the SASS).
    const i64 out_off =
        qo_head_stride == q_head_stride ? h_off : static_cast<i64>(j) * qo_head_stride * IB;
    const u8* row = query + t * q_stride * IB + h_off;
    u8* out = query_out + t * qo_stride * IB + out_off;
    // Loaded before the position's test (volatile: ptxas may not sink them below it), so the
    // data's memory round trip overlaps the position's.
    Raw<W * IB> a = load_raw_volatile<W * IB>(row + ea), b{};
    if constexpr (NEOX) b = load_raw_volatile<W * IB>(row + eb);
    const i64 pos = static_cast<i64>(load_index(positions + t));
    if (!in_table(pos)) return;
    if (rotated) rope_rotate_unit<IN, CS, W, NEOX>(a, b, table_row(pos), half, oa);
    store_raw<W * IB>(out + ea, a);
    if constexpr (NEOX) {
      if (rotated) store_raw<W * IB>(out + eb, b);
    }
    return;
  }

  const i64 h = static_cast<i64>(j) - num_q_heads;
  const bool cached = t < num_tokens;
  float k_s = 0.0f, v_s = 0.0f;
  if constexpr (FP8) {
    if constexpr (VALUE_FIRST) {
      k_s = k_scale[h * k_scale_stride];
      v_s = v_scale[h * v_scale_stride];
    } else {
      // The small-call build uses the scales only after the rotation. With plain loads ptxas
      // may sink them to that use, a memory round trip after the table's: it did in the build
      // with the fixed arguments compiled in (GQA(32,8,128) fp8 T=1, hot, 1.62 -> 1.66 us
      // instead of faster; tuning-log change 48). load_scale keeps them here.
      k_s = load_scale(k_scale + h * k_scale_stride);
      v_s = load_scale(v_scale + h * v_scale_stride);
    }
  }
  u8* krow = key + t * k_stride * IB + h * k_head_stride * IB;
  const u8* vrow = value + t * v_stride * IB + h * v_head_stride * IB;
  // Key and value chunks loaded before the position's and slot's tests (volatile, as above);
  // rows t < num_rot of key and value exist, whatever the slot. The value chunks start as zeros,
  // not copies of the key's: a copy made ptxas wait for the key's round trip before issuing the
  // value's loads (tuning-log change 52).
  Raw<W * IB> a = load_raw_volatile<W * IB>(krow + ea), b{}, va{}, vb{};
  if constexpr (NEOX) b = load_raw_volatile<W * IB>(krow + eb);
  if (cached) {
    va = load_raw_volatile<W * IB>(vrow + ea);
    if constexpr (NEOX) vb = load_raw_volatile<W * IB>(vrow + eb);
  }
  const i64 pos = static_cast<i64>(load_index(positions + t));
  const i64 s = cached ? static_cast<i64>(load_index(slot_mapping + t)) : -1;
  if (!in_table(pos)) return;
  const bool valid = static_cast<u64>(s) < static_cast<u64>(num_slots);  // also s < 0
  if (!rotated && !valid) return;  // a pass-through unit only feeds the cache
  // The byte offsets of the unit's chunk(s) in either cache (valid slots only) and the fp8
  // scales, made ready before the first cache store.
  i64 ca = 0, cb = 0;
  Fp8Scale ks{}, vs{};
  const auto prepare_stores = [&]() {
    const i64 off = (slot_offset(s, block_stride, page_stride, block_size, block_shift,
                                 (static_cast<u64>(num_slots) >> 32) == 0) +
                     h * head_stride) * OB;
    ca = off + static_cast<i64>(oa) * OB;
    cb = off + static_cast<i64>(ob) * OB;
    if constexpr (FP8) {
      ks = make_fp8_scale<true>(k_s);
      vs = make_fp8_scale<true>(v_s);
    }
  };
  // One chunk converted to the cache's kind, and stored into one cache at byte offset c.
  const auto converted = [&](const Raw<W * IB>& x, const Fp8Scale& sc) -> Raw<W * OB> {
    if constexpr (OUT == DT_COPY) {
      return x;
    } else {
      return convert_chunk<IN, OUT, W>(x, sc);
    }
  };
  const auto to_cache = [&](u8* cache, i64 c, const Raw<W * IB>& x, const Fp8Scale& sc) {
    store_raw<W * OB>(cache + c, converted(x, sc));
  };
  Raw<W * OB> cva{}, cvb{};  // the value's converted chunks
  const auto convert_value = [&]() {
    cva = converted(va, vs);
    if constexpr (NEOX) {
      if (rotated) cvb = converted(vb, vs);
    }
  };
  if constexpr (VALUE_FIRST) {
    if (valid) {
      prepare_stores();
      convert_value();
      if (!value_after) {
        store_raw<W * OB>(value_cache + ca, cva);
        if constexpr (NEOX) {
          if (rotated) store_raw<W * OB>(value_cache + cb, cvb);
        }
      }
    }
  }
  if (rotated) {
    if constexpr (VALUE_FIRST) {
      rope_rotate_unit<IN, CS, W, NEOX>(a, b, table_row(pos), half, oa);
    } else {
      // A small call requests the table's entries, then computes the stores' offsets and the
      // fp8 scales' constants and converts the value while they are in flight, all of which it
      // did after the rotation, on its latency path (the value is stored after the key's chunks
      // as before). Measured, H200, GQA(32,8,128) bfloat16 NHD, rotated L2 (tuning-log change
      // 54): fp8 T=1 1.63 -> 1.58 us, T=16 1.83 -> 1.79, T=256 4.00 -> 3.26; hot T=16 1.27 ->
      // 1.23; MHA fp8 T=1 1.66 -> 1.61; copies unchanged within 0.01-0.05.
      const auto entries = rope_load_entries<CS, W, NEOX>(table_row(pos), half, oa);
      prepare_stores();
      convert_value();
      rope_rotate_entries<IN, CS, W, NEOX>(a, b, entries);
    }
    if (store_key) {
      store_raw<W * IB>(krow + ea, a);
      if constexpr (NEOX) store_raw<W * IB>(krow + eb, b);
    }
  } else if constexpr (!VALUE_FIRST) {
    prepare_stores();
    convert_value();
  }
  if (!valid) return;
  to_cache(key_cache, ca, a, ks);
  if (value_after) store_raw<W * OB>(value_cache + ca, cva);
  if constexpr (NEOX) {
    if (rotated) {
      to_cache(key_cache, cb, b, ks);
      if (value_after) store_raw<W * OB>(value_cache + cb, cvb);
    }
  }
}
