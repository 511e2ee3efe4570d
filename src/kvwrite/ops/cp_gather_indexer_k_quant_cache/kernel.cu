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
// cp_gather_indexer_k_quant_cache_kernel<VK, VS>: a row is D / VK chunks of VK code bytes and
// 4G / VS chunks of VS scale bytes. Contiguous outputs take the widest chunks that the sizes and
// every page, row and output start allow (16 bytes at most for the codes, 4 for the scales: a
// few bytes a row); dst_k with a non-unit last stride takes one byte per chunk at that stride;
// dst_scale's elements (1 byte, or 4 for float32: scale_shift 0 or 2) lie scale_unit_stride
// bytes apart, and a chunk never spans two of them.
//
// Rows of D + 4G bytes are small (132 for D = 128): a warp takes up to 32 of them, and the two
// parts are flattened over its rows separately, so that no lane idles on a row's few scale bytes:
// chunk c of the codes is chunk c % (D / VK) of row c / (D / VK) (with D / VK = 8, four rows per
// 32 lanes, 512 contiguous bytes of a page), chunk c of the scales likewise (one 4-byte chunk a
// row: 32 rows' scales in one load instruction). A round issues KVW_INDEXER_CODE_UNROLL code
// chunks and KVW_INDEXER_SCALE_UNROLL scale chunks per lane before any store (32 rows of 132
// bytes in one round); each lane holds its row's two byte offsets (codes, scales), shuffled to
// the lanes that move its chunks.
#include "kvw/gather.cuh"

#if !defined(KVWRITE_HOST_TEST) || defined(KVWRITE_EMU)

// Chunks per lane and round (kvwrite.kernels.gather_cuda.INDEXER_UNROLL must say the same).
#ifndef KVW_INDEXER_CODE_UNROLL
#define KVW_INDEXER_CODE_UNROLL 8
#endif
#ifndef KVW_INDEXER_SCALE_UNROLL
#define KVW_INDEXER_SCALE_UNROLL 1
#endif

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
  constexpr int UK = KVW_INDEXER_CODE_UNROLL;
  constexpr int US = KVW_INDEXER_SCALE_UNROLL;
  i64 t_first;
  int rows;
  const GatherRow row = gather_rows(
      KVW_GATHER_ROW_ARGS(starts, nullptr, block_table, t_out, num_req, smem_rows), rpw, t_first,
      rows);
  if (rows == 0) return;
  // Every row's offsets below 2^31 (the last page ends by (num_blocks - 1) * cbs + bs * (D + 4G)):
  // one shuffle per chunk.
  const bool narrow =
      gather_narrow(num_blocks, cache_block_stride, block_size + 1, head_dim + scale_bytes);
  i64 kbase = -1, sbase = -1;
  if (row.block >= 0) {
    const i64 page = row.block * cache_block_stride;
    kbase = page + static_cast<i64>(row.offset) * head_dim;
    sbase = page + scale_base + static_cast<i64>(row.offset) * scale_bytes;
  }
  const u32 lane = threadIdx.x & 31u;
  const u32 kc = static_cast<u32>(k_chunks), sc = static_cast<u32>(s_chunks);
  const u32 k_total = static_cast<u32>(rows) * kc, s_total = static_cast<u32>(rows) * sc;
  const u32 smask = (1u << static_cast<u32>(scale_shift)) - 1u;
  KVW_GATHER_KEEP(t_first);
#pragma unroll 1
  for (u32 ck = 0, cs = 0; ck < k_total || cs < s_total; ck += 32u * UK, cs += 32u * US) {
    // Shuffles first, then every load, then the stores (see gather_warp_chunks).
    i64 kb[UK], sb[US];
#pragma unroll
    for (int u = 0; u < UK; ++u)
      kb[u] = gather_shfl_base(kbase, static_cast<int>(((ck + u * 32u + lane) / kc) & 31u), narrow);
#pragma unroll
    for (int u = 0; u < US; ++u)
      sb[u] = gather_shfl_base(sbase, static_cast<int>(((cs + u * 32u + lane) / sc) & 31u), narrow);
    Raw<VK> kv[UK];
    Raw<VS> sv[US];
    bool klive[UK], slive[US];
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      const u32 c = ck + u * 32u + lane;
      const u32 j = c / kc;
      klive[u] = c < k_total && kb[u] >= 0;
      kv[u] = load_raw_if<VK>(kv_cache + kb[u] + (c - j * kc) * VK, klive[u]);
    }
#pragma unroll
    for (int u = 0; u < US; ++u) {
      const u32 c = cs + u * 32u + lane;
      const u32 j = c / sc;
      slive[u] = c < s_total && sb[u] >= 0;
      sv[u] = load_raw_if<VS>(kv_cache + sb[u] + (c - j * sc) * VS, slive[u]);
    }
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      if (klive[u]) {
        const u32 c = ck + u * 32u + lane;
        const u32 j = c / kc;
        store_raw<VK>(dst_k + t_first * k_row_stride + static_cast<i64>(j) * k_row_stride +
                          static_cast<i64>(c - j * kc) * k_chunk_stride,
                      kv[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < US; ++u) {
      if (slive[u]) {
        const u32 c = cs + u * 32u + lane;
        const u32 j = c / sc;
        const u32 b = (c - j * sc) * VS;  // byte of the row's scales
        store_raw<VS>(dst_scale + t_first * s_row_stride + static_cast<i64>(j) * s_row_stride +
                          static_cast<i64>(b >> scale_shift) * scale_unit_stride + (b & smask),
                      sv[u]);
      }
    }
  }
}
#endif  // !KVWRITE_HOST_TEST || KVWRITE_EMU
