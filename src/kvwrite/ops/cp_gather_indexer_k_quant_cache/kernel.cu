// kvwrite: cp_gather_indexer_k_quant_cache (docs/ops/gather.md): gather the DeepSeek-V3.2
// indexer's key cache into rows dst_k[t] (D code bytes) and dst_scale[t] (G float32 scales, as
// 4G bytes or G floats), bit for bit. Block b's page is the bs * (D + 4G) bytes from
// kv_cache[b, 0, 0]: all codes first (offset o: bytes [o*D, o*D + D)), then all scales (offset o:
// bytes [bs*D + o*4G, + 4G)).
//
// Compiled at run time with NVRTC (see cuda_impl.py): one module per instantiation and, by default,
// per call signature, with the fixed arguments compiled in (KVWRITE_FIXED_ARGS). The row rule is
// kvw/gather.cuh's (no seq_starts, B = block_table.size(0)).
//
// cp_gather_indexer_k_quant_cache_kernel<VK, VS>: a row is D / VK chunks of VK code bytes, then
// 4G / VS chunks of VS scale bytes. Contiguous outputs take the widest chunks that the sizes and
// every page, row and output start allow (16 bytes at most for the codes, 4 for the scales: a
// few bytes a row); dst_k with a non-unit last stride takes one byte per chunk at that stride;
// dst_scale's elements (1 byte, or 4 for float32: scale_shift 0 or 2) lie scale_unit_stride
// bytes apart, and a chunk never spans two of them.
#include "kvw/gather.cuh"

#ifndef KVWRITE_HOST_TEST

template <int VK, int VS>
struct IndexerOp {
  static constexpr int W = VK > VS ? VK : VS;
  struct Chunk {
    Raw<W> raw;
  };
  const u8* src;
  u8* dst_k;
  u8* dst_s;
  i64 cbs, head_dim, scale_bytes, scale_base, krs, kcs, srs, sus;
  u32 kchunks, schunks, sshift;

  KVW_HD u32 chunks() const { return kchunks + schunks; }

  template <int N>
  static KVW_HD void put(Raw<W>& into, const Raw<N>& r) {
#pragma unroll
    for (int i = 0; i < (N >= 4 ? N / 4 : 1); ++i) into.w[i] = r.w[i];
  }
  template <int N>
  static KVW_HD Raw<N> take(const Raw<W>& from) {
    Raw<N> r;
#pragma unroll
    for (int i = 0; i < (N >= 4 ? N / 4 : 1); ++i) r.w[i] = from.w[i];
    return r;
  }

  KVW_HD Chunk load(i64 blk, u32 off, u32 k) const {
    const u8* page = src + blk * cbs;
    Chunk c;
    if (k < kchunks) {
      put<VK>(c.raw, load_raw<VK>(page + static_cast<i64>(off) * head_dim + k * VK));
    } else {
      put<VS>(c.raw, load_raw<VS>(page + scale_base + static_cast<i64>(off) * scale_bytes +
                                  (k - kchunks) * VS));
    }
    return c;
  }

  KVW_HD void store(i64 t, u32 k, const Chunk& c) const {
    if (k < kchunks) {
      store_raw<VK>(dst_k + t * krs + k * kcs, take<VK>(c.raw));
    } else {
      const u32 b = (k - kchunks) * VS;  // byte of the row's scales
      store_raw<VS>(dst_s + t * srs + static_cast<i64>(b >> sshift) * sus +
                        (b & ((1u << sshift) - 1u)),
                    take<VS>(c.raw));
    }
  }
};

// In a build specialized for one call signature (-D KVWRITE_FIXED_ARGS=v0,...,v19) the row rule's
// 9 arguments and the 11 of the layout are compile-time constants.
#ifdef KVWRITE_FIXED_ARGS
#define KVW_INDEXER_FIXED_PROLOGUE()                                                 \
  {                                                                                  \
    KVW_FIXED_ARGS_ARRAY(20); /* row rule 9 + 11 */                                  \
    KVW_GATHER_ROW_ASSIGN()                                                          \
    constexpr int o = KVW_GATHER_ROW_FIXED;                                          \
    cache_block_stride = fixed[o]; head_dim = fixed[o + 1];                          \
    scale_bytes = fixed[o + 2]; scale_base = fixed[o + 3];                           \
    k_row_stride = fixed[o + 4]; k_chunk_stride = fixed[o + 5];                      \
    s_row_stride = fixed[o + 6]; scale_shift = fixed[o + 7];                         \
    scale_unit_stride = fixed[o + 8]; k_chunks = fixed[o + 9]; s_chunks = fixed[o + 10]; \
  }
#else
#define KVW_INDEXER_FIXED_PROLOGUE()
#endif

template <int VK, int VS>
__global__ void __launch_bounds__(KVW_GATHER_THREADS) cp_gather_indexer_k_quant_cache_kernel(
    const u8* kv_cache,     // [num_blocks, bs, D + 4G] bytes, pages dense
    u8* dst_k,              // [T_out, D] bytes via (k_row_stride, k_chunk_stride)
    u8* dst_scale,          // [T_out, 4G] bytes: row stride, elements of 1 or 4 bytes
    const u8* starts,       // cu_seq_lens [>= B + 1]
    const u8* block_table,  // [B, max_blocks]
    i64 t_out, i64 num_req, i64 smem_rows, i64 rpw, KVW_GATHER_ROW_PARAMS,
    i64 cache_block_stride,   // bytes
    i64 head_dim,             // D
    i64 scale_bytes,          // 4G
    i64 scale_base,           // bs * D: the page's scales
    i64 k_row_stride, i64 k_chunk_stride, i64 s_row_stride,  // bytes
    i64 scale_shift,          // log2 of dst_scale's element bytes (0 or 2)
    i64 scale_unit_stride,    // bytes between dst_scale's elements
    i64 k_chunks, i64 s_chunks) {
  KVW_PDL_ENTRY();
  KVW_INDEXER_FIXED_PROLOGUE()
  IndexerOp<VK, VS> op;
  op.src = kv_cache;
  op.dst_k = dst_k;
  op.dst_s = dst_scale;
  op.cbs = cache_block_stride;
  op.head_dim = head_dim;
  op.scale_bytes = scale_bytes;
  op.scale_base = scale_base;
  op.krs = k_row_stride;
  op.kcs = k_chunk_stride;
  op.srs = s_row_stride;
  op.sus = scale_unit_stride;
  op.sshift = static_cast<u32>(scale_shift);
  op.kchunks = static_cast<u32>(k_chunks);
  op.schunks = static_cast<u32>(s_chunks);
  gather_cta<4>(KVW_GATHER_ROW_ARGS(starts, nullptr, block_table, t_out, num_req, smem_rows), rpw,
                op);
}
#endif  // KVWRITE_HOST_TEST
