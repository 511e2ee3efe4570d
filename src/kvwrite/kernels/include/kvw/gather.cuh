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
// per warp (at most 32: lane j locates row j). The chain of a warp:
//   1. the starts. Batches of at most KVW_GATHER_WARP_REQS (31) requests (gather_rule_warp): lane
//      i loads a_i (and s_i), one coalesced load per tensor, and takes a_{i+1} from the next lane;
//      per row t a ballot of the requests with a_i <= t < a_{i+1}, whose highest bit is the owner
//      (the last one: exact for any starts). No shared memory, no barrier, no search. Larger
//      batches (gather_rule): every thread loads its share of the B + 1 starts (and seq_starts)
//      into shared memory, one round trip for B < 512 (B + 1 <= KVW_GATHER_SMEM_ROWS; larger ones
//      search global memory instead), the CTA learns whether they are non-decreasing, and lane j
//      binary-searches them for the last r with a_r <= t (about log2(B) shared loads), checks
//      t < e_r, and only where the starts decrease somewhere and the search misses scans every
//      request (which one of two owners wins is undefined, as the contract says);
//   2. lane j computes row t_first + j's position and loads its block-table entry (the one
//      dependent global load), and the op's byte offset of the entry (its row base);
//   3. the warp copies its rows in rounds (gather_warp_chunks; the upconvert and indexer kernels
//      have their own, built the same way): the op's chunks of a row, flattened over the warp's
//      rows so that every lane works whatever the row length, UNROLL chunks per lane and round;
//      first the round's row bases by shuffles from the rows' lanes (one word each where every
//      base lies below 2^31), then every load of the round (predicated, load_raw_if), then the
//      stores. The launcher gives a warp the rows one round covers (kvwrite.kernels.gather_cuda,
//      CudaTuning.max_rounds), so a lane waits for memory once, and a large call is many short
//      CTAs that the GPU starts as others finish.
// The kernels' pointer parameters carry no __restrict__: ptxas moved read-only loads
// (LDG.CONSTANT: a per-tensor fp8 scale) above the PDL wait (KVW_PDL_ENTRY); plain loads keep
// their place after it (tests/test_gather_cuda.py checks the SASS).
#pragma once
#include "kvw/common.cuh"
#include "kvw/fp8_read.cuh"
#include "kvw/vec_io.cuh"
#include "kvw/warp.cuh"

#if !defined(KVWRITE_HOST_TEST) || defined(KVWRITE_EMU)

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

// N bytes at p where `pred` holds, else zeros: one predicated load (ld.global, 16 bytes at most,
// p aligned to N) written as asm with its destination defined inside the statement. With
// `if (pred) r = load_raw<N>(p)` over a round's chunks, ptxas loaded into scratch registers and
// moved the values into place right after, waiting for each load before issuing the next (the
// original kernels had 1 to 3 of their 4 loads in flight); tests/test_gather_cuda.py reads the
// SASS: a round's loads all issued before the first wait for one of them.
template <int N>
KVW_HD Raw<N> load_raw_if(const u8* p, bool pred) {
  Raw<N> r;
#ifdef KVWRITE_EMU
  for (int i = 0; i < (N >= 4 ? N / 4 : 1); ++i) r.w[i] = 0;
  if (pred) r = load_raw<N>(p);
  return r;
#endif
  const u32 q = pred ? 1u : 0u;
  if constexpr (N == 16) {
    asm("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %4, 0;\n\t"
        "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
        "@q ld.global.v4.u32 {%0, %1, %2, %3}, [%5];\n\t}"
        : "=r"(r.w[0]), "=r"(r.w[1]), "=r"(r.w[2]), "=r"(r.w[3])
        : "r"(q), "l"(p));
  } else if constexpr (N == 8) {
    asm("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %2, 0;\n\tmov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\t"
        "@q ld.global.v2.u32 {%0, %1}, [%3];\n\t}"
        : "=r"(r.w[0]), "=r"(r.w[1])
        : "r"(q), "l"(p));
  } else if constexpr (N == 4) {
    asm("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %1, 0;\n\tmov.b32 %0, 0;\n\t"
        "@q ld.global.u32 %0, [%2];\n\t}"
        : "=r"(r.w[0])
        : "r"(q), "l"(p));
  } else if constexpr (N == 2) {
    asm("{\n\t.reg .pred q;\n\t.reg .b16 h;\n\tsetp.ne.b32 q, %1, 0;\n\tmov.b16 h, 0;\n\t"
        "@q ld.global.u16 h, [%2];\n\tcvt.u32.u16 %0, h;\n\t}"
        : "=r"(r.w[0])
        : "r"(q), "l"(p));
  } else {
    static_assert(N == 1, "a chunk of 1, 2, 4, 8 or 16 bytes");
    asm("{\n\t.reg .pred q;\n\t.reg .b16 h;\n\tsetp.ne.b32 q, %1, 0;\n\tmov.b16 h, 0;\n\t"
        "@q ld.global.u8 h, [%2];\n\tcvt.u32.u8 %0, h;\n\t}"
        : "=r"(r.w[0])
        : "r"(q), "l"(p));
  }
  return r;
}

// A 64-bit value computed before a round's loads, for its stores: an empty asm the compiler cannot
// look through (without it each store of gather_warp_chunks read the CTA and thread indices again,
// S2R, to compute the warp's first row after the loads).
#ifdef KVWRITE_EMU
#define KVW_GATHER_KEEP(x) ((void)0)
#else
#define KVW_GATHER_KEEP(x) asm("mov.b64 %0, %0;" : "+l"(x))
#endif

// A row's byte offset (an op's row_base, or -1: the row keeps its bytes) from lane `src`. Where
// every row base lies below 2^31 (`narrow`: a constant in a specialized build) one shuffle of the
// low word carries it, -1 included.
__device__ __forceinline__ i64 gather_shfl_base(i64 base, int src, bool narrow) {
  if (narrow) {
    return static_cast<i64>(static_cast<int>(
        __shfl_sync(0xFFFFFFFFu, static_cast<u32>(static_cast<u64>(base)), src)));
  }
  return shfl_i64(base, src);
}

// Whether (n - 1) * a + (m - 1) * b < 2^31 for non-negative a, b (n, m >= 1): every row base of
// a cache of n blocks of m offsets with these byte strides fits the narrow shuffle.
KVW_HD bool gather_narrow(i64 n, i64 a, i64 m, i64 b) {
  const u64 lim = 1ull << 31;
  if (static_cast<u64>(n) > lim || static_cast<u64>(m) > lim || static_cast<u64>(a) >= lim ||
      static_cast<u64>(b) >= lim)
    return false;
  return static_cast<u64>(n - 1) * static_cast<u64>(a) + static_cast<u64>(m - 1) * static_cast<u64>(b) <
         lim;
}

// Phase 3: the warp's `rows` rows (t_first, t_first + 1, ...; lane j holds row j's base, the
// op's row_base of its entry, or -1) through the op, chunk by chunk: the op's chunks of a row,
// flattened over the warp's rows, so every lane works whatever the row length. A round issues
// UNROLL chunks' loads per lane before any of their stores; the launcher sizes the warp's rows
// so that one round covers them (gather_cuda.round_rows), so a lane's loads all go out together
// and it waits for memory once. Op provides
//   typename Op::Chunk;                        // what a chunk's load hands its store
//   u32 chunks() const;                        // chunks per row
//   bool narrow;                               // every row base is below 2^31
//   Chunk load(i64 base, u32 k, bool live) const;  // chunk k of the entry at row base
//                                                  // `base`, loaded where `live` (load_raw_if)
//   void store(i64 t_first, u32 j, u32 k, const Chunk&) const;  // into output row
//                                              // t_first + j
// The chunk's row and index are computed again for its store (a multiply-high by a constant in
// a specialized build) rather than kept: fewer registers for the chunks in flight.
template <int UNROLL, typename Op>
__device__ __forceinline__ void gather_warp_chunks(const Op& op, i64 t_first, int rows,
                                                   i64 base) {
  const u32 lane = threadIdx.x & 31u;
  const u32 cpr = op.chunks();
  const u32 total = static_cast<u32>(rows) * cpr;
  KVW_GATHER_KEEP(t_first);
#pragma unroll 1
  for (u32 c0 = 0; c0 < total; c0 += 32u * UNROLL) {
    typename Op::Chunk buf[UNROLL];
    bool live[UNROLL];
    // The round's row bases first (its shuffles, then one wait for them), then its loads: a
    // shuffle between two loads made ptxas wait for the shuffle, and with it (scoreboards are
    // shared) the load before it. No branch between the loads either (a select, not
    // `c < total ? c / cpr : 0`): a chunk past the rows asks a lane beyond them (the shuffle
    // takes its source lane mod 32) and loads nothing.
    i64 b[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const u32 c = c0 + u * 32u + lane;
      b[u] = gather_shfl_base(base, static_cast<int>((c / cpr) & 31u), op.narrow);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const u32 c = c0 + u * 32u + lane;
      const u32 j = c / cpr;
      live[u] = c < total && b[u] >= 0;
      buf[u] = op.load(b[u], c - j * cpr, live[u]);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (live[u]) {
        const u32 c = c0 + u * 32u + lane;
        const u32 j = c / cpr;
        op.store(t_first, j, c - j * cpr, buf[u]);
      }
    }
  }
}

// The rule for the warp's rows with the starts in registers (batches of at most 31 requests:
// B + 1 starts, one per lane): lane i holds a_i (i <= B) and s_i (i < B), loaded together, and
// a_{i+1} from the next lane. For each of the warp's rows t (uniform), a ballot of the requests
// that own it, [a_i, a_{i+1}) containing t; the highest set bit is the last owner (exact for any
// starts: at most one owner where they do not decrease, and which of two wins is undefined).
// No shared memory, no barrier, no search: two loads in flight, a few instructions per row.
__device__ __forceinline__ GatherRow gather_rule_warp(const GatherRowArgs& g, i64 t_first,
                                                      int rows) {
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int nreq = static_cast<int>(g.num_req);
  i64 a = 0x7FFFFFFFFFFFFFFFll, s = 0;
  if (lane <= nreq) a = gather_start_global(g, lane);
  if ((g.flags & KVW_GATHER_HAS_SS) && lane < nreq)
    s = gather_index(g.seq_starts, lane * g.ss_stride, g.flags & KVW_GATHER_SS64);
  const i64 e = shfl_down_i64(a, 1u);
  int r = -1;
#pragma unroll 4
  for (int j = 0; j < rows; ++j) {
    const i64 t = t_first + j;
    const u32 m = __ballot_sync(0xFFFFFFFFu, lane < nreq && a <= t && t < e);
    if (lane == j && m != 0u) r = 31 - __clz(m);
  }
  const int src = r < 0 ? 0 : r;
  const i64 a_r = shfl_i64(a, src);
  const i64 s_r = shfl_i64(s, src);
  return gather_locate(g, t_first + lane, r, a_r, s_r);
}

// The rule for a CTA's rows (phases 1 and 2) with the starts in shared memory or global memory
// (batches of 32 requests or more): the lane's row (t_first + lane) and, for the warp, its first
// row and row count (0: no row, the warp returns). A generic build (no KVWRITE_FIXED_ARGS) keeps
// it one non-inlined function, compiled once per module whatever the kernel variants around it
// (one NVRTC program of every variant compiles it once); a specialized build inlines it, so its
// fixed arguments fold into it. KVW_GATHER_OUTLINED does the same for the fp8 conversion of a
// chunk (once per kernel rather than once per unrolled chunk).
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

// Batches of at most this many requests take gather_rule_warp (B + 1 starts in one warp).
#define KVW_GATHER_WARP_REQS 31

// The rule for the warp's rows: t_first, rows (0: none, the warp may return) and the lane's row
// (lane < rows). Batches of at most KVW_GATHER_WARP_REQS requests: gather_rule_warp (the warp on
// its own: a warp without rows returns at once); larger ones: gather_rule (the CTA loads the
// starts together; every thread reaches its barriers). The choice is uniform over the grid.
KVW_GATHER_OUTLINED GatherRow gather_rows(const GatherRowArgs& g, i64 rpw, i64& t_first,
                                          int& rows) {
  if (g.num_req > KVW_GATHER_WARP_REQS) return gather_rule(g, rpw, t_first, rows);
  const i64 warp = static_cast<i64>(blockIdx.x) * (KVW_GATHER_THREADS / 32) + (threadIdx.x >> 5);
  t_first = warp * rpw;
  rows = 0;
  if (t_first >= g.t_out) return GatherRow{-1, 0u};
  rows = static_cast<int>(g.t_out - t_first < rpw ? g.t_out - t_first : rpw);
  return gather_rule_warp(g, t_first, rows);
}

// A whole gather CTA: the rule for its rows, then the op over them. Every kernel calls it after
// KVW_PDL_ENTRY and its fixed-argument prologue; rpw rows per warp (at most 32: lane j holds row
// j). The op gives each row's base (Op::row_base(block, offset), an i64 byte offset) once, from
// the lane that located it.
template <int UNROLL, typename Op>
__device__ __forceinline__ void gather_cta(const GatherRowArgs& g, i64 rpw, const Op& op) {
  i64 t_first;
  int rows;
  const GatherRow row = gather_rows(g, rpw, t_first, rows);
  if (rows == 0) return;
  const i64 base = row.block >= 0 ? op.row_base(row.block, row.offset) : -1;
  gather_warp_chunks<UNROLL>(op, t_first, rows, base);
}

// ------------------------------------------------------------------------------------------
// Chunk helpers
// ------------------------------------------------------------------------------------------

// load_aligned where `pred` holds, else zeros: N bytes at an A-byte aligned address as the widest
// predicated loads A allows (load_raw_if pieces).
template <int N, int A>
KVW_HD Raw<N> gather_load_if(const u8* p, bool pred) {
  if constexpr (A >= 16 || A >= N) {
    return load_raw_if<N>(p, pred);
  } else {
    return load_pieces<N, A>(p, [pred](const u8* q) { return load_raw_if<A>(q, pred); });
  }
}

// N fp8 codes (byte i of `codes`) -> N elements of OUT (DT_F16, DT_BF16, DT_F32) by the read rule
// with the one scale s; e4m3 codes, or e5m2 where `e5m2`. Two codes at a time (fp8x2_dequant:
// the hardware decode on sm_89 and later), two 16-bit results packed by one conversion.
template <int OUT, int N>
KVW_GATHER_OUTLINED Raw<N * elem_bytes(OUT)> fp8_dequant_chunk(const Raw<N>& codes, float s,
                                                               bool e5m2) {
  Raw<N * elem_bytes(OUT)> out;
  if constexpr (N == 1) {
    float lo, hi;
    fp8x2_dequant(codes.w[0] & 0xFFu, s, e5m2, lo, hi);
    if constexpr (OUT == DT_F32) {
      out.w[0] = f32_bits(lo);
    } else {
      out.w[0] = f16ish_from_f32<OUT>(lo);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const u32 pair = (codes.w[i >> 2] >> (8 * (i & 3))) & 0xFFFFu;
      float lo, hi;
      fp8x2_dequant(pair, s, e5m2, lo, hi);
      if constexpr (OUT == DT_F32) {
        out.w[i] = f32_bits(lo);
        out.w[i + 1] = f32_bits(hi);
      } else {
        out.w[i >> 1] = f16ish_x2_from_f32<OUT>(lo, hi);
      }
    }
  }
  return out;
}
#endif  // !KVWRITE_HOST_TEST || KVWRITE_EMU
