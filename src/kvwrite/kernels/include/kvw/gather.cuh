// The row rule every gather shares (docs/ops/gather.md, "Which rows a gather writes"), and the
// warp loop that moves the rows. Device code only. Included by every gather op's kernel.cu.
//
// Request r < B owns the output rows [a_r, e_r) and reads positions p = s_r + (t - a_r) of its
// sequence; a_r = starts[r], e_r = starts[r + 1] (cu_seq_lens), or e_{B-1} = T_out when the starts
// are workspace_starts (KVW_GATHER_WS). Row t < T_out is written iff a request owns it, p >= 0,
// p div bs < max_blocks and the block id block_table[r, p div bs] lies in [0, num_blocks);
// otherwise it keeps its bytes. Nothing outside the cache or the index tensors is read.
//
// A CTA of KVW_GATHER_THREADS threads covers (KVW_GATHER_THREADS / 32) * rpw consecutive rows, rpw
// per warp (at most 32). Its chain:
//   1. every thread loads its share of the B + 1 starts (and the B seq_starts) into shared memory:
//      coalesced loads issued together, one round trip for B < 512 (B + 1 <= KVW_GATHER_SMEM_ROWS;
//      larger batches search global memory instead), and the CTA learns whether the starts are
//      non-decreasing;
//   2. lane j of a warp owns row t_first + j: it binary-searches the shared starts for the last r
//      with a_r <= t (about log2(B) shared loads), checks t < e_r, computes p, and loads the
//      block-table entry (the one dependent global load); only where the starts decrease
//      somewhere and the search misses does a lane scan every request (which one of two owners
//      wins is undefined, as the contract says);
//   3. the warp copies its rows chunk by chunk (the op's chunks of a row, flattened over the
//      warp's rows, so every lane works whatever the row length), UNROLL chunks' loads in flight
//      per lane before their stores; a chunk's block id and offset come from the owning lane by
//      shuffles.
// The kernels' pointer parameters carry no __restrict__: ptxas moved read-only loads
// (LDG.CONSTANT: a per-tensor fp8 scale) above the PDL wait (KVW_PDL_ENTRY); plain loads keep
// their place after it (tests/test_gather_cuda.py checks the SASS).
#pragma once
#include "kvw/common.cuh"
#include "kvw/fp8_read.cuh"
#include "kvw/vec_io.cuh"

#ifndef KVWRITE_HOST_TEST

// The CTA size of every gather kernel and the starts it holds in shared memory (the launcher
// sizes the dynamic shared memory: 8 bytes per start and per seq_start).
#define KVW_GATHER_THREADS 128
#define KVW_GATHER_SMEM_ROWS 2048
#define KVW_GATHER_PER_ROUND 4

// Bits of the `flags` argument: which index tensors are int64 (else int32), whether there are
// seq_starts, and whether the starts are workspace_starts (B entries, the last request ending at
// T_out) rather than cu_seq_lens (B + 1 entries).
#define KVW_GATHER_STARTS64 1
#define KVW_GATHER_SS64 2
#define KVW_GATHER_BT64 4
#define KVW_GATHER_HAS_SS 8
#define KVW_GATHER_WS 16

// The row rule's arguments: the index tensors (raw pointers, element strides) and the cache's
// block geometry. The kernel parameters from starts_stride on are fixed by the call signature
// (KVW_GATHER_ROW_FIXED below).
struct GatherRowArgs {
  const u8* starts;       // [B + 1] cu_seq_lens or [>= B] workspace_starts, int32/int64
  const u8* seq_starts;   // [>= B] int32/int64, or null
  const u8* block_table;  // [>= B, max_blocks] int32/int64
  i64 t_out;              // rows of the output; rows >= t_out are never written
  i64 num_req;            // B
  i64 smem_rows;          // B + 1 when the starts are held in shared memory, else 0
  i64 starts_stride, ss_stride, bt_s0, bt_s1;  // element strides
  i64 max_blocks;         // block_table.size(1)
  i64 block_size, block_shift;  // block_shift = log2(block_size), or -1
  i64 num_blocks;
  i64 flags;              // KVW_GATHER_*
};

// The row rule's kernel parameters (after the pointers and the per-call scalars), in the order of
// the launcher's fixed arguments, and their count.
#define KVW_GATHER_ROW_PARAMS                                                             \
  i64 starts_stride, i64 ss_stride, i64 bt_s0, i64 bt_s1, i64 max_blocks, i64 block_size, \
      i64 block_shift, i64 num_blocks, i64 flags
#define KVW_GATHER_ROW_FIXED 9
// In a specialized build: the row rule's fixed arguments from fixed[0..8].
#define KVW_GATHER_ROW_ASSIGN()                                                         \
  starts_stride = fixed[0]; ss_stride = fixed[1]; bt_s0 = fixed[2]; bt_s1 = fixed[3];   \
  max_blocks = fixed[4]; block_size = fixed[5]; block_shift = fixed[6];                 \
  num_blocks = fixed[7]; flags = fixed[8];
#define KVW_GATHER_ROW_ARGS(starts, seq_starts, block_table, t_out, num_req, smem_rows)      \
  GatherRowArgs{starts, seq_starts, block_table, t_out, num_req, smem_rows, starts_stride, \
                ss_stride, bt_s0, bt_s1, max_blocks, block_size, block_shift, num_blocks, flags}

// Element i of an int32 (wide = false) or int64 index tensor, as int64.
KVW_HD i64 gather_index(const u8* base, i64 i, bool wide) {
  return wide ? reinterpret_cast<const i64*>(base)[i]
              : static_cast<i64>(reinterpret_cast<const int*>(base)[i]);
}

// a_r for r in [0, B], with a_B = e_{B-1} (T_out for workspace_starts), from global memory.
KVW_HD i64 gather_start_global(const GatherRowArgs& g, i64 r) {
  if ((g.flags & KVW_GATHER_WS) && r == g.num_req) return g.t_out;
  return gather_index(g.starts, r * g.starts_stride, g.flags & KVW_GATHER_STARTS64);
}

// Phase 1 (every thread of the CTA): the starts (and seq_starts) into shared memory, in rounds of
// KVW_GATHER_PER_ROUND entries per thread whose loads are all issued before their stores (one
// round trip for B < 512, registers for 4 entries of each array); returns whether a_0 <= a_1 <=
// ... <= a_B (false where they stay in global memory: then nothing is assumed).
__device__ __forceinline__ bool gather_load_starts(const GatherRowArgs& g, i64* s_a, i64* s_s) {
  if (g.smem_rows == 0) return false;
  const bool has_ss = g.flags & KVW_GATHER_HAS_SS;
  const i64 n = g.num_req + 1;
#pragma unroll 1
  for (i64 i0 = threadIdx.x; i0 < n; i0 += KVW_GATHER_PER_ROUND * KVW_GATHER_THREADS) {
    i64 va[KVW_GATHER_PER_ROUND], vs[KVW_GATHER_PER_ROUND];
#pragma unroll
    for (int k = 0; k < KVW_GATHER_PER_ROUND; ++k) {
      const i64 i = i0 + k * KVW_GATHER_THREADS;
      va[k] = vs[k] = 0;
      if (i < n) va[k] = gather_start_global(g, i);
      if (has_ss && i < g.num_req)
        vs[k] = gather_index(g.seq_starts, i * g.ss_stride, g.flags & KVW_GATHER_SS64);
    }
#pragma unroll
    for (int k = 0; k < KVW_GATHER_PER_ROUND; ++k) {
      const i64 i = i0 + k * KVW_GATHER_THREADS;
      if (i < n) s_a[i] = va[k];
      if (has_ss && i < g.num_req) s_s[i] = vs[k];
    }
  }
  __syncthreads();
  int down = 0;
#pragma unroll 1
  for (i64 i = threadIdx.x; i < g.num_req; i += KVW_GATHER_THREADS) down |= s_a[i] > s_a[i + 1];
  return __syncthreads_or(down) == 0;
}

// The request that owns row t, or -1. a(i) is a_i for i in [0, B]. The last r with a_r <= t
// (binary search), if it owns t; for non-decreasing starts no other request can. Otherwise,
// unless the starts are known to be non-decreasing, the last request that owns t, by a scan.
template <typename A>
KVW_HD int gather_owner(i64 t, int num_req, bool monotone, A a) {
  int lo = 0, hi = num_req;
#pragma unroll 1
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (a(mid) <= t) lo = mid + 1;
    else hi = mid;
  }
  if (lo > 0 && t < a(lo)) return lo - 1;
  if (monotone) return -1;
  int r = -1;
#pragma unroll 1
  for (int i = 0; i < num_req; ++i)
    if (a(i) <= t && t < a(i + 1)) r = i;
  return r;
}

// Where row t's entry is: block < 0 when the row keeps its bytes.
struct GatherRow {
  i64 block;
  u32 offset;
};

// The rest of the rule for row t owned by request r (r < 0: not owned): p = s_r + (t - a_r)
// (wrapping 64-bit arithmetic), its block-table entry, the bounds.
KVW_HD GatherRow gather_locate(const GatherRowArgs& g, i64 t, int r, i64 a_r, i64 s_r) {
  GatherRow out{-1, 0u};
  if (r < 0) return out;
  const i64 p = static_cast<i64>(static_cast<u64>(s_r) + (static_cast<u64>(t) - static_cast<u64>(a_r)));
  if (p < 0) return out;
  i64 bi;
  if (g.block_shift >= 0) {
    bi = p >> g.block_shift;
  } else if ((static_cast<u64>(p) >> 32) == 0) {
    bi = static_cast<u32>(p) / static_cast<u32>(g.block_size);
  } else {
    bi = p / g.block_size;
  }
  if (bi >= g.max_blocks) return out;
  const i64 blk = gather_index(g.block_table, static_cast<i64>(r) * g.bt_s0 + bi * g.bt_s1,
                               g.flags & KVW_GATHER_BT64);
  if (blk < 0 || blk >= g.num_blocks) return out;
  out.block = blk;
  out.offset = static_cast<u32>(p - bi * g.block_size);
  return out;
}

// Phase 3: the warp's `rows` rows (t_first, t_first + 1, ...; lane j holds row j's GatherRow)
// through the op, chunk by chunk. Op provides
//   typename Op::Chunk;                              // what a chunk's load hands its store
//   u32 chunks() const;                              // chunks per row
//   Chunk load(i64 block, u32 offset, u32 k) const;  // chunk k of the entry at (block, offset)
//   void store(i64 t, u32 k, const Chunk&) const;    // into output row t
template <int UNROLL, typename Op>
__device__ __forceinline__ void gather_warp_chunks(const Op& op, i64 t_first, int rows,
                                                   GatherRow row) {
  const u32 lane = threadIdx.x & 31u;
  const u32 cpr = op.chunks();
  const u32 total = static_cast<u32>(rows) * cpr;
  const u32 blk_lo = static_cast<u32>(static_cast<u64>(row.block));
  const u32 blk_hi = static_cast<u32>(static_cast<u64>(row.block) >> 32);
#pragma unroll 1
  for (u32 base = 0; base < total; base += 32u * UNROLL) {
    typename Op::Chunk buf[UNROLL];
    u32 jj[UNROLL], kk[UNROLL];
    bool live[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const u32 c = base + u * 32u + lane;
      const u32 j = c < total ? c / cpr : 0u;
      const u32 lo = __shfl_sync(0xFFFFFFFFu, blk_lo, j);
      const u32 hi = __shfl_sync(0xFFFFFFFFu, blk_hi, j);
      const u32 off = __shfl_sync(0xFFFFFFFFu, row.offset, j);
      const i64 blk = static_cast<i64>((static_cast<u64>(hi) << 32) | lo);
      jj[u] = j;
      kk[u] = c - j * cpr;
      live[u] = c < total && blk >= 0;
      if (live[u]) buf[u] = op.load(blk, off, kk[u]);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      if (live[u]) op.store(t_first + jj[u], kk[u], buf[u]);
  }
}

// The rule for a CTA's rows (phases 1 and 2): the lane's row (t_first + lane) and, for the warp,
// its first row and row count (0: no row, the warp returns). A generic build (no
// KVWRITE_FIXED_ARGS) keeps it one non-inlined function, compiled once per module whatever the
// kernel variants around it (one NVRTC program of every variant compiles it once); a
// specialized build inlines it, so its fixed arguments fold into it. KVW_GATHER_OUTLINED does the
// same for the fp8 conversion of a chunk (once per kernel rather than once per unrolled chunk).
#ifdef KVWRITE_FIXED_ARGS
#define KVW_GATHER_OUTLINED __device__ __forceinline__
#else
#define KVW_GATHER_OUTLINED __device__ __noinline__
#endif
KVW_GATHER_OUTLINED GatherRow gather_rule(const GatherRowArgs& g, i64 rpw, i64& t_first,
                                         int& rows) {
  extern __shared__ i64 kvw_gather_smem[];
  i64* s_a = kvw_gather_smem;
  i64* s_s = kvw_gather_smem + g.smem_rows;
  const bool monotone = gather_load_starts(g, s_a, s_s);
  const u32 lane = threadIdx.x & 31u;
  const i64 warp = static_cast<i64>(blockIdx.x) * (KVW_GATHER_THREADS / 32) + (threadIdx.x >> 5);
  t_first = warp * rpw;
  rows = 0;
  GatherRow row{-1, 0u};
  if (t_first >= g.t_out) return row;
  rows = static_cast<int>(g.t_out - t_first < rpw ? g.t_out - t_first : rpw);
  if (static_cast<int>(lane) < rows) {
    const i64 t = t_first + lane;
    const bool smem = g.smem_rows != 0;
    // One accessor for both homes of the starts (a uniform branch per access): shared memory
    // when they fit, global memory otherwise (no order known there).
    const auto a = [&](int i) { return smem ? s_a[i] : gather_start_global(g, i); };
    const int r = gather_owner(t, static_cast<int>(g.num_req), monotone, a);
    i64 a_r = 0, s_r = 0;
    if (r >= 0) {
      a_r = a(r);
      if (g.flags & KVW_GATHER_HAS_SS) {
        s_r = smem ? s_s[r]
                   : gather_index(g.seq_starts, r * g.ss_stride, g.flags & KVW_GATHER_SS64);
      }
    }
    row = gather_locate(g, t, r, a_r, s_r);
  }
  return row;
}

// A whole gather CTA: the rule for its rows, then the op over them. Every kernel calls it after
// KVW_PDL_ENTRY and its fixed-argument prologue; rpw rows per warp.
template <int UNROLL, typename Op>
__device__ __forceinline__ void gather_cta(const GatherRowArgs& g, i64 rpw, const Op& op) {
  i64 t_first;
  int rows;
  const GatherRow row = gather_rule(g, rpw, t_first, rows);
  if (rows == 0) return;
  gather_warp_chunks<UNROLL>(op, t_first, rows, row);
}

// ------------------------------------------------------------------------------------------
// Chunk helpers
// ------------------------------------------------------------------------------------------

// N bytes at an A-byte aligned address (A a power of two <= N), as the widest accesses A allows.
template <int N, int A>
KVW_HD Raw<N> gather_load(const u8* p) {
  if constexpr (A >= 16 || A >= N) {
    return load_raw<N>(p);
  } else {
    Raw<N> r;
#pragma unroll
    for (int i = 0; i < (N >= 4 ? N / 4 : 1); ++i) r.w[i] = 0;
#pragma unroll
    for (int i = 0; i < N / A; ++i) {
      const Raw<A> piece = load_raw<A>(p + i * A);
      if constexpr (A >= 4) {
#pragma unroll
        for (int k = 0; k < A / 4; ++k) r.w[i * A / 4 + k] = piece.w[k];
      } else {
        r.w[(i * A) / 4] |= piece.w[0] << (8 * ((i * A) & 3));
      }
    }
    return r;
  }
}

template <int N, int A>
KVW_HD void gather_store(u8* p, const Raw<N>& r) {
  if constexpr (A >= 16 || A >= N) {
    store_raw<N>(p, r);
  } else {
#pragma unroll
    for (int i = 0; i < N / A; ++i) {
      Raw<A> piece;
      if constexpr (A >= 4) {
#pragma unroll
        for (int k = 0; k < A / 4; ++k) piece.w[k] = r.w[i * A / 4 + k];
      } else {
        piece.w[0] = (r.w[(i * A) / 4] >> (8 * ((i * A) & 3))) & ((1u << (8 * A)) - 1u);
      }
      store_raw<A>(p + i * A, piece);
    }
  }
}

// N fp8 codes (byte i of `codes`) -> N elements of OUT (DT_F16, DT_BF16, DT_F32) by the read rule
// with the one scale s; e4m3 codes, or e5m2 where `e5m2`.
template <int OUT, int N>
KVW_GATHER_OUTLINED Raw<N * elem_bytes(OUT)> fp8_dequant_chunk(const Raw<N>& codes, float s,
                                                               bool e5m2) {
  Raw<N * elem_bytes(OUT)> out;
#pragma unroll
  for (int j = 0; j < (N * elem_bytes(OUT) >= 4 ? N * elem_bytes(OUT) / 4 : 1); ++j) out.w[j] = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const u32 c = (codes.w[i >> 2] >> (8 * (i & 3))) & 0xFFu;
    const float y = fp8_dequant_any(c, s, e5m2);
    if constexpr (OUT == DT_F32) {
      out.w[i] = f32_bits(y);
    } else {
      out.w[i >> 1] |= f16ish_from_f32<OUT>(y) << ((i & 1) * 16);
    }
  }
  return out;
}
#endif  // KVWRITE_HOST_TEST
