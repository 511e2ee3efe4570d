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

// Slots per launch (transfer_cuda.SLOTS says the same).
#define KVW_SLOTS 32
#define KVW_X32(X)                                                                              \
  X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15) X(16)  \
  X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24) X(25) X(26) X(27) X(28) X(29) X(30) X(31)

// a / b and a % b for 64-bit counts, in 32-bit arithmetic where both fit (the common case; a
// 64-bit division is a long software sequence).
KVW_HD u64 udiv(u64 a, u64 b) {
  return ((a | b) >> 32) == 0 ? static_cast<u64>(static_cast<u32>(a) / static_cast<u32>(b))
                              : a / b;
}

// n / d for n, d < 2^32 by one high multiply: magic = ceil(2^64 / d) for d >= 2 (then
// n * magic / 2^64 exceeds n / d by less than 2^-32 <= 1/d, never reaching the next integer), 0
// for d == 1 (transfer_cuda.magic). Where the launch's count of vectors is 2^32 or more
// (`small` false) the division itself.
KVW_HD u64 fdiv(u64 n, u64 d, u64 magic, bool small) {
  if (small) return magic == 0 ? n : __umul64hi(n, magic);
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
                                     KVW_X32(KVW_COPY_SLOT_PARAMS) i64 njobs, i64 ssb, i64 ssh,
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
    switch (static_cast<int>(q)) { KVW_X32(KVW_COPY_SLOT_CASE) default: break; }
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
// rows of the (job, pair, head, token) index: row base + k * (32 / LANES) + l / LANES of lane l
// at k < U, so each of the U loads of the warp covers 32 / LANES whole consecutive rows. Each
// lane decomposes each of its rows and reads its mapping pair itself (the lanes of a group read
// the same pair: one broadcast load; consecutive rows mostly share their pair, L1 hits), all U
// mapping reads before the first row load (a row's load waits for its pair, and an asm volatile
// load stays in order: a pair read between two row loads would serialize the round trips), then
// the U row loads (ld.volatile), then the U stores: U * VB bytes in flight per lane, as the
// segment kernel's. Measured (H200, change 72): rows of 512 B (nvec 32) moved as one segment
// per warp (U = 1) ran at 74% of a device copy, rows of 256 B (16 vectors, half the warp idle)
// at 41%.
// ------------------------------------------------------------------------------------------
template <int VB, typename IDX, int U, int LANES>
__global__ void __launch_bounds__(1024) transfer_copy_rows_kernel(
    const IDX* __restrict__ mapping, i64 ms0, i64 ms1, i64 pairs,
    KVW_X32(KVW_COPY_SLOT_PARAMS) i64 njobs, i64 ssb, i64 ssh, i64 sst, i64 ssc, i64 dsb, i64 dsh,
    i64 dst_, i64 dsc, i64 sblocks, i64 dblocks, i64 heads, i64 tokens, i64 nvec, i64 ppe_shift,
    i64 segs, u64 m_segs, u64 m_tokens, u64 m_heads, u64 m_pairs) {
  static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0,
                "LANES: a power of two up to 32");
  KVW_PDL_ENTRY();
  constexpr int ROWS = 32 / LANES;  // rows a warp's load covers
  const u64 total = static_cast<u64>(njobs) * pairs * heads * tokens;  // rows
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
    // takes ids (-1, -1), outside every side.
    u64 sb[U], db[U];
    i64 i[U], j[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const u64 r = r0 + static_cast<u64>(k) * ROWS;
      i[k] = -1;
      j[k] = -1;
      sb[k] = 0;
      db[k] = 0;
      if (active && r < total) {
        u64 q = fdiv(r, tokens, m_tokens, small);
        const i64 t = static_cast<i64>(r - q * tokens);
        u64 p = fdiv(q, heads, m_heads, small);
        const i64 h = static_cast<i64>(q - p * heads);
        q = fdiv(p, pairs, m_pairs, small);
        read_pair(mapping, ms0, ms1, p - q * pairs, &i[k], &j[k]);
        u64 s = 0, d = 0;
        switch (static_cast<int>(q)) { KVW_X32(KVW_COPY_SLOT_CASE) default: break; }
        sb[k] = s + h * ssh + t * sst + vs;
        db[k] = d + h * dsh + t * dst_ + vd;
      }
    }
    Raw<VB> x[U];
    bool ok[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      ok[k] = i[k] >= 0 && i[k] < sblocks && j[k] >= 0 && j[k] < dblocks;
      if (ok[k]) x[k] = load_raw_volatile<VB>(reinterpret_cast<const u8*>(sb[k] + i[k] * ssb));
      db[k] += j[k] * dsb;
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      if (ok[k]) store_raw<VB>(reinterpret_cast<u8*>(db[k]), x[k]);
    }
  }
}

// ------------------------------------------------------------------------------------------
// Quantized pages (SPEC §9.4). Head chunk k of page row p starts at
// page + p*prs + k*hb; in it: float32 sigma(l, s) at 4*(l*S + s), then the codes from 4*L*S
// (fp8: element q = r*E + e at q; nvfp4: element q's nibble in byte q / 2, low nibble when e is
// even, then the scale byte of group g of row r at L*N*C/2 + r*E/16 + g), zeros to hb.
// Row r = (l*S + s)*N + t; cache element (l, t, s*E + e) of cache head k.
//
// A work item is one group of 16 elements of a row part (fp8: the last group of a part may be
// shorter, E % 16 elements; nvfp4: E % 16 == 0). One launch covers the layers of its slots
// (layers l0 .. l0 + nl - 1, one set of cache strides: the launcher splits the layers into runs
// of equal strides of at most KVW_SLOTS); the pack launch with l0 == 0 also writes each chunk's
// sigma header (L*S items a chunk) and zero tail (with the header's first float), so those bytes
// are written once whatever the number of launches.
//
// The page side's addresses have any alignment (the row stride is free): page accesses take the
// widest of 16/4/1 bytes their address allows at run time. Cache elements are read (written) as
// one vector where the part is dense (sc == element size) and the address allows, else one by one.
// ------------------------------------------------------------------------------------------

// n bytes (n <= 16) at p into / from little-endian words w[4].
KVW_HD void load_bytes(const u8* p, int n, u32 (&w)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = 0;
  const u64 a = reinterpret_cast<u64>(p);
  if (n == 16 && (a & 15) == 0) {
    const Raw<16> r = load_raw<16>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = r.w[i];
  } else if ((a & 3) == 0 && (n & 3) == 0) {
    for (int i = 0; i < n / 4; ++i) w[i] = reinterpret_cast<const u32*>(p)[i];
  } else {
    for (int i = 0; i < n; ++i) w[i >> 2] |= static_cast<u32>(p[i]) << (8 * (i & 3));
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
    for (int i = 0; i < n / 4; ++i) reinterpret_cast<u32*>(p)[i] = w[i];
  } else {
    for (int i = 0; i < n; ++i) p[i] = static_cast<u8>(w[i >> 2] >> (8 * (i & 3)));
  }
}

KVW_HD float load_f32_any(const u8* p) {
  u32 w[4];
  load_bytes(p, 4, w);
  return bits_f32(w[0]);
}

// Element i (i < 16) of a 16-element chunk of ES-byte elements held as 16 * ES / 4 words.
template <int ES>
KVW_HD u32 chunk_elem(const u32 (&w)[4 * ES], int i) {
  if constexpr (ES == 4) {
    return w[i];
  } else {
    return (w[i >> 1] >> (16 * (i & 1))) & 0xFFFFu;
  }
}

// The n (<= 16) cache elements of a group: x[i] as float32 (0 past n).
template <int IN>
KVW_HD void load_group(const u8* p, i64 sc, int n, float (&x)[16]) {
  constexpr int ES = IN == DT_F32 ? 4 : 2;
  u32 w[4 * ES];
#pragma unroll
  for (int i = 0; i < 4 * ES; ++i) w[i] = 0;
  const u64 a = reinterpret_cast<u64>(p);
  if (sc == ES && n == 16 && (a & 15) == 0) {
#pragma unroll
    for (int v = 0; v < ES; ++v) {
      const Raw<16> r = load_raw<16>(p + 16 * v);
#pragma unroll
      for (int i = 0; i < 4; ++i) w[4 * v + i] = r.w[i];
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if (i < n) {
        const Raw<ES> r = load_raw<ES>(p + i * sc);
        if constexpr (ES == 4) {
          w[i] = r.w[0];
        } else {
          w[i >> 1] |= r.w[0] << (16 * (i & 1));
        }
      }
    }
  }
  Raw<4 * ES * 4> raw;
#pragma unroll
  for (int i = 0; i < 4 * ES; ++i) raw.w[i] = w[i];
#pragma unroll
  for (int i = 0; i < 16; ++i) x[i] = elem_f32<IN>(raw, i);
}

// The n (<= 16) cache elements y[i] (float32) rounded to OUT, stored.
template <int OUT>
KVW_HD void store_group(u8* p, i64 sc, int n, const float (&y)[16]) {
  constexpr int ES = OUT == DT_F32 ? 4 : 2;
  u32 w[4 * ES];
#pragma unroll
  for (int i = 0; i < 4 * ES; ++i) w[i] = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    if constexpr (ES == 4) {
      w[i] = f32_bits(y[i]);
    } else {
      w[i >> 1] |= f16ish_from_f32<OUT>(y[i]) << (16 * (i & 1));
    }
  }
  const u64 a = reinterpret_cast<u64>(p);
  if (sc == ES && n == 16 && (a & 15) == 0) {
#pragma unroll
    for (int v = 0; v < ES; ++v) {
      Raw<16> r;
#pragma unroll
      for (int i = 0; i < 4; ++i) r.w[i] = w[4 * v + i];
      store_raw<16>(p + 16 * v, r);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if (i < n) {
        Raw<ES> r;
        r.w[0] = chunk_elem<ES>(w, i);
        store_raw<ES>(p + i * sc, r);
      }
    }
  }
}

#define KVW_LAYER_SLOT_PARAMS(n) u64 layer##n,
#define KVW_LAYER_SLOT_CASE(n) \
  case n:                      \
    return layer##n;

// The geometry every page launch shares (after the layer slots).
#define KVW_PAGE_PARAMS                                                                         \
  i64 l0, i64 nl, i64 L, i64 S, i64 N, i64 E, i64 K, i64 csb, i64 csh, i64 cst, i64 csc,        \
      i64 cblocks, u64 page, i64 prs, i64 hb, i64 pblocks

#define KVW_LAYER_PTR(li)                                                    \
  [&]() -> u64 {                                                             \
    switch (static_cast<int>(li)) { KVW_X32(KVW_LAYER_SLOT_CASE) default: break; } \
    return 0;                                                                \
  }()

// transfer_pack_kernel<FMT, IN, IDX>: caches of kind IN (DT_F16/DT_BF16/DT_F32) -> chunks of
// format FMT (DT_E4M3, DT_E5M2, KVW_NVFP4). Pair m = (cache block b, page row p). scale: float32,
// sigma(l, s) of chunk k at scale[l*ss0 + s*ss1 + k*ss2] (the launcher's pointer includes the
// scale's offset).
template <int FMT, int IN, typename IDX>
__global__ void transfer_pack_kernel(const IDX* __restrict__ mapping, i64 ms0, i64 ms1,
                                     i64 pairs, const float* scale, i64 ss0, i64 ss1, i64 ss2,
                                     KVW_X32(KVW_LAYER_SLOT_PARAMS) KVW_PAGE_PARAMS) {
  KVW_PDL_ENTRY();
  constexpr int STEPS = IN == DT_F32 ? 2 : 1;  // kvw/fp8.cuh: float32 inputs take two steps
  const i64 G = (E + 15) / 16;                  // groups a row part
  const u64 X = static_cast<u64>(nl) * S * N * G;
  const u64 H = l0 == 0 ? static_cast<u64>(L) * S : 0;
  const u64 per_chunk = X + H;
  const u64 total = static_cast<u64>(pairs) * K * per_chunk;
  const i64 codes_at = 4 * L * S;
  const i64 lnc = L * N * S * E;
  const i64 used = FMT == KVW_NVFP4 ? codes_at + lnc / 2 + lnc / 16 : codes_at + lnc;
  for (u64 u = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x; u < total;
       u += static_cast<u64>(gridDim.x) * blockDim.x) {
    const u64 chunk = udiv(u, per_chunk);
    const u64 w = u - chunk * per_chunk;
    const u64 m = udiv(chunk, K);
    const i64 k = static_cast<i64>(chunk - m * K);
    i64 b, p;
    read_pair(mapping, ms0, ms1, m, &b, &p);
    if (b < 0 || b >= cblocks || p < 0 || p >= pblocks) continue;
    u8* cbase = reinterpret_cast<u8*>(page + p * prs + k * hb);
    if (w >= X) {  // the header: sigma(l, s); with the first, the zero tail
      const i64 h = static_cast<i64>(w - X);
      const i64 l = h / S, s = h - (h / S) * S;
      u32 word[4] = {f32_bits(scale[l * ss0 + s * ss1 + k * ss2]), 0u, 0u, 0u};
      store_bytes(cbase + 4 * h, 4, word);
      if (h == 0) {
        const u32 zero[4] = {0u, 0u, 0u, 0u};
        store_bytes(cbase + used, static_cast<int>(hb - used), zero);
      }
      continue;
    }
    u64 q = udiv(w, G);
    const i64 g = static_cast<i64>(w - q * G);
    u64 r2 = udiv(q, N);
    const i64 t = static_cast<i64>(q - r2 * N);
    q = udiv(r2, S);
    const i64 s = static_cast<i64>(r2 - q * S);
    const i64 li = static_cast<i64>(q), l = l0 + li;
    const i64 e0 = 16 * g;
    const int n = static_cast<int>(E - e0 < 16 ? E - e0 : 16);
    const u64 lp = KVW_LAYER_PTR(li);
    float x[16];
    load_group<IN>(reinterpret_cast<const u8*>(lp + b * csb + k * csh + t * cst +
                                               (s * E + e0) * csc),
                   csc, n, x);
    const float sigma = scale[l * ss0 + s * ss1 + k * ss2];
    const i64 row = (l * S + s) * N + t;
    if constexpr (FMT == KVW_NVFP4) {
      const Nvfp4Den den6 = nvfp4_den(mul_rn(sigma, 6.0f));
      u32 out[2];
      const u32 S8 = nvfp4_group<false, STEPS>(x, sigma, den6, den6, out);
      u32 word[4] = {out[0], out[1], 0u, 0u};
      store_bytes(cbase + codes_at + (row * E + e0) / 2, 8, word);
      cbase[codes_at + lnc / 2 + row * (E / 16) + g] = static_cast<u8>(S8);
    } else {
      const Fp8Scale sc = make_fp8_scale<true, false>(sigma);
      u32 out[4];
      fp8_quantize<FMT, 16, STEPS>(x, out, sc);
      store_bytes(cbase + codes_at + row * E + e0, n, out);
    }
  }
}

// transfer_unpack_kernel<FMT, OUT, IDX>: chunks of format FMT -> caches of kind OUT. Pair m =
// (page row p, cache block b). fp8: D(code, sigma) = RN(decode(code) * sigma) (SPEC §8.2), then
// OUT; nvfp4: RN(value(c) * float(S) * sigma) (value(c) * float(S) exact, SPEC §6.4), then OUT.
template <int FMT, int OUT, typename IDX>
__global__ void transfer_unpack_kernel(const IDX* __restrict__ mapping, i64 ms0, i64 ms1,
                                       i64 pairs, KVW_X32(KVW_LAYER_SLOT_PARAMS) KVW_PAGE_PARAMS) {
  KVW_PDL_ENTRY();
  const i64 G = (E + 15) / 16;
  const u64 per_chunk = static_cast<u64>(nl) * S * N * G;
  const u64 total = static_cast<u64>(pairs) * K * per_chunk;
  const i64 codes_at = 4 * L * S;
  const i64 lnc = L * N * S * E;
  for (u64 u = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x; u < total;
       u += static_cast<u64>(gridDim.x) * blockDim.x) {
    const u64 chunk = udiv(u, per_chunk);
    const u64 w = u - chunk * per_chunk;
    const u64 m = udiv(chunk, K);
    const i64 k = static_cast<i64>(chunk - m * K);
    i64 p, b;
    read_pair(mapping, ms0, ms1, m, &p, &b);
    if (b < 0 || b >= cblocks || p < 0 || p >= pblocks) continue;
    const u8* cbase = reinterpret_cast<const u8*>(page + p * prs + k * hb);
    u64 q = udiv(w, G);
    const i64 g = static_cast<i64>(w - q * G);
    u64 r2 = udiv(q, N);
    const i64 t = static_cast<i64>(q - r2 * N);
    q = udiv(r2, S);
    const i64 s = static_cast<i64>(r2 - q * S);
    const i64 li = static_cast<i64>(q), l = l0 + li;
    const i64 e0 = 16 * g;
    const int n = static_cast<int>(E - e0 < 16 ? E - e0 : 16);
    const i64 row = (l * S + s) * N + t;
    const float sigma = load_f32_any(cbase + 4 * (l * S + s));
    float y[16];
    if constexpr (FMT == KVW_NVFP4) {
      u32 word[4];
      load_bytes(cbase + codes_at + (row * E + e0) / 2, 8, word);
      const float sv = fp8_decode<DT_E4M3>(cbase[codes_at + lnc / 2 + row * (E / 16) + g]);
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const u32 c = (word[i >> 3] >> (4 * (i & 7))) & 0xFu;
        const float mag = nvfp4_value_mag(bits_f32(0x4B000000u | (c & 7u)));
        const float v = bits_f32(f32_bits(mag) | ((c & 8u) << 28));
        y[i] = mul_rn(mul_rn(v, sv), sigma);
      }
    } else {
      u32 word[4];
      load_bytes(cbase + codes_at + row * E + e0, n, word);
#pragma unroll
      for (int i = 0; i < 16; ++i) y[i] = fp8_dequant<FMT>((word[i >> 2] >> (8 * (i & 3))) & 0xFFu,
                                                          sigma);
    }
    const u64 lp = KVW_LAYER_PTR(li);
    store_group<OUT>(reinterpret_cast<u8*>(lp + b * csb + k * csh + t * cst + (s * E + e0) * csc),
                     csc, n, y);
  }
}
