// kvwrite: moving caches (SPEC §9, docs/ops/transfer.md): the raw strided block copies of every
// transfer op (swap_blocks, swap_blocks_multi_layer, relayout_kv_cache, raw pack/unpack) and the
// quantized transfer pages (pack_kv_pages / unpack_kv_pages with fp8_e4m3, fp8_e5m2, nvfp4).
//
// Compiled at run time with NVRTC (kernels/transfer_cuda.py, which plans the launches). Every
// kernel is a persistent grid-stride loop (at most max_ctas CTAs), reads the block mapping on the
// device ([n, 2], int32 or int64, element strides ms0, ms1) and skips a pair whose source or
// destination id lies outside [0, blocks) of its side (SPEC §9.1: GPU mappings are not checked on
// the host; -1 pads are skipped). Addresses are bytes: element [b, h, t, c] of a side at
// ptr + b*sb + h*sh + t*st + c*sc.
//
// Pointers of several tensors (layers) travel as scalar kernel parameters in fixed slots
// (cuda.core's launch takes scalars only, and a device pointer table would need an allocation
// and a host copy per call, which CUDA graph capture without a warm-up call forbids): KVW_SLOTS
// (src, dst) pairs per copy launch, KVW_SLOTS layer pointers per page launch; unused slots 0.
#include "kvw/common.cuh"
#include "kvw/fp8.cuh"
#include "kvw/fp8_read.cuh"
#include "kvw/nvfp4.cuh"
#include "kvw/vec_io.cuh"

// The page format of the page kernels' FMT beside DT_E4M3 / DT_E5M2.
#define KVW_NVFP4 6

// Batches of 32 * U units a warp item of the page kernels moves one after the other (the item's
// decomposition, pair, addresses and scale once for all; transfer_cuda.page_batches): 2, but 1
// for the nvfp4 unpack (it measured 0.73-0.79 of its one-batch rate: tuning-log 90). The nvfp4
// pack takes 2 although ptxas spills 36 bytes of its registers at U = 2 (loop invariants,
// reloaded once an item): 119.4 -> 107.8 us for 128 Llama-3-8B blocks (tuning-log 109).
__host__ __device__ constexpr int page_batches(int fmt, bool pack) {
  return fmt == KVW_NVFP4 && !pack ? 1 : 2;
}

// Slots per launch (transfer_cuda.SLOTS says the same).
#define KVW_SLOTS 64
#define KVW_XSLOTS(X)                                                                              \
  X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15) X(16)      \
  X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24) X(25) X(26) X(27) X(28) X(29) X(30) X(31)        \
  X(32) X(33) X(34) X(35) X(36) X(37) X(38) X(39) X(40) X(41) X(42) X(43) X(44) X(45) X(46)        \
  X(47) X(48) X(49) X(50) X(51) X(52) X(53) X(54) X(55) X(56) X(57) X(58) X(59) X(60) X(61)        \
  X(62) X(63)

// a / b and a % b for 64-bit counts, in 32-bit arithmetic where both fit (the common case; a
// 64-bit division is a long software sequence).
KVW_HD u64 udiv(u64 a, u64 b) {
  return ((a | b) >> 32) == 0 ? static_cast<u64>(static_cast<u32>(a) / static_cast<u32>(b))
                              : a / b;
}

// n / d for n, d < 2^32 by one high multiply: magic = ceil(2^64 / d) for d >= 2 (then
// n * magic / 2^64 exceeds n / d by less than 2^-32 <= 1/d, never reaching the next integer), 0
// for d == 1 (transfer_cuda.magic). Where the launch's count of vectors is 2^32 or more
// (`small` false) the division itself. With n < 2^32 the high word of n * magic is
// (n * hi(magic) + hi(n * lo(magic))) / 2^32 (the dropped low word of n * lo(magic) is below
// 2^32 and cannot carry into it; the sum stays below 2^64): two 32-bit multiplies, where a
// 64 x 64 high product takes four and their carries.
KVW_HD u64 fdiv(u64 n, u64 d, u64 magic, bool small) {
  if (small) {
    if (magic == 0) return n;
    const u64 n32 = static_cast<u32>(n);
    const u64 low = (n32 * static_cast<u32>(magic)) >> 32;
    return (n32 * static_cast<u32>(magic >> 32) + low) >> 32;
  }
  return n / d;
}

template <typename IDX>
KVW_HD void read_pair(const IDX* mapping, i64 ms0, i64 ms1, u64 m, i64* i, i64* j) {
  const IDX* row = mapping + static_cast<i64>(m) * ms0;
  *i = static_cast<i64>(load_index(row));
  *j = static_cast<i64>(load_index(row + ms1));
}

// ------------------------------------------------------------------------------------------
// Raw copies: transfer_copy_kernel<VB, IDX, U>
//
// One launch copies up to KVW_SLOTS jobs of one geometry (the launcher groups a plan's CopyJobs by
// their strides, counts and vector width): job q's pair m, head h, token t, a row of `nvec`
// vectors of VB bytes. A dense row (both sides' elements adjacent) is its row_bytes as
// row_bytes / VB vectors (sc = VB); a non-dense row is elems elements of 2^ppe_shift pieces of VB
// bytes each (vector v: element v >> ppe_shift, piece v & (2^ppe_shift - 1)). VB is the widest of
// 16/8/4/2/1 dividing both pointers of every job and every byte stride and size that moves an
// address (kernels.launch.align).
//
// The unit of work is a warp's segment: 32 * U consecutive vectors of one row (the last segment
// of a row masked at its end). The grid's warps walk the segments (job, pair, head, token,
// segment; the segment fastest); a warp decomposes its segment's index and reads its mapping
// pair once (warp-uniform), then each lane loads its U vectors, 32 apart (a warp's lanes read
// adjacent vectors: whole lines, also over PCIe from pinned host memory), all before its U stores
// (ld.volatile: U * VB bytes in flight per lane). Measured (H200, Llama-3-8B pages, 32 layers):
// a decomposition and mapping read per vector, as a first version did, held a 1024-thread CTA to
// 82% of a device copy's bandwidth; the launcher picks U per launch so that a segment fits the
// row (docs/tuning-log.md).
// ------------------------------------------------------------------------------------------
#define KVW_COPY_SLOT_PARAMS(n) u64 src##n, u64 dst##n,
#define KVW_COPY_SLOT_CASE(n) \
  case n:                     \
    s = src##n;               \
    d = dst##n;               \
    break;

// At most 64 registers a thread (launch bounds of 1024 threads): one CTA of TransferTuning's
// 1024 threads per SM at every U.
template <int VB, typename IDX, int U>
__global__ void __launch_bounds__(1024) transfer_copy_kernel(const IDX* __restrict__ mapping, i64 ms0, i64 ms1, i64 pairs,
                                     KVW_XSLOTS(KVW_COPY_SLOT_PARAMS) i64 njobs, i64 ssb, i64 ssh,
                                     i64 sst, i64 ssc, i64 dsb, i64 dsh, i64 dst_, i64 dsc,
                                     i64 sblocks, i64 dblocks, i64 heads, i64 tokens, i64 nvec,
                                     i64 ppe_shift, i64 segs, u64 m_segs, u64 m_tokens,
                                     u64 m_heads, u64 m_pairs) {
  KVW_PDL_ENTRY();
  constexpr int SEG = 32 * U;
  const u64 total = static_cast<u64>(njobs) * pairs * heads * tokens * segs;
  const bool small = total < (1ull << 32);  // every count and quotient below 2^32: fdiv
  const int lane = threadIdx.x & 31;
  const u64 warps = blockDim.x >> 5;
  const i64 piece_mask = (1ll << ppe_shift) - 1;
  for (u64 g = static_cast<u64>(blockIdx.x) * warps + (threadIdx.x >> 5); g < total;
       g += static_cast<u64>(gridDim.x) * warps) {
    u64 r = fdiv(g, segs, m_segs, small);
    const i64 sg = static_cast<i64>(g - r * segs);
    u64 q = fdiv(r, tokens, m_tokens, small);
    const i64 t = static_cast<i64>(r - q * tokens);
    r = fdiv(q, heads, m_heads, small);
    const i64 h = static_cast<i64>(q - r * heads);
    q = fdiv(r, pairs, m_pairs, small);
    i64 i, j;
    read_pair(mapping, ms0, ms1, r - q * pairs, &i, &j);
    if (i < 0 || i >= sblocks || j < 0 || j >= dblocks) continue;
    u64 s = 0, d = 0;
    switch (static_cast<int>(q)) { KVW_XSLOTS(KVW_COPY_SLOT_CASE) default: break; }
    const u8* srow = reinterpret_cast<const u8*>(s + i * ssb + h * ssh + t * sst);
    u8* drow = reinterpret_cast<u8*>(d + j * dsb + h * dsh + t * dst_);
    const i64 v0 = sg * SEG + lane;
    Raw<VB> x[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const i64 v = v0 + 32 * k;
      if (v < nvec)
        x[k] = load_raw_volatile<VB>(srow + (v >> ppe_shift) * ssc + (v & piece_mask) * VB);
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const i64 v = v0 + 32 * k;
      if (v < nvec) store_raw<VB>(drow + (v >> ppe_shift) * dsc + (v & piece_mask) * VB, x[k]);
    }
  }
}

// ------------------------------------------------------------------------------------------
// Rows no longer than a warp: transfer_copy_rows_kernel<VB, IDX, U, LANES>
//
// The parameters and the copy of transfer_copy_kernel (segs 1, m_segs unused), for launches whose
// rows have nvec <= LANES vectors (LANES a power of two up to 32; the launcher takes the least
// power of two >= nvec, transfer_cuda.copy_lanes). A warp's lanes form 32 / LANES groups of LANES
// lanes, group k of a warp's step owning one row; lane l moves vector l % LANES (masked where
// >= nvec) of each of its U rows. The unit of work is a warp's step of 32 / LANES * U consecutive
// rows of the (job, pair, head, token) index, or (pair, job, head, token) where the launcher
// asks (pair_major: the launch's jobs lie inside one block of a side, as a page-first buffer's
// layers or a page's chunks do, so the grid finishes a block's region before the next; see
// transfer_cuda.pair_major): row base + k * (32 / LANES) + l / LANES of lane l
// at k < U, so each of the U loads of the warp covers 32 / LANES whole consecutive rows. Each
// lane decomposes its first row and reads its mapping pair itself (the lanes of a group read the
// same pair: one broadcast load); its later rows that are the same block's later tokens take
// that row's pair and addresses, and a row past its block's last token is decomposed and its
// pair read as the first, all before the first row load (a row's load waits for its pair, and
// an asm volatile load stays in order: a pair read between two row loads would serialize the
// round trips); then the U row loads (ld.volatile), then the U stores: U * VB bytes in flight
// per lane, as the segment kernel's. Measured (H200, change 72): rows of 512 B (nvec 32) moved as
// one segment per warp (U = 1) ran at 74% of a device copy, rows of 256 B (16 vectors, half the
// warp idle) at 41%; each row decomposed and its pair read (before change 87) held relayout and
// raw pages to 0.90-0.94 of what they move now device to device and half from a peer. A copy
// from a peer also cuts its long rows (whole blocks) into rows of 32 vectors for this kernel
// (transfer_cuda.TransferTuning.peer_row_vectors).
// ------------------------------------------------------------------------------------------
// Row r of a rows launch: its token T, the ids I, J of its mapping pair and its row's addresses
// S, D on each side (the ids not folded in); WITH_T runs once T is known (the first row's room
// there, the sm_90 cubins are the measured ones). The rows kernel decomposes its lanes' first
// rows and rows past their block's last token by it.
#define KVW_ROW_POSITION(r, T, I, J, S, D, WITH_T)                                  \
  do {                                                                              \
    u64 q_ = fdiv(r, tokens, m_tokens, small);                                      \
    T = static_cast<i64>(r - q_ * tokens);                                          \
    WITH_T;                                                                         \
    u64 p_ = fdiv(q_, heads, m_heads, small);                                       \
    const i64 h_ = static_cast<i64>(q_ - p_ * heads);                               \
    q_ = fdiv(p_, inner, m_inner, small);                                           \
    const u64 w_ = p_ - q_ * inner;                                                 \
    read_pair(mapping, ms0, ms1, pair_major ? q_ : w_, &I, &J);                     \
    u64 s = 0, d = 0;                                                               \
    switch (static_cast<int>(pair_major ? w_ : q_)) {                               \
      KVW_XSLOTS(KVW_COPY_SLOT_CASE) default: break;                                \
    }                                                                               \
    S = s + h_ * ssh + T * sst + vs;                                                \
    D = d + h_ * dsh + T * dst_ + vd;                                               \
  } while (0)

template <int VB, typename IDX, int U, int LANES>
__global__ void __launch_bounds__(1024) transfer_copy_rows_kernel(
    const IDX* __restrict__ mapping, i64 ms0, i64 ms1, i64 pairs,
    KVW_XSLOTS(KVW_COPY_SLOT_PARAMS) i64 njobs, i64 ssb, i64 ssh, i64 sst, i64 ssc, i64 dsb, i64 dsh,
    i64 dst_, i64 dsc, i64 sblocks, i64 dblocks, i64 heads, i64 tokens, i64 nvec, i64 ppe_shift,
    i64 segs, u64 m_segs, u64 m_tokens, u64 m_heads, u64 m_inner, i64 pair_major) {
  static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0,
                "LANES: a power of two up to 32");
  KVW_PDL_ENTRY();
  constexpr int ROWS = 32 / LANES;  // rows a warp's load covers
  const u64 total = static_cast<u64>(njobs) * pairs * heads * tokens;  // rows
  // The rows' order: (job, pair, head, token), or where pair_major (pair, job, head, token);
  // m_inner is fdiv's constant of the inner count (pairs, or njobs where pair_major).
  const i64 inner = pair_major ? njobs : pairs;
  const bool small = total < (1ull << 32);  // every count and quotient below 2^32: fdiv
  const int lane = threadIdx.x & 31;
  const i64 v = lane & (LANES - 1);  // the lane's vector of each of its rows
  const bool active = v < nvec;
  const i64 piece_mask = (1ll << ppe_shift) - 1;
  const i64 vs = (v >> ppe_shift) * ssc + (v & piece_mask) * VB;
  const i64 vd = (v >> ppe_shift) * dsc + (v & piece_mask) * VB;
  const u64 warps = blockDim.x >> 5;
  for (u64 g = static_cast<u64>(blockIdx.x) * warps + (threadIdx.x >> 5); g * (ROWS * U) < total;
       g += static_cast<u64>(gridDim.x) * warps) {
    const u64 r0 = g * (ROWS * U) + lane / LANES;
    // Each row's position (its job's pointers, head and token folded into a row address on each
    // side) and mapping pair; a row past the launch's end or a masked lane reads no pair and
    // takes ids (-1, -1), outside every side. The lane's first row is decomposed and its pair
    // read; row k (r0 + k * ROWS) whose token t0 + k * ROWS is still below `tokens` is the same
    // job, pair and head (later tokens of the same block), so it takes row 0's pair and
    // addresses moved by k * ROWS tokens: one decomposition and one pair read a lane a step
    // where a block's tokens are a multiple of the step's rows, the full decomposition only for
    // a row past its block's last token. FOLD (U > 2, the remote sides' U): the ids are folded
    // into the addresses at once, so only the two addresses and the flag stay live until the
    // row's load. At U <= 2 (device copies) the ids are folded after the loads are issued.
    constexpr bool FOLD = U > 2;
    // Rows a lane holds addresses for at once where a step's rows leave row 0's block (U = 8:
    // four groups of 2; with groups of 4, ptxas spilled past the 64 registers).
    constexpr int GU = U > 4 ? 2 : U;
    // Tokens of row 0's block from row 0 on (capped: a 32-bit count); 0: no row continues it.
    int room = 0;
    u64 s0 = 0, d0 = 0;
    i64 i0 = -1, j0 = -1;
    bool ok0 = false;
    if (active && r0 < total) {
      i64 t0;
      KVW_ROW_POSITION(r0, t0, i0, j0, s0, d0,
                       room = static_cast<int>(tokens - t0 < (1ll << 30) ? tokens - t0
                                                                         : (1ll << 30)));
      if constexpr (FOLD) {
        ok0 = i0 >= 0 && i0 < sblocks && j0 >= 0 && j0 < dblocks;
        s0 += i0 * ssb;
        d0 += j0 * dsb;
      }
    }
    if constexpr (U > GU) {
      // Every row of the step in row 0's block (the common case): the U loads from row 0's
      // addresses, nothing else held.
      if (room > (U - 1) * ROWS) {
        if (ok0) {
          Raw<VB> x[U];
          const i64 ss = ROWS * sst, ds = ROWS * dst_;
#pragma unroll
          for (int k = 0; k < U; ++k, s0 += ss)
            x[k] = load_raw_volatile<VB>(reinterpret_cast<const u8*>(s0));
#pragma unroll
          for (int k = 0; k < U; ++k, d0 += ds) store_raw<VB>(reinterpret_cast<u8*>(d0), x[k]);
        }
        continue;
      }
    }
#pragma unroll
    for (int k1 = 0; k1 < U; k1 += GU) {
      u64 sb[GU], db[GU];
      i64 i[GU], j[GU];
      bool ok[GU];
#pragma unroll
      for (int kk = 0; kk < GU; ++kk) {
        const int k = k1 + kk;
        const u64 r = r0 + static_cast<u64>(k) * ROWS;
        if (k * ROWS < room) {  // row 0's job, pair and head
          sb[kk] = s0 + static_cast<i64>(k * ROWS) * sst;
          db[kk] = d0 + static_cast<i64>(k * ROWS) * dst_;
          if constexpr (FOLD) {
            ok[kk] = ok0;
          } else {
            i[kk] = i0;
            j[kk] = j0;
          }
          continue;
        }
        i64 pi = -1, pj = -1;
        sb[kk] = 0;
        db[kk] = 0;
        if (active && r < total) {
          i64 t;
          KVW_ROW_POSITION(r, t, pi, pj, sb[kk], db[kk], (void)0);
        }
        if constexpr (FOLD) {
          ok[kk] = pi >= 0 && pi < sblocks && pj >= 0 && pj < dblocks;
          sb[kk] += pi * ssb;
          db[kk] += pj * dsb;
        } else {
          i[kk] = pi;
          j[kk] = pj;
        }
      }
      Raw<VB> x[GU];
#pragma unroll
      for (int kk = 0; kk < GU; ++kk) {
        if constexpr (FOLD) {
          if (ok[kk]) x[kk] = load_raw_volatile<VB>(reinterpret_cast<const u8*>(sb[kk]));
        } else {
          ok[kk] = i[kk] >= 0 && i[kk] < sblocks && j[kk] >= 0 && j[kk] < dblocks;
          if (ok[kk])
            x[kk] = load_raw_volatile<VB>(reinterpret_cast<const u8*>(sb[kk] + i[kk] * ssb));
          db[kk] += j[kk] * dsb;
        }
      }
#pragma unroll
      for (int kk = 0; kk < GU; ++kk) {
        if (ok[kk]) store_raw<VB>(reinterpret_cast<u8*>(db[kk]), x[kk]);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// Quantized pages (SPEC §9.4). Head chunk k of page row p starts at page + p*prs + k*hb; in it:
// float32 sigma(l, s) at 4*(l*S + s), then the codes from codes_at = 4*L*S (fp8: element
// q = r*E + e at q; nvfp4: element q's nibble in byte q / 2, low nibble when e is even, then the
// scale byte of group g of row r at L*N*C/2 + r*E/16 + g), zeros to hb. Row r = (l*S + s)*N + t;
// cache element (l, t, s*E + e) of cache head k.
//
// A group is 16 consecutive elements of a row part (fp8: the last one of a part may be shorter,
// E % 16 elements; nvfp4: E % 16 == 0), G = ceil(E / 16) a row part. A segment is (pair, chunk
// k, layer l, part s): N*G groups whose codes are one contiguous range of the chunk. The unit of
// work is a warp's item: 32*U consecutive groups of one segment (lane i takes groups i, i + 32,
// ..., masked at the segment's end), or, in the pack launch with l0 == 0, one header item per
// chunk (the L*S sigma floats, lanes over them, and the zero tail, at most 15 bytes, a lane a
// byte): so those bytes are written once whatever the number of launches. A warp decomposes its
// item's index once (divisions by launch constants as high multiplies: fdiv) and reads its
// mapping pair, layer pointer and sigma once; a lane's group then takes one more (by G).
// Measured before (H200, tuning-log change 72): a thread per group, the decomposition and the
// mapping read per group, and page accesses of a width chosen at run time (local memory) moved
// 36% (fp8) and 19% (NVFP4) of a device copy's bandwidth in page bytes.
//
// ALIGN (transfer_cuda.page_align decides at launch): 0 is the general variant (any alignment,
// partial groups, strided parts: U = 1, each group's accesses the widest its addresses allow at
// run time); else every group is whole, its cache bytes dense at a 16-byte aligned address, the
// chunk starts 16-byte aligned and every group's codes lie ALIGN-aligned (4, 8 or 16: the power
// of two of 4*L*S, the codes' offset in the chunk, at most a group's code bytes, 16 fp8 and 8
// nvfp4): fixed-width accesses (a group's codes as 16 / ALIGN pieces: DeepSeek-V3's 61 layers give
// ALIGN 4), all U groups' loads issued before their arithmetic.
//
// fp8 quantizes 16-bit caches through kvw/fp8.cuh's fp8_quantize_fast16 where sigma is in its
// range (three operations an element; H200, Llama-3-8B, 128 blocks: 108.2 -> 104.5 us,
// tuning-log 112), else (float32 caches, other scales) through fp8_quantize's exact quotient, in
// every variant (fp8_fast16_scale's constants once an item; the quotient's m and s2 again a
// unit from them). The bracket (two products an element, the quotient only for a unit holding
// an element near an fp8 rounding boundary) was faster for scales whose quotients never meet a
// boundary and 1.3x slower where they do (s = 0.01, 2^-7: a power-of-two bfloat16 element lands
// on a midpoint, and the warp runs both paths): tuning-log 108. nvfp4 through kvw/nvfp4.cuh's
// nvfp4_part_rule (the nvfp4 write's fast pack: no clamp where there is no NaN
// and no product of 7 or more, else the general pack), the same bytes as nvfp4_group.
// ------------------------------------------------------------------------------------------

// n bytes (n <= 16) at p into / from little-endian words w[4]: one 16-byte access where n == 16
// and p allows, 4-byte words where p and n allow, else bytes (every array index a constant: no
// local memory).
KVW_HD void load_bytes(const u8* p, int n, u32 (&w)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = 0;
  const u64 a = reinterpret_cast<u64>(p);
  if (n == 16 && (a & 15) == 0) {
    const Raw<16> r = load_raw<16>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = r.w[i];
  } else if ((a & 3) == 0 && (n & 3) == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (4 * i < n) w[i] = reinterpret_cast<const u32*>(p)[i];
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i)
      if (i < n) w[i >> 2] |= static_cast<u32>(p[i]) << (8 * (i & 3));
  }
}

KVW_HD void store_bytes(u8* p, int n, const u32 (&w)[4]) {
  const u64 a = reinterpret_cast<u64>(p);
  if (n == 16 && (a & 15) == 0) {
    Raw<16> r;
#pragma unroll
    for (int i = 0; i < 4; ++i) r.w[i] = w[i];
    store_raw<16>(p, r);
  } else if ((a & 3) == 0 && (n & 3) == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (4 * i < n) reinterpret_cast<u32*>(p)[i] = w[i];
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i)
      if (i < n) p[i] = static_cast<u8>(w[i >> 2] >> (8 * (i & 3)));
  }
}

KVW_HD float load_f32_any(const u8* p) {
  u32 w[4];
  load_bytes(p, 4, w);
  return bits_f32(w[0]);
}

// N bytes (a multiple of 16) at a 16-byte aligned p, as N / 16 16-byte accesses.
template <int N>
KVW_HD Raw<N> load_wide(const u8* p) {
  Raw<N> r;
#pragma unroll
  for (int v = 0; v < N / 16; ++v) {
    const Raw<16> x = load_raw<16>(p + 16 * v);
#pragma unroll
    for (int i = 0; i < 4; ++i) r.w[4 * v + i] = x.w[i];
  }
  return r;
}

template <int N>
KVW_HD void store_wide(u8* p, const Raw<N>& r) {
#pragma unroll
  for (int v = 0; v < N / 16; ++v) {
    Raw<16> x;
#pragma unroll
    for (int i = 0; i < 4; ++i) x.w[i] = r.w[4 * v + i];
    store_raw<16>(p + 16 * v, x);
  }
}

// The n (<= 16) cache elements of a group at p (element stride sc bytes), raw (zero past n): one
// vector where the group is whole, dense and 16-byte aligned, else element by element.
template <int IN>
KVW_HD Raw<16 * (IN == DT_F32 ? 4 : 2)> load_group(const u8* p, i64 sc, int n) {
  constexpr int ES = IN == DT_F32 ? 4 : 2;
  const u64 a = reinterpret_cast<u64>(p);
  if (sc == ES && n == 16 && (a & 15) == 0) return load_wide<16 * ES>(p);
  Raw<16 * ES> raw;
#pragma unroll
  for (int i = 0; i < 4 * ES; ++i) raw.w[i] = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    if (i < n) {
      const Raw<ES> r = load_raw<ES>(p + i * sc);
      if constexpr (ES == 4) {
        raw.w[i] = r.w[0];
      } else {
        raw.w[i >> 1] |= r.w[0] << (16 * (i & 1));
      }
    }
  }
  return raw;
}

// M (even) float32 values rounded to OUT, as their raw cache bytes.
template <int OUT, int M>
KVW_HD Raw<M * (OUT == DT_F32 ? 4 : 2)> round_group(const float (&y)[M]) {
  Raw<M * (OUT == DT_F32 ? 4 : 2)> r;
#pragma unroll
  for (int i = 0; i < M; ++i) {
    if constexpr (OUT == DT_F32) {
      r.w[i] = f32_bits(y[i]);
    } else if ((i & 1) == 0) {
      r.w[i >> 1] = f16ish_x2_from_f32<OUT>(y[i], y[i + 1]);
    }
  }
  return r;
}

// __byte_perm(x, y, sel): byte i of the result is byte (sel >> 4i) & 7 of y:x.
KVW_HD u32 byte_perm(u32 x, u32 y, u32 sel) {
#ifdef KVWRITE_HOST_TEST
  const u64 xy = (static_cast<u64>(y) << 32) | x;
  u32 r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<u32>((xy >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
#else
  return __byte_perm(x, y, sel);
#endif
}

// SPEC §6.4's decode of an nvfp4 group: y[i] = RN(RN(value(c_i) * S) * sigma), from its 16 codes
// (w: element 2j in the low nibble of byte j) and sv64 = S * 64 (exact). E2M1's magnitude m =
// c & 7 is the e4m3 code m << 2 times 2^6 (e4m3(m << 2) = value(m) * 2^-6 for every m: 0, 2^-7
// (subnormal), 2^-6, ..., 6 * 2^-6), its sign bit (8) e4m3's (0x80); so the codes become e4m3 pairs
// in a few bit operations a word, decoded by fp8x2_dequant (sm_89 and later: the hardware
// conversion, two codes at once), and value(c) * S = e4m3 * sv64 exactly (at most 7 significant
// bits, at least 2^-10: never rounded), as the rule's product is.
KVW_HD void nvfp4_group_values(const u32 (&w)[4], float sv64, float sigma, float (&y)[16]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const u32 lo = w[h] & 0x0F0F0F0Fu, hi = (w[h] >> 4) & 0x0F0F0F0Fu;  // byte j: 2j, 2j + 1
    const u32 el = ((lo & 0x08080808u) << 4) | ((lo & 0x07070707u) << 2);
    const u32 eh = ((hi & 0x08080808u) << 4) | ((hi & 0x07070707u) << 2);
    const u32 pairs[2] = {byte_perm(el, eh, 0x5140u), byte_perm(el, eh, 0x7362u)};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      float v0, v1;
      fp8x2_dequant(pairs[q >> 1] >> (16 * (q & 1)), sv64, false, v0, v1);
      y[8 * h + 2 * q] = mul_rn(v0, sigma);
      y[8 * h + 2 * q + 1] = mul_rn(v1, sigma);
    }
  }
}

// The n (<= 16) cache elements y[i] (float32) rounded to OUT, stored at p (element stride sc).
template <int OUT>
KVW_HD void store_group(u8* p, i64 sc, int n, const float (&y)[16]) {
  constexpr int ES = OUT == DT_F32 ? 4 : 2;
  const Raw<16 * ES> w = round_group<OUT, 16>(y);
  const u64 a = reinterpret_cast<u64>(p);
  if (sc == ES && n == 16 && (a & 15) == 0) {
    store_wide<16 * ES>(p, w);
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if (i < n) {
        Raw<ES> r;
        r.w[0] = ES == 4 ? w.w[i] : (w.w[i >> 1] >> (16 * (i & 1))) & 0xFFFFu;
        store_raw<ES>(p + i * sc, r);
      }
    }
  }
}

// The rule's amax of a group with NaN propagated (nvfp4_part_rule's first argument): on sm_90,
// 16-bit inputs from their raw words (the 16-bit SIMD maximum), else from the floats.
template <int IN>
KVW_HD float page_amax_nan(const Raw<16 * (IN == DT_F32 ? 4 : 2)>& raw, const float (&x)[16]) {
#if !defined(KVWRITE_HOST_TEST) && __CUDA_ARCH__ >= 900
  if constexpr (IN != DT_F32) return nvfp4_amax_nan16<IN == DT_BF16>(raw.w);
#endif
  return nvfp4_amax_nan(x);
}

// The nvfp4 codes of one group (16 elements x; raw: their cache words) in out[0..1] and its
// scale byte in *s8.
template <int IN>
KVW_HD void quantize_group(const Raw<16 * (IN == DT_F32 ? 4 : 2)>& raw, const float (&x)[16],
                           float sigma, const Nvfp4Den& den6, u32 (&out)[4], u32* s8) {
  constexpr int STEPS = IN == DT_F32 ? 2 : 1;  // kvw/fp8.cuh: float32 inputs take two steps
  const float a = page_amax_nan<IN>(raw, x);
  const float a_num = a != a ? nvfp4_amax_num(x) : 0.0f;  // rare: NaN skipped
  u32 codes[2];
  *s8 = nvfp4_part_rule<16, STEPS>(x, a, a_num, sigma, den6, codes);
  out[0] = codes[0];
  out[1] = codes[1];
  out[2] = out[3] = 0u;
}

// Elements of a lane's unit: a group of 16, but in the aligned fp8 variants one 16-byte cache
// vector (16 / ES elements: fp8 codes are per element), so that a warp's loads (pack) and stores
// (unpack) of the cache are 512 contiguous bytes an instruction, not halves of 32-byte sectors
// (transfer_cuda.page_unit_elems says the same).
__host__ __device__ constexpr int page_unit_elems(int fmt, bool aligned, int es) {
  return aligned && fmt != KVW_NVFP4 ? 16 / es : 16;
}

#define KVW_LAYER_SLOT_PARAMS(n) u64 layer##n,
#define KVW_LAYER_SLOT_CASE(n) \
  case n:                      \
    return layer##n;

// The geometry every page launch shares (after the layer slots), then the item decomposition's
// constants: segs = ceil(N*G / (32*U*B)) items a segment (B: page_batches), fdiv's magic numbers
// of the item count of a chunk, K, segs, S and G (transfer_cuda.magic), and `small` (every item
// index and group index below 2^32: the magic numbers serve).
#define KVW_PAGE_PARAMS                                                                         \
  i64 l0, i64 nl, i64 L, i64 S, i64 N, i64 E, i64 K, i64 csb, i64 csh, i64 cst, i64 csc,        \
      i64 cblocks, u64 page, i64 prs, i64 hb, i64 pblocks, i64 segs, u64 m_chunk, u64 m_K,      \
      u64 m_segs, u64 m_S, u64 m_G, i64 small_

#define KVW_LAYER_PTR(li)                                                    \
  [&]() -> u64 {                                                             \
    switch (static_cast<int>(li)) { KVW_XSLOTS(KVW_LAYER_SLOT_CASE) default: break; } \
    return 0;                                                                \
  }()

// Item w of a page launch (per_chunk items a chunk): pair m, chunk k, and the item's index
// within its chunk.
KVW_HD void page_item(u64 w, u64 per_chunk, i64 K, u64 m_chunk, u64 m_K, bool small, u64* m,
                      i64* k, u64* rest) {
  const u64 chunk = fdiv(w, per_chunk, m_chunk, small);
  *rest = w - chunk * per_chunk;
  *m = fdiv(chunk, K, m_K, small);
  *k = static_cast<i64>(chunk - *m * K);
}

// A group item's layer slot li, part s and item within the segment.
KVW_HD void page_segment(u64 rest, i64 segs, i64 S, u64 m_segs, u64 m_S, bool small, i64* li,
                         i64* s, i64* seg) {
  const u64 x = fdiv(rest, segs, m_segs, small);
  *seg = static_cast<i64>(rest - x * segs);
  const u64 q = fdiv(x, S, m_S, small);
  *s = static_cast<i64>(x - q * S);
  *li = static_cast<i64>(q);
}

// A lane's units of a segment, j0, j0 + 32, j0 + 64, ..., each as (token t, unit g of its row
// part of G units): the first by one division (first), each later one 32 units on by adding
// (32 / G, 32 % G) and carrying where g passes G (next): no division or multiply a unit. UI
// (IndexType): u32 in the aligned variants (transfer_cuda.page_align takes them only where
// N * E < 2^32, so t < N and g < G fit), i64 in the general one (one unit a lane: first only).
template <typename UI>
struct UnitWalk {
  UI t, g;
  KVW_HD void first(i64 j0, i64 G, u64 m_G, bool small) {
    const u64 q = fdiv(static_cast<u64>(j0), G, m_G, small);
    t = static_cast<UI>(q);
    g = static_cast<UI>(static_cast<u64>(j0) - q * G);
  }
  KVW_HD void next(UI G, int dt, int dg) {
    g += dg;
    t += dt;
    if (g >= G) {
      g -= G;
      ++t;
    }
  }
};

// transfer_pack_kernel<FMT, IN, IDX, ALIGN, U>: caches of kind IN (DT_F16/DT_BF16/DT_F32) ->
// chunks of format FMT (DT_E4M3, DT_E5M2, KVW_NVFP4). Pair m = (cache block b, page row p).
// scale: float32, sigma(l, s) of chunk k at scale[l*ss0 + s*ss1 + k*ss2] (the launcher's pointer
// includes the scale's offset). At most 64 registers a thread (1024-thread CTAs).
template <int FMT, int IN, typename IDX, int ALIGN, int U>
__global__ void __launch_bounds__(1024)
    transfer_pack_kernel(const IDX* __restrict__ mapping, i64 ms0, i64 ms1, i64 pairs,
                         const float* __restrict__ scale, i64 ss0, i64 ss1, i64 ss2,
                         KVW_XSLOTS(KVW_LAYER_SLOT_PARAMS) KVW_PAGE_PARAMS) {
  KVW_PDL_ENTRY();
  constexpr bool ALIGNED = ALIGN != 0;
  static_assert(ALIGNED || U == 1, "the general variant takes one unit a lane");
  constexpr int ES = IN == DT_F32 ? 4 : 2;
  constexpr int UE = page_unit_elems(FMT, ALIGNED, ES);
  constexpr int B = page_batches(FMT, true);
  const bool small = small_ != 0;
  const i64 G = (E + UE - 1) / UE;  // units a row part
  const i64 NG = N * G;
  using UI = typename IndexType<ALIGNED>::type;
  const int dt = G > 32 ? 0 : 32 / static_cast<int>(G), dg = 32 - dt * static_cast<int>(G);
  const u64 X = static_cast<u64>(nl) * S * segs;  // group items a chunk
  const u64 per_chunk = X + (l0 == 0 ? 1 : 0);    // and the header item
  const u64 total = static_cast<u64>(pairs) * K * per_chunk;
  const i64 codes_at = 4 * L * S;
  const i64 lnc = L * N * S * E;
  const i64 used = FMT == KVW_NVFP4 ? codes_at + lnc / 2 + lnc / 16 : codes_at + lnc;
  const i64 lane = threadIdx.x & 31;
  const u64 warps = blockDim.x >> 5;
  for (u64 w = static_cast<u64>(blockIdx.x) * warps + (threadIdx.x >> 5); w < total;
       w += static_cast<u64>(gridDim.x) * warps) {
    u64 m, rest;
    i64 k;
    page_item(w, per_chunk, K, m_chunk, m_K, small, &m, &k, &rest);
    i64 b, p;
    read_pair(mapping, ms0, ms1, m, &b, &p);
    if (b < 0 || b >= cblocks || p < 0 || p >= pblocks) continue;
    u8* cbase = reinterpret_cast<u8*>(page + p * prs + k * hb);
    if (rest >= X) {  // the header: sigma(l, s), lanes over them; the zero tail, a lane a byte
      for (i64 h = lane; h < L * S; h += 32) {
        const i64 l = static_cast<i64>(fdiv(h, S, m_S, small));
        const u32 v = f32_bits(scale[l * ss0 + (h - l * S) * ss1 + k * ss2]);
        if constexpr (ALIGNED) {
          *reinterpret_cast<u32*>(cbase + 4 * h) = v;
        } else {
          const u32 word[4] = {v, 0u, 0u, 0u};
          store_bytes(cbase + 4 * h, 4, word);
        }
      }
      if (lane < hb - used) cbase[used + lane] = 0;
      continue;
    }
    i64 li, s, seg;
    page_segment(rest, segs, S, m_segs, m_S, small, &li, &s, &seg);
    const i64 l = l0 + li;
    const i64 r0 = (l * S + s) * N;  // the segment's first row
    const u8* src = reinterpret_cast<const u8*>(KVW_LAYER_PTR(li) + b * csb + k * csh +
                                                s * E * csc);
    const float sigma = scale[l * ss0 + s * ss1 + k * ss2];
    Fp8Fast16 ff;
    Nvfp4Den den6;
#pragma unroll 1
    for (int bt = 0; bt < B; ++bt) {  // the item's batches of 32 * U units
      const i64 j0 = (seg * B + bt) * (32 * U) + lane;
      if (B > 1 && j0 - lane >= NG) break;  // (one batch: never past the segment)
      UnitWalk<UI> w0;
      w0.first(j0, G, m_G, small);
      Raw<UE * ES> raw[U];
      if constexpr (ALIGNED) {  // every load first
        UnitWalk<UI> at = w0;
#pragma unroll
        for (int u = 0; u < U; ++u, at.next(G, dt, dg))
          if (at.t < N) raw[u] = load_wide<UE * ES>(src + at.t * cst + at.g * (UE * ES));
      }
      if (bt == 0) {  // the scale's constants, while the first batch's loads are in flight
        if constexpr (FMT == KVW_NVFP4) {
          den6 = nvfp4_den(mul_rn(sigma, 6.0f));
        } else {  // fp8_quantize_fast16 where sigma is in its range, else the exact quotient
          ff = fp8_fast16_scale<IN>(sigma);
        }
      }
      UnitWalk<UI> at = w0;
#pragma unroll
      for (int u = 0; u < U; ++u, at.next(G, dt, dg)) {
        if (at.t >= N) break;  // unit j0 + 32 * u past the segment's N * G
        const i64 t = at.t, e0 = UE * static_cast<i64>(at.g);
        const int n = static_cast<int>(E - e0 < UE ? E - e0 : UE);
        if constexpr (!ALIGNED) raw[u] = load_group<IN>(src + t * cst + e0 * csc, csc, n);
        if constexpr (FMT == KVW_NVFP4) {
          float x[UE];
#pragma unroll
          for (int i = 0; i < UE; ++i) x[i] = elem_f32<IN>(raw[u], i);
          u32 out[4], s8;
          quantize_group<IN>(raw[u], x, sigma, den6, out, &s8);
          const i64 r = r0 + t;
          u8* codes = cbase + codes_at + (r * E + e0) / 2;
          if constexpr (ALIGNED) {
            Raw<8> c;
            c.w[0] = out[0];
            c.w[1] = out[1];
            store_aligned<8, ALIGN>(codes, c);
          } else {
            store_bytes(codes, 8, out);
          }
          cbase[codes_at + lnc / 2 + r * (E / 16) + e0 / 16] = static_cast<u8>(s8);
        } else {
          // The unit's UE codes (fp8_fast16_or_quotient: the quotient's m and s2 again a unit;
          // held beside ff for the item, they spilled).
          const Raw<UE * ES> unit[1] = {raw[u]};
          Raw<UE> c[1];
          fp8_fast16_or_quotient<IN, FMT, UE, 1>(unit, c, ff);
          const i64 r = r0 + t;
          u8* codes = cbase + codes_at + r * E + e0;
          if constexpr (ALIGNED) {
            store_aligned<UE, (ALIGN < UE ? ALIGN : UE)>(codes, c[0]);
          } else {
            store_bytes(codes, n, c[0].w);
          }
        }
      }
    }
  }
}

// transfer_unpack_kernel<FMT, OUT, IDX, ALIGN, U>: chunks of format FMT -> caches of kind OUT.
// Pair m = (page row p, cache block b). fp8: D(code, sigma) = RN(decode(code) * sigma) (SPEC
// §8.2; fp8x2_dequant, the hardware decode on sm_89 and later), then OUT; nvfp4:
// RN(value(c) * float(S) * sigma) (value(c) * float(S) exact, SPEC §6.4), then OUT. At most 64
// registers a thread (1024-thread CTAs).
template <int FMT, int OUT, typename IDX, int ALIGN, int U>
__global__ void __launch_bounds__(1024)
    transfer_unpack_kernel(const IDX* __restrict__ mapping, i64 ms0, i64 ms1, i64 pairs,
                           KVW_XSLOTS(KVW_LAYER_SLOT_PARAMS) KVW_PAGE_PARAMS) {
  KVW_PDL_ENTRY();
  constexpr bool ALIGNED = ALIGN != 0;
  static_assert(ALIGNED || U == 1, "the general variant takes one unit a lane");
  constexpr int ES = OUT == DT_F32 ? 4 : 2;
  constexpr int UE = page_unit_elems(FMT, ALIGNED, ES);
  constexpr int CB = FMT == KVW_NVFP4 ? 8 : UE;  // code bytes of a whole unit
  constexpr int CA = ALIGN < CB ? ALIGN : CB;     // their alignment (aligned variants)
  constexpr int B = page_batches(FMT, false);
  const bool small = small_ != 0;
  const i64 G = (E + UE - 1) / UE;  // units a row part
  const i64 NG = N * G;
  using UI = typename IndexType<ALIGNED>::type;
  const int dt = G > 32 ? 0 : 32 / static_cast<int>(G), dg = 32 - dt * static_cast<int>(G);
  const u64 per_chunk = static_cast<u64>(nl) * S * segs;
  const u64 total = static_cast<u64>(pairs) * K * per_chunk;
  const i64 codes_at = 4 * L * S;
  const i64 lnc = L * N * S * E;
  const i64 lane = threadIdx.x & 31;
  const u64 warps = blockDim.x >> 5;
  for (u64 w = static_cast<u64>(blockIdx.x) * warps + (threadIdx.x >> 5); w < total;
       w += static_cast<u64>(gridDim.x) * warps) {
    u64 m, rest;
    i64 k;
    page_item(w, per_chunk, K, m_chunk, m_K, small, &m, &k, &rest);
    i64 p, b;
    read_pair(mapping, ms0, ms1, m, &p, &b);
    if (b < 0 || b >= cblocks || p < 0 || p >= pblocks) continue;
    const u8* cbase = reinterpret_cast<const u8*>(page + p * prs + k * hb);
    i64 li, s, seg;
    page_segment(rest, segs, S, m_segs, m_S, small, &li, &s, &seg);
    const i64 l = l0 + li;
    const i64 r0 = (l * S + s) * N;  // the segment's first row
    const u8* codes = FMT == KVW_NVFP4 ? cbase + codes_at + r0 * E / 2 : cbase + codes_at + r0 * E;
    const u8* scales = cbase + codes_at + lnc / 2 + r0 * (E / 16);  // nvfp4
    // The cache side's address: before the batches where there are several, else after the
    // batch's loads (each placement the build measured: tuning-log 90).
    u8* dst = nullptr;
    if constexpr (B > 1)
      dst = reinterpret_cast<u8*>(KVW_LAYER_PTR(li) + b * csb + k * csh + s * E * csc);
    float sigma;
#pragma unroll 1
    for (int bt = 0; bt < B; ++bt) {  // the item's batches of 32 * U units
      const i64 j0 = (seg * B + bt) * (32 * U) + lane;
      if (B > 1 && j0 - lane >= NG) break;  // (one batch: never past the segment)
      Raw<16> raw[U];
      u32 s8[U];
      if constexpr (ALIGNED) {  // every load first: unit j's codes at j * CB
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const i64 j = j0 + 32 * u;
          if (j < NG) {
            const Raw<CB> c = load_aligned<CB, CA>(codes + j * CB);
#pragma unroll
            for (int i = 0; i < CB / 4; ++i) raw[u].w[i] = c.w[i];
            if constexpr (FMT == KVW_NVFP4) s8[u] = scales[j];
          }
        }
      }
      if (bt == 0) {  // the chunk's sigma, after the first batch's loads
        const u8* sig_at = cbase + 4 * (l * S + s);
        sigma = ALIGNED ? bits_f32(load_raw<4>(sig_at).w[0]) : load_f32_any(sig_at);
        if constexpr (B == 1)
          dst = reinterpret_cast<u8*>(KVW_LAYER_PTR(li) + b * csb + k * csh + s * E * csc);
      }
      UnitWalk<UI> wk;
      wk.first(j0, G, m_G, small);
#pragma unroll
      for (int u = 0; u < U; ++u, wk.next(G, dt, dg)) {
        if (wk.t >= N) break;  // unit j0 + 32 * u past the segment's N * G
        const i64 t = wk.t, g = wk.g, e0 = UE * g;
        const int n = static_cast<int>(E - e0 < UE ? E - e0 : UE);
        if constexpr (!ALIGNED) {
          if constexpr (FMT == KVW_NVFP4) {
            load_bytes(codes + (t * E + e0) / 2, 8, raw[u].w);
            s8[u] = scales[t * (E / 16) + g];
          } else {
            load_bytes(codes + t * E + e0, n, raw[u].w);
          }
        }
        float y[UE];
        if constexpr (FMT == KVW_NVFP4) {
          nvfp4_group_values(raw[u].w, mul_rn(fp8_decode<DT_E4M3>(s8[u]), 64.0f), sigma, y);
        } else {
#pragma unroll
          for (int i = 0; i < UE; i += 2)
            fp8x2_dequant(raw[u].w[i >> 2] >> (8 * (i & 2)), sigma, FMT == DT_E5M2, y[i],
                          y[i + 1]);
        }
        u8* at = dst + t * cst + e0 * csc;
        if constexpr (ALIGNED) {
          store_wide<UE * ES>(at, round_group<OUT>(y));
        } else {
          store_group<OUT>(at, csc, n, y);
        }
      }
    }
  }
}
