// The gather of whole cache entries, copied as bytes or dequantized by the fp8 read rule: the
// kernel of gather_and_maybe_dequant_cache, cp_gather_cache and gather_cache_flash (each op's
// kernel.cu names its own instance with KVW_DEFINE_GATHER_ENTRY_KERNEL). Device code only.
//
// An entry (the cache's [block, offset] element) is up to 3 outer dims over an inner run of
// elements contiguous in the cache and in the output; one or two tensors (a key and a value cache
// with the same strides, each with its own output). A row is `chunks` chunks of VB input bytes:
// tensor, outer indices i2, i1, i0 and the chunk of the run, innermost last. All strides are in
// bytes. gather_cache_flash: outer dim 0 = heads, run = head size, two tensors, each one's scale
// per head (bit kv of `per_head`: scale[i0]) or per tensor; gather_and_maybe_dequant_cache: no
// outer dims, the run = the entry; cp_gather_cache: whatever its entry's dims coalesce to.
//
// CONV: DT_COPY (the bits, any element type: VB bytes per chunk) or DT_E4M3 (fp8: VB codes per
// chunk -> VB elements of OUT, DT_F16 / DT_BF16 / DT_F32, by fp8_dequant_chunk; e5m2 codes where
// the fixed argument fp8_e5m2 is set). NDIM: the outer dims the variant decomposes (0 to 3; the
// others have size 1).
#pragma once
#include "kvw/gather.cuh"

#if !defined(KVWRITE_HOST_TEST) || defined(KVWRITE_EMU)

#define KVW_ENTRY_PARAMS                                                                      \
  i64 cache_block_stride, i64 cache_page_stride, i64 dst_row_stride0, i64 dst_row_stride1,  \
      i64 run_chunks, i64 n0, i64 n1, i64 src_s0, i64 src_s1, i64 src_s2, i64 dst0_s0,      \
      i64 dst0_s1, i64 dst0_s2, i64 dst1_s0, i64 dst1_s1, i64 dst1_s2, i64 tensor_chunks,   \
      i64 num_tensors, i64 per_head, i64 fp8_e5m2
#define KVW_ENTRY_FIXED 20
static_assert(KVW_GATHER_ROW_FIXED + KVW_ENTRY_FIXED == 29, "the entry kernel's fixed arguments");
#define KVW_ENTRY_ASSIGN(o)                                                                 \
  cache_block_stride = fixed[o]; cache_page_stride = fixed[o + 1];                          \
  dst_row_stride0 = fixed[o + 2]; dst_row_stride1 = fixed[o + 3];                           \
  run_chunks = fixed[o + 4]; n0 = fixed[o + 5]; n1 = fixed[o + 6];                          \
  src_s0 = fixed[o + 7]; src_s1 = fixed[o + 8]; src_s2 = fixed[o + 9];                      \
  dst0_s0 = fixed[o + 10]; dst0_s1 = fixed[o + 11]; dst0_s2 = fixed[o + 12];                \
  dst1_s0 = fixed[o + 13]; dst1_s1 = fixed[o + 14]; dst1_s2 = fixed[o + 15];                \
  tensor_chunks = fixed[o + 16]; num_tensors = fixed[o + 17]; per_head = fixed[o + 18];      \
  fp8_e5m2 = fixed[o + 19];

// Chunks whose loads a lane issues before their stores (gather_warp_chunks' round). The launcher
// gives each warp the rows one round covers (kvwrite.kernels.gather_cuda.ENTRY_UNROLL must say
// the same): 9 chunks of 16 bytes per lane take four 1152-byte MLA rows per warp (72 chunks each)
// in one round, one 4096-byte K+V row of gather_cache_flash (H=8, D=128, bfloat16: 256 chunks)
// in 8 of them. Each lane then waits for memory once, with up to 144 bytes in flight.
#ifndef KVW_ENTRY_UNROLL
#define KVW_ENTRY_UNROLL 9
#endif

template <int CONV, int OUT, int VB, int NDIM>
struct GatherEntryOp {
  static constexpr bool FP8 = CONV == DT_E4M3;
  static constexpr int OB = FP8 ? VB * elem_bytes(OUT) : VB;  // output bytes per chunk
  struct Chunk {
    Raw<VB> raw;
    float s;  // fp8 per-head scales: the chunk's head's
  };
  const u8* src[2];
  u8* dst[2];
  const float* scale[2];
  float scale_v[2];  // per-tensor scales, loaded once
  i64 cbs, cps, drs[2];
  u32 run_chunks, n0, n1, tensor_chunks, num_tensors;
  i64 ss[3], ds[2][3];
  u32 per_head;  // bit kv: tensor kv's scale is per head (scale[i0]), else per tensor
  bool e5m2;     // fp8 codes are e5m2 (else e4m3)
  bool narrow;   // every row base (block * cbs + offset * cps) is below 2^31

  KVW_HD u32 chunks() const { return tensor_chunks * num_tensors; }
  KVW_HD i64 row_base(i64 blk, u32 off) const { return blk * cbs + static_cast<i64>(off) * cps; }

  // Chunk k of a row: its tensor, outer indices and run chunk (only the dims this variant has,
  // NDIM, so that a row's chunks cost no division where the entry has no outer dims).
  struct Where {
    u32 kv, i0, i1, i2, cr;
  };
  KVW_HD Where where(u32 k) const {
    Where w;
    w.kv = num_tensors > 1 && k >= tensor_chunks ? 1u : 0u;
    u32 rem = k - w.kv * tensor_chunks;
    w.cr = rem;
    w.i0 = w.i1 = w.i2 = 0;
    if constexpr (NDIM >= 1) {
      w.cr = rem % run_chunks;
      rem /= run_chunks;
      w.i0 = rem;
    }
    if constexpr (NDIM >= 2) {
      w.i0 = rem % n0;
      w.i1 = rem / n0;
    }
    if constexpr (NDIM >= 3) {
      w.i1 = (rem / n0) % n1;
      w.i2 = rem / n0 / n1;
    }
    return w;
  }

  // Chunk k of the row at `base` (k < chunks()), loaded where `live`.
  KVW_HD Chunk load(i64 base, u32 k, bool live) const {
    const Where w = where(k);
    const bool v = w.kv != 0;  // selects, not indexing: the op stays in registers
    const i64 so = base + w.i0 * ss[0] + w.i1 * ss[1] + w.i2 * ss[2] +
                   static_cast<i64>(w.cr) * VB;
    Chunk c;
    c.raw = load_raw_if<VB>((v ? src[1] : src[0]) + so, live);
    c.s = 0.0f;
    if constexpr (FP8) {
      if ((per_head >> w.kv) & 1u) {
        c.s = bits_f32(load_raw_if<4>(
            reinterpret_cast<const u8*>((v ? scale[1] : scale[0]) + w.i0), live).w[0]);
      }
    }
    return c;
  }

  // Into output row t_first + j (t_first * drs is the same for every chunk of the warp).
  KVW_HD void store(i64 t_first, u32 j, u32 k, const Chunk& c) const {
    const Where w = where(k);
    const bool v = w.kv != 0;
    const i64 rs = v ? drs[1] : drs[0];
    u8* p = (v ? dst[1] : dst[0]) + t_first * rs + static_cast<i64>(j) * rs +
            w.i0 * (v ? ds[1][0] : ds[0][0]) + w.i1 * (v ? ds[1][1] : ds[0][1]) +
            w.i2 * (v ? ds[1][2] : ds[0][2]) + static_cast<i64>(w.cr) * OB;
    if constexpr (FP8) {
      const float s = (per_head >> w.kv) & 1u ? c.s : (v ? scale_v[1] : scale_v[0]);
      store_raw<OB>(p, fp8_dequant_chunk<OUT, VB>(c.raw, s, e5m2));
    } else {
      store_raw<VB>(p, c.raw);
    }
  }
};

// The gather kernel `name`<CONV, OUT, VB, NDIM>: pointers, the per-call scalars (T_out, B, whether the
// starts go to shared memory, rows per warp), then the fixed arguments: the row rule's 9 and the
// entry geometry's 20 (compiled in by a specialized build: -D KVWRITE_FIXED_ARGS=v0,...,v28).
#ifdef KVWRITE_FIXED_ARGS
#define KVW_ENTRY_FIXED_PROLOGUE()                                   \
  {                                                                  \
    KVW_FIXED_ARGS_ARRAY(29); /* KVW_GATHER_ROW_FIXED + KVW_ENTRY_FIXED */ \
    KVW_GATHER_ROW_ASSIGN()                                          \
    KVW_ENTRY_ASSIGN(KVW_GATHER_ROW_FIXED)                           \
  }
#else
#define KVW_ENTRY_FIXED_PROLOGUE()
#endif

#define KVW_DEFINE_GATHER_ENTRY_KERNEL(name)                                                    \
  template <int CONV, int OUT, int VB, int NDIM>                                                \
  __global__ void __launch_bounds__(KVW_GATHER_THREADS) name(                                    \
      const u8* src0,        /* key (or only) cache, entries via strides */        \
      const u8* src1,        /* value cache (two tensors), else null */            \
      u8* dst0,              /* [T_out, entry] output of tensor 0 */               \
      u8* dst1,              /* output of tensor 1, else null */                   \
      const float* scale0,   /* fp8: [1] or [H] float32, else null */              \
      const float* scale1,                                                         \
      const u8* starts,      /* cu_seq_lens [B + 1] */                             \
      const u8* seq_starts,  /* [>= B] or null */                                  \
      const u8* block_table, /* [>= B, max_blocks] */                              \
      i64 t_out, i64 num_req, i64 smem_rows, i64 rpw, KVW_GATHER_ROW_PARAMS,                    \
      KVW_ENTRY_PARAMS) {                                                                       \
    KVW_PDL_ENTRY();                                                                            \
    KVW_ENTRY_FIXED_PROLOGUE()                                                                  \
    GatherEntryOp<CONV, OUT, VB, NDIM> op;                                                            \
    op.src[0] = src0; op.src[1] = src1; op.dst[0] = dst0; op.dst[1] = dst1;                     \
    op.scale[0] = scale0; op.scale[1] = scale1;                                                 \
    op.scale_v[0] = op.scale_v[1] = 0.0f;                                                       \
    if constexpr (GatherEntryOp<CONV, OUT, VB, NDIM>::FP8) {                                          \
      if (!(per_head & 1)) op.scale_v[0] = scale0[0];                                           \
      if (num_tensors > 1 && !(per_head & 2)) op.scale_v[1] = scale1[0];                        \
    }                                                                                           \
    op.cbs = cache_block_stride; op.cps = cache_page_stride;                                    \
    op.drs[0] = dst_row_stride0; op.drs[1] = dst_row_stride1;                                   \
    op.run_chunks = static_cast<u32>(run_chunks); op.n0 = static_cast<u32>(n0);                 \
    op.n1 = static_cast<u32>(n1); op.tensor_chunks = static_cast<u32>(tensor_chunks);           \
    op.num_tensors = static_cast<u32>(num_tensors);                                             \
    op.ss[0] = src_s0; op.ss[1] = src_s1; op.ss[2] = src_s2;                                    \
    op.ds[0][0] = dst0_s0; op.ds[0][1] = dst0_s1; op.ds[0][2] = dst0_s2;                        \
    op.ds[1][0] = dst1_s0; op.ds[1][1] = dst1_s1; op.ds[1][2] = dst1_s2;                        \
    op.per_head = static_cast<u32>(per_head);                                                   \
    op.e5m2 = fp8_e5m2 != 0;                                                                    \
    op.narrow = gather_narrow(num_blocks, cache_block_stride, block_size, cache_page_stride);    \
    gather_cta<KVW_ENTRY_UNROLL>(                                                               \
        KVW_GATHER_ROW_ARGS(starts, seq_starts, block_table, t_out, num_req, smem_rows), rpw,   \
        op);                                                                                    \
  }

#endif  // !KVWRITE_HOST_TEST || KVWRITE_EMU
