// kvwrite: cp_gather_and_upconvert_fp8_kv_cache (docs/ops/gather.md): gather fp8_ds_mla cache
// entries (656 bytes: bytes [0, 512) e4m3 codes in 4 tiles of 128, [512, 528) the tiles' float32
// scales, [528, 656) 64 16-bit rotary values) into rows dst[t] of 576 16-bit values.
//
// Compiled at run time with NVRTC (see cuda_impl.py): one module per instantiation and, by default,
// per call signature, with the fixed arguments compiled in (KVWRITE_FIXED_ARGS). The row rule is
// kvw/gather.cuh's (the starts are workspace_starts: the last request ends at T_out), the fp8 read
// rule kvw/fp8_read.cuh's.
//
// cp_gather_and_upconvert_fp8_kv_cache_kernel<OUT, ALIGN>: OUT DT_BF16 or DT_F16; ALIGN (16, 8, 4,
// 2 or 1) the alignment in bytes of every entry and row start: accesses are 16 bytes wide at 16,
// narrower below. A warp's rows go through in rounds of KVW_UPCONVERT_ROWS rows, each row spread
// over the warp the same way: lane L dequantizes the 16 codes at bytes [16L, 16L + 16) with the
// scale of tile L / 8 (a 4-byte load of the same 32-byte sector for 8 lanes) into output bytes
// [32L, 32L + 32) (two 16-byte stores), and lanes 0-7 copy the rotary part's 16 bytes at 528 +
// 16L to 1024 + 16L. A round's loads (up to 3 per row and lane, 144 bytes per lane at 16) are all
// issued before any of its stores; the lanes find each row's base by one shuffle, with no
// division. The codes are decoded in hardware (fp8x2_dequant: cvt.rn.f16x2.e4m3x2, exact) and
// rounded two at a time (cvt.rn.bf16x2.f32 / f16x2), about 3 instructions per element.
//
// The stores are never narrower than one 16-bit element (DST_ALIGN below): the output is 16-bit,
// so its rows are 2-byte aligned whatever ALIGN (set by the cache, 1 for odd entry strides) says.
// Byte stores of converted halves also met a ptxas bug: NVRTC 13.0 compiled the low byte of a
// chunk's last element (cvt.rn.f16.f32, then st.global.u8 of its low byte) as
// F2I.U8.F16.TRUNC.NTZ, the element's value as a saturated integer instead of its bits
// (tests/test_gather_cuda.py checks that no upconvert variant stores single bytes).
#include "kvw/gather.cuh"

#if !defined(KVWRITE_HOST_TEST) || defined(KVWRITE_EMU)

// Rows per round of a warp (kvwrite.kernels.gather_cuda.UPCONVERT_ROWS must say the same).
#ifndef KVW_UPCONVERT_ROWS
#define KVW_UPCONVERT_ROWS 4
#endif

// In a build specialized for one call signature (-D KVWRITE_FIXED_ARGS=v0,...,v11) the row rule's
// 9 arguments and the cache and row strides are compile-time constants.
#ifdef KVWRITE_FIXED_ARGS
#define KVW_UPCONVERT_FIXED_PROLOGUE()                  \
  {                                                     \
    KVW_FIXED_ARGS_ARRAY(12); /* row rule 9 + 3 */    \
    KVW_GATHER_ROW_ASSIGN()                             \
    cache_block_stride = fixed[KVW_GATHER_ROW_FIXED];   \
    cache_page_stride = fixed[KVW_GATHER_ROW_FIXED + 1]; \
    dst_row_stride = fixed[KVW_GATHER_ROW_FIXED + 2];   \
  }
#else
#define KVW_UPCONVERT_FIXED_PROLOGUE()
#endif

template <int OUT, int ALIGN>
__global__ void __launch_bounds__(KVW_GATHER_THREADS) cp_gather_and_upconvert_fp8_kv_cache_kernel(
    const u8* src,          // [num_blocks, block_size, 656] via strides (bytes)
    u8* dst,                // [T_out, 576] 16-bit, row stride dst_row_stride (bytes)
    const u8* starts,       // workspace_starts [>= B]
    const u8* seq_starts,   // [>= B] or null
    const u8* block_table,  // [>= B, max_blocks]
    i64 t_out, i64 num_req, i64 smem_rows, i64 rpw, KVW_GATHER_ROW_PARAMS,
    i64 cache_block_stride, i64 cache_page_stride, i64 dst_row_stride) {
  KVW_PDL_ENTRY();
  KVW_UPCONVERT_FIXED_PROLOGUE()
  constexpr int R = KVW_UPCONVERT_ROWS;
  constexpr int A4 = ALIGN < 4 ? ALIGN : 4;
  // The output's accesses: at least one 16-bit element wide (dst rows are 2-byte aligned).
  constexpr int DST_ALIGN = ALIGN < 2 ? 2 : ALIGN;
  i64 t_first;
  int rows;
  const GatherRow row = gather_rows(
      KVW_GATHER_ROW_ARGS(starts, seq_starts, block_table, t_out, num_req, smem_rows), rpw,
      t_first, rows);
  if (rows == 0) return;
  const bool narrow =
      gather_narrow(num_blocks, cache_block_stride, block_size, cache_page_stride);
  const i64 base = row.block >= 0 ? row.block * cache_block_stride +
                                        static_cast<i64>(row.offset) * cache_page_stride
                                  : -1;
  const u32 lane = threadIdx.x & 31u;
  const bool pe_lane = lane < 8u;
  const u8* src_lane = src + 16u * lane;
  const u8* scale_lane = src + 512u + 4u * (lane >> 3);
  const u8* pe_src_lane = src + 528u + 16u * (lane & 7u);
  KVW_GATHER_KEEP(t_first);
#pragma unroll 1
  for (int r0 = 0; r0 < rows; r0 += R) {
    i64 b[R];
#pragma unroll
    for (int i = 0; i < R; ++i) b[i] = gather_shfl_base(base, (r0 + i) & 31, narrow);
    Raw<16> codes[R], pe[R];
    float s[R];
    bool live[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      live[i] = r0 + i < rows && b[i] >= 0;
      codes[i] = gather_load_if<16, ALIGN>(src_lane + b[i], live[i]);
      s[i] = bits_f32(gather_load_if<4, A4>(scale_lane + b[i], live[i]).w[0]);
      pe[i] = gather_load_if<16, ALIGN>(pe_src_lane + b[i], live[i] && pe_lane);
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (!live[i]) continue;
      u8* out = dst + (t_first + r0 + i) * dst_row_stride;
      Raw<16> lo, hi;
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        float a, c;
        fp8x2_dequant(codes[i].w[w] & 0xFFFFu, s[i], false, a, c);
        float e, f;
        fp8x2_dequant(codes[i].w[w] >> 16, s[i], false, e, f);
        const u32 p0 = f16ish_x2_from_f32<OUT>(a, c);
        const u32 p1 = f16ish_x2_from_f32<OUT>(e, f);
        if (w < 2) {
          lo.w[2 * w] = p0;
          lo.w[2 * w + 1] = p1;
        } else {
          hi.w[2 * w - 4] = p0;
          hi.w[2 * w - 3] = p1;
        }
      }
      store_aligned<16, DST_ALIGN>(out + 32u * lane, lo);
      store_aligned<16, DST_ALIGN>(out + 32u * lane + 16u, hi);
      if (pe_lane) store_aligned<16, DST_ALIGN>(out + 1024u + 16u * lane, pe[i]);
    }
  }
}
#endif  // !KVWRITE_HOST_TEST || KVWRITE_EMU
