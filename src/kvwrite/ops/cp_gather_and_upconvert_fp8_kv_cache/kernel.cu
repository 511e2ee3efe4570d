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
// narrower below. A row is 72 chunks of 16 output bytes: chunk k < 64 dequantizes the 8 codes at
// byte 8k with its tile's scale (a 4-byte load beside them, from the same lines), chunk k >= 64
// copies 16 bytes of the rotary part.
//
// The stores are never narrower than one 16-bit element (DST_ALIGN below): the output is 16-bit,
// so its rows are 2-byte aligned whatever ALIGN (set by the cache, 1 for odd entry strides) says.
// Byte stores of converted halves also met a ptxas bug: NVRTC 13.0 compiled the low byte of a
// chunk's last element (cvt.rn.f16.f32, then st.global.u8 of its low byte) as
// F2I.U8.F16.TRUNC.NTZ, the element's value as a saturated integer instead of its bits
// (tests/test_gather_cuda.py checks that no upconvert variant stores single bytes).
#include "kvw/gather.cuh"

#ifndef KVWRITE_HOST_TEST

template <int OUT, int ALIGN>
struct UpconvertOp {
  // The output's accesses: at least one 16-bit element wide (dst rows are 2-byte aligned).
  static constexpr int DST_ALIGN = ALIGN < 2 ? 2 : ALIGN;
  struct Chunk {
    Raw<16> raw;
    float s;
  };
  const u8* src;
  u8* dst;
  i64 cbs, cps, drs;

  KVW_HD u32 chunks() const { return 72u; }

  KVW_HD Chunk load(i64 blk, u32 off, u32 k) const {
    const u8* e = src + blk * cbs + static_cast<i64>(off) * cps;
    Chunk c;
    c.s = 0.0f;
    if (k < 64u) {
      const Raw<8> codes = gather_load<8, (ALIGN < 8 ? ALIGN : 8)>(e + 8u * k);
      c.raw.w[0] = codes.w[0];
      c.raw.w[1] = codes.w[1];
      c.raw.w[2] = c.raw.w[3] = 0u;
      c.s = bits_f32(gather_load<4, (ALIGN < 4 ? ALIGN : 4)>(e + 512u + 4u * (k >> 4)).w[0]);
    } else {
      c.raw = gather_load<16, ALIGN>(e + 528u + 16u * (k - 64u));
    }
    return c;
  }

  KVW_HD void store(i64 t, u32 k, const Chunk& c) const {
    u8* p = dst + t * drs + 16u * k;
    if (k < 64u) {
      Raw<8> codes;
      codes.w[0] = c.raw.w[0];
      codes.w[1] = c.raw.w[1];
      gather_store<16, DST_ALIGN>(p, fp8_dequant_chunk<OUT, 8>(codes, c.s, false));
    } else {
      gather_store<16, DST_ALIGN>(p, c.raw);
    }
  }
};

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
  UpconvertOp<OUT, ALIGN> op;
  op.src = src;
  op.dst = dst;
  op.cbs = cache_block_stride;
  op.cps = cache_page_stride;
  op.drs = dst_row_stride;
  gather_cta<4>(KVW_GATHER_ROW_ARGS(starts, seq_starts, block_table, t_out, num_req, smem_rows),
                rpw, op);
}
#endif  // KVWRITE_HOST_TEST
