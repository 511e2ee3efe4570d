// kvwrite: write new key/value rows into a paged KV cache (reshape_and_cache_flash, SPEC §1).
//
// Compiled at run time with NVRTC (see cuda_impl.py); one module per instantiation of
// `reshape_and_cache_flash_kernel<IN, OUT, VEC, SlotT>` (no loops; every call whose row fits
// its grid) or `reshape_and_cache_flash_grid_stride_kernel<...>` (the rest), and per call
// signature when the fixed arguments are compiled in (KVWRITE_FIXED_ARGS). Includes no headers
// at all (neither torch nor CUDA), so NVRTC needs no toolkit include directory: raw pointers,
// 64-bit strides and sizes, conversions through inline PTX or integer bit operations.
//
// With -DKVWRITE_HOST_TEST the file compiles as plain host C++ (g++): only the element
// conversions remain, with their software fp8 paths, so tests can check them on the CPU.

#ifdef KVWRITE_HOST_TEST
#define KVW_HD inline
#else
#define KVW_HD __device__ __forceinline__
#endif

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

// Element kinds: template arguments IN (input) and OUT (cache). DT_COPY moves the input bits
// unchanged (kv_cache_dtype "auto", or a cache of the input's own dtype).
#define DT_F16 0
#define DT_BF16 1
#define DT_F32 2
#define DT_E4M3 3
#define DT_E5M2 4
#define DT_COPY 5

// -DKVWRITE_EXACT_DIV makes `fp8_quantize` divide each element with div.rn.f32 instead of the
// division-free quotient below (both are bit-exact; the option exists for comparison).

// ------------------------------------------------------------------------------------------
// Bit casts and IEEE arithmetic that no compiler flag can change (no FMA contraction, no
// fast-math, no flush to zero).
// ------------------------------------------------------------------------------------------
#ifdef KVWRITE_HOST_TEST
KVW_HD u32 f32_bits(float f) { u32 u; __builtin_memcpy(&u, &f, 4); return u; }
KVW_HD float bits_f32(u32 u) { float f; __builtin_memcpy(&f, &u, 4); return f; }
// Host builds use -ffp-contract=off; x86-64 SSE arithmetic is IEEE round-to-nearest-even.
KVW_HD float div_rn(float a, float b) { return a / b; }
KVW_HD float mul_rn(float a, float b) { return a * b; }
KVW_HD float fma_rn(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
// min(a, b) that returns NaN when a is NaN (b is a constant here).
KVW_HD float min_nan(float a, float b) { return a > b ? b : a; }
#else
KVW_HD u32 f32_bits(float f) { return __float_as_uint(f); }
KVW_HD float bits_f32(u32 u) { return __uint_as_float(u); }
KVW_HD float div_rn(float a, float b) {
  float q;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(q) : "f"(a), "f"(b));
  return q;
}
KVW_HD float mul_rn(float a, float b) {
  float p;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(p) : "f"(a), "f"(b));
  return p;
}
KVW_HD float fma_rn(float a, float b, float c) {
  float r;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
}
KVW_HD float min_nan(float a, float b) {
#if __CUDA_ARCH__ >= 800
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a > b ? b : a;
#endif
}
#endif

// ------------------------------------------------------------------------------------------
// float32 -> fp8, software: round to nearest even, saturate to the largest finite value (±inf
// too), NaN -> NaN (sign|0x7F), sign of zero kept, subnormals rounded. Exactly
// `x.clamp(-MAX, MAX).to(fp8)` (SPEC §1.1), i.e. CUDA's __NV_SATFINITE conversion.
// FMT is DT_E4M3 (e4m3fn: bias 7, 3 mantissa bits, max 448 = 0x7E) or DT_E5M2 (bias 15,
// 2 mantissa bits, max 57344 = 0x7B). Returns the byte in the low 8 bits.
// ------------------------------------------------------------------------------------------
template <int FMT>
KVW_HD u32 fp8_from_f32_soft(float x) {
  constexpr u32 MAN = FMT == DT_E4M3 ? 3 : 2;
  constexpr u32 BIAS = FMT == DT_E4M3 ? 7 : 15;
  constexpr u32 MAX_F32_BITS = FMT == DT_E4M3 ? 0x43E00000u : 0x47600000u;  // 448, 57344
  constexpr u32 MAX_CODE = FMT == DT_E4M3 ? 0x7Eu : 0x7Bu;
  constexpr u32 MIN_NORMAL_F32_BITS = (127u + 1u - BIAS) << 23;  // 2^(1 - BIAS)
  const u32 b = f32_bits(x);
  const u32 sign = (b >> 24) & 0x80u;
  const u32 a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7Fu;  // NaN
  // Clamping then rounding equals rounding then saturating: MAX is representable and rounding
  // is monotone. Inputs below MAX never round past it (the next step up is >= MAX's midpoint).
  if (a >= MAX_F32_BITS) return sign | MAX_CODE;
  if (a >= MIN_NORMAL_F32_BITS) {
    // Round the float32 bits to MAN mantissa bits (a carry moves into the exponent, as it
    // should), then rebias the exponent.
    constexpr u32 SH = 23 - MAN;
    const u32 r = a + ((1u << (SH - 1)) - 1u) + ((a >> SH) & 1u);
    return sign | ((r >> SH) - ((127u - BIAS) << MAN));
  }
  // fp8 subnormal range: the code is k = round(|x| / 2^(1 - BIAS - MAN)), k in [0, 2^MAN]
  // (k == 2^MAN is the smallest normal, whose code is exactly 2^MAN). |x| = m * 2^(e - 150).
  const u32 e_field = a >> 23;
  const u32 m = (a & 0x7FFFFFu) | (e_field ? 0x800000u : 0u);
  const u32 e = e_field ? e_field : 1u;
  const u32 sh = 151u - BIAS - MAN - e;  // >= 21: m < 2^24, so no overflow below
  if (sh >= 26) return sign;             // |x| < 2^-1 units: rounds to zero
  const u32 r = m + ((1u << (sh - 1)) - 1u) + ((m >> sh) & 1u);
  return sign | (r >> sh);
}

// float32 -> bfloat16, round to nearest even (NaN -> 0x7FFF, as cvt.rn.bf16.f32 does).
KVW_HD u32 bf16_from_f32_soft(float x) {
  const u32 b = f32_bits(x);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;
  return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
}

// Two fp8 codes: byte 0 = Q(lo), byte 1 = Q(hi) (the order of the elements in memory).
template <int FMT>
KVW_HD u32 fp8x2_from_f32(float lo, float hi) {
#if !defined(KVWRITE_HOST_TEST) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  u16 r;
  if (FMT == DT_E4M3)
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return fp8_from_f32_soft<FMT>(lo) | (fp8_from_f32_soft<FMT>(hi) << 8);
#endif
}

// RN(1 / b) for b in [2^-22, 4) (make_fp8_scale's s2), branch-free. div.rn.f32 wraps the same
// arithmetic in a range check (FCHK) and a branch to a slow-path call, which ptxas cannot
// overlap: a thread's two scales were prepared one after the other on every fp8 thread's path.
// Here: the hardware approximation (within 2 ulp in this range), two fused Newton steps, and
// the one significand they miss: for b = (2 - 2^-23) * 2^k, 1/b lies just above the midpoint
// between 2^(-k-1) and its successor, the steps land on 2^(-k-1), and RN(1/b) is the successor.
// tests/test_fp8_division.py checks in C that this is RN(1/b) from every approximation within
// 4 ulp (every significand of [1, 4), every 61st and the all-ones one of each lower binade), and
// on the GPU that make_fp8_scale's y is RN(1 / s2) for every scale of [2, 4) and subnormal ones.
KVW_HD float rcp_rn_s2(float b) {
#ifdef KVWRITE_HOST_TEST
  return 1.0f / b;
#else
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
  r = fma_rn(r, fma_rn(-b, r, 1.0f), r);
  const float y = fma_rn(r, fma_rn(-b, r, 1.0f), r);
  const u32 bb = f32_bits(b);
  return (bb & 0x7FFFFFu) == 0x7FFFFFu ? bits_f32(((253u - (bb >> 23)) << 23) | 1u) : y;
#endif
}

// ------------------------------------------------------------------------------------------
// fp8 quantization Q(x) = fp8(RN_f32(x / s)), saturated (SPEC §1.1), bit for bit, without a
// division per element.
//
// Per scale (once per thread): for a finite nonzero s = ±1.f * 2^e, m = ±2^(1-e) (2^127 for a
// subnormal s; always a normal float) carries the sign of s, s2 = |s| * |m| lies in [2^-22, 4)
// (exactly), and y = RN(1 / s2). Then x / s = (x * m) / s2, and x' = x * m is exact unless it
// overflows (then |x / s| > 2^126: saturates either way) or underflows (then |x / s| < 2^-104:
// zero either way, and the sign survives the rounding). For s = ±0, ±inf or NaN, m = 1/s
// (±inf, ±0, NaN) and s2 = y = 1, so x' already is ±inf (saturates), ±0 or NaN, as x / s is.
//
// Per element: a = min(|x'|, 2^20), NaN kept (a quotient past 2^18 saturates in both formats,
// and the clamp keeps inf - inf out of the residual); q = RN(a * y); then STEPS corrections
// q = RN(q + RN(a - s2 * q) * y) by fused multiply-adds. For float16 and bfloat16 inputs one step
// gives RN(a / s2) exactly (tests/test_fp8_division.py: every bfloat16 significand against every
// scale significand, every float16 one against every 64th); float32 inputs take two (the first
// leaves q faithful, and the second is then exact by Markstein's theorem). Where a / s2 < 2^-40
// the residual may be subnormal and q inexact, but it stays far below the smallest fp8 rounding
// boundary (2^-17), so the code is zero all the same. The sign of x' is put back last (keeps -0
// and tiny negatives), and the satfinite conversion rounds to nearest even and saturates (NaN
// stays NaN).
// ------------------------------------------------------------------------------------------
struct Fp8Scale {
  float s;   // the scale itself (for the exact-division build)
  float m;   // ±2^(1-e), or 1/s for zero, infinite and NaN scales
  float s2;  // |s| * |m|, in [2^-22, 4), or 1
  float y;   // RN(1 / s2)
};

template <bool BRANCH_FREE = true>
KVW_HD Fp8Scale make_fp8_scale(float s) {
  const u32 sb = f32_bits(s);
  const u32 ab = sb & 0x7FFFFFFFu;
  const float a = bits_f32(ab);
  const u32 e = ab >> 23;  // biased exponent field
  Fp8Scale r;
  r.s = s;
  float m = bits_f32((255u - (e > 1u ? e : 1u)) << 23);
  r.s2 = mul_rn(a, m);
  if (ab == 0u || e == 255u) {  // zero, inf, NaN: m = 1/|s|
    m = ab == 0u ? bits_f32(0x7F800000u) : ab == 0x7F800000u ? 0.0f : a;
    r.s2 = 1.0f;
  }
  r.m = bits_f32(f32_bits(m) | (sb & 0x80000000u));
  r.y = BRANCH_FREE ? rcp_rn_s2(r.s2) : div_rn(1.0f, r.s2);
  return r;
}

template <int STEPS>
KVW_HD float fp8_quotient(float x, const Fp8Scale& sc) {
  const float xs = mul_rn(x, sc.m);
  const float a = min_nan(bits_f32(f32_bits(xs) & 0x7FFFFFFFu), 1048576.0f);  // 2^20
  float q = mul_rn(a, sc.y);
#pragma unroll
  for (int i = 0; i < STEPS; ++i) q = fma_rn(fma_rn(-sc.s2, q, a), sc.y, q);
  return bits_f32(f32_bits(q) | (f32_bits(xs) & 0x80000000u));
}

// Q of N elements (N == 1 or even) into N fp8 codes, byte i of `out` = Q(x[i]) (little endian
// words). STEPS: 1 for 16-bit inputs, 2 for float32 (see above).
template <int FMT, int N, int STEPS>
KVW_HD void fp8_quantize(const float (&x)[N], u32 (&out)[(N + 3) / 4], const Fp8Scale& sc) {
  static_assert(N == 1 || N % 2 == 0, "fp8 chunks hold 1 or an even number of elements");
#pragma unroll
  for (int j = 0; j < (N + 3) / 4; ++j) out[j] = 0;
#pragma unroll
  for (int i = 0; i < N; i += 2) {
    const float x1 = i + 1 < N ? x[i + 1] : 0.0f;
#ifdef KVWRITE_EXACT_DIV
    const float q0 = div_rn(x[i], sc.s), q1 = div_rn(x1, sc.s);
#else
    const float q0 = fp8_quotient<STEPS>(x[i], sc), q1 = fp8_quotient<STEPS>(x1, sc);
#endif
    out[i >> 2] |= fp8x2_from_f32<FMT>(q0, q1) << ((i & 2) * 8);
  }
}

#ifndef KVWRITE_HOST_TEST
// ------------------------------------------------------------------------------------------
// Device side: chunks of VEC elements moved as one vector access.
// ------------------------------------------------------------------------------------------
__host__ __device__ constexpr int elem_bytes(int dt) {
  return dt == DT_F32 ? 4 : (dt == DT_E4M3 || dt == DT_E5M2) ? 1 : 2;
}

// N bytes of one chunk, in 32-bit words; element i of a 2-byte type is half (i & 1) of word
// i / 2, of a 1-byte type byte (i & 3) of word i / 4 (little endian, as in memory). Chunks of
// 1 or 2 bytes use the low bits of w[0].
template <int N>
struct Raw {
  u32 w[N >= 4 ? N / 4 : 1];
};

template <int N>
KVW_HD Raw<N> load_raw(const u8* p) {
  Raw<N> r;
  if constexpr (N == 32) {  // two 16-byte loads
    const uint4 a = reinterpret_cast<const uint4*>(p)[0];
    const uint4 b = reinterpret_cast<const uint4*>(p)[1];
    r.w[0] = a.x; r.w[1] = a.y; r.w[2] = a.z; r.w[3] = a.w;
    r.w[4] = b.x; r.w[5] = b.y; r.w[6] = b.z; r.w[7] = b.w;
  } else if constexpr (N == 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    r.w[0] = v.x; r.w[1] = v.y; r.w[2] = v.z; r.w[3] = v.w;
  } else if constexpr (N == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    r.w[0] = v.x; r.w[1] = v.y;
  } else if constexpr (N == 4) {
    r.w[0] = *reinterpret_cast<const u32*>(p);
  } else if constexpr (N == 2) {
    r.w[0] = *reinterpret_cast<const u16*>(p);
  } else {
    r.w[0] = *p;
  }
  return r;
}

// load_raw with ld.volatile: the same bytes, but a load the compiler may neither drop nor move
// below a branch (used where the only consumer of a chunk is a store under the slot's test).
template <int N>
KVW_HD Raw<N> load_raw_volatile(const u8* p) {
  Raw<N> r;
  if constexpr (N == 32 || N == 16) {
#pragma unroll
    for (int i = 0; i < N / 16; ++i)
      asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(r.w[4 * i]), "=r"(r.w[4 * i + 1]), "=r"(r.w[4 * i + 2]),
                     "=r"(r.w[4 * i + 3])
                   : "l"(p + 16 * i));
  } else if constexpr (N == 8) {
    asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(r.w[0]), "=r"(r.w[1]) : "l"(p));
  } else if constexpr (N == 4) {
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(r.w[0]) : "l"(p));
  } else if constexpr (N == 2) {
    u16 h;
    asm volatile("ld.volatile.global.u16 %0, [%1];" : "=h"(h) : "l"(p));
    r.w[0] = h;
  } else {
    u16 b;
    asm volatile("ld.volatile.global.u8 %0, [%1];" : "=h"(b) : "l"(p));
    r.w[0] = b & 0xFFu;
  }
  return r;
}

template <int N>
KVW_HD void store_raw(u8* p, const Raw<N>& r) {
  if constexpr (N == 32) {  // two 16-byte stores
    reinterpret_cast<uint4*>(p)[0] = make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
    reinterpret_cast<uint4*>(p)[1] = make_uint4(r.w[4], r.w[5], r.w[6], r.w[7]);
  } else if constexpr (N == 16) {
    *reinterpret_cast<uint4*>(p) = make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
  } else if constexpr (N == 8) {
    *reinterpret_cast<uint2*>(p) = make_uint2(r.w[0], r.w[1]);
  } else if constexpr (N == 4) {
    *reinterpret_cast<u32*>(p) = r.w[0];
  } else if constexpr (N == 2) {
    *reinterpret_cast<u16*>(p) = static_cast<u16>(r.w[0]);
  } else {
    *p = static_cast<u8>(r.w[0]);
  }
}

// Element i of a chunk of IN elements, as float32 (exact).
template <int IN, int N>
KVW_HD float elem_f32(const Raw<N>& r, int i) {
  if constexpr (IN == DT_F32) {
    return bits_f32(r.w[i]);
  } else {
    const u32 h = (r.w[i >> 1] >> ((i & 1) * 16)) & 0xFFFFu;
    if constexpr (IN == DT_BF16) {
      return bits_f32(h << 16);
    } else {
      float f;
      asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<u16>(h)));
      return f;
    }
  }
}

template <int OUT>
KVW_HD u32 f16ish_from_f32(float f) {
  if constexpr (OUT == DT_F16) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
  } else {
#if __CUDA_ARCH__ >= 800
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    return bf16_from_f32_soft(f);
#endif
  }
}

// One chunk of VEC input elements -> VEC cache elements.
template <int IN, int OUT, int VEC>
KVW_HD Raw<VEC * elem_bytes(OUT)> convert_chunk(const Raw<VEC * elem_bytes(IN)>& in,
                                                       const Fp8Scale& sc) {
  Raw<VEC * elem_bytes(OUT)> out;
  if constexpr (OUT == DT_E4M3 || OUT == DT_E5M2) {
    float x[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) x[i] = elem_f32<IN>(in, i);
    fp8_quantize<OUT, VEC, IN == DT_F32 ? 2 : 1>(x, out.w, sc);
  } else if constexpr (OUT == DT_F32) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out.w[i] = f32_bits(elem_f32<IN>(in, i));
  } else {
#pragma unroll
    for (int j = 0; j < (VEC * 2 + 3) / 4; ++j) out.w[j] = 0;
#pragma unroll
    for (int i = 0; i < VEC; ++i)
      out.w[i >> 1] |= f16ish_from_f32<OUT>(elem_f32<IN>(in, i)) << ((i & 1) * 16);
  }
  return out;
}

// ------------------------------------------------------------------------------------------
// The kernels.
//
// Work split: a token row is C = H*D/VEC chunks. A CTA is a [blockDim.y tokens, blockDim.x =
// row <= C chunks] grid of threads: several tokens per CTA when C is small, and grid.y > 1 CTAs
// per token when C is large. Both kernels take the same arguments and CTA shape:
// - reshape_and_cache_flash_kernel (every call whose row fits in grid.y CTAs): no loops, each
//   thread writes one chunk of one token. Its slot, K, V (and fp8 scale) loads are issued
//   together, before the slot is tested, so a thread's time is one memory round trip, the
//   conversion and the stores.
// - reshape_and_cache_flash_grid_stride_kernel (rows longer than the grid can hold): each thread
//   owns one chunk index c of the row (so one head, one scale, token-invariant offsets computed
//   once) and walks the tokens with a grid stride, two tokens per step: the slots and both
//   tokens' K and V chunks are loaded before anything is converted or stored.
// In both, the prologue before the first loads has no division (2D CTAs; the head index is a
// shift when D/VEC is a power of two) and issues the fp8 scale loads too, so their latency
// overlaps the data's; the scales' constants are computed once the data loads are in flight.
// Slots < 0 (padding) or >= num_slots are skipped; rows of key/value past num_tokens are never
// read. No shared memory, no barriers: a thread whose chunk is past C simply exits.
// ------------------------------------------------------------------------------------------
// The element offset of slot s (0 <= s < num_slots) in a cache: block * block_stride +
// (s mod block_size) * page_stride, with a shift when block_size is a power of two and a 32-bit
// division when the slots fit in 32 bits (a 64-bit division is a long subroutine on the GPU).
KVW_HD i64 slot_offset(i64 s, i64 block_stride, i64 page_stride, i64 block_size, i64 block_shift,
                       bool slots_fit_u32) {
  i64 blk, pg;
  if (block_shift >= 0) {
    blk = s >> block_shift;
    pg = s & (block_size - 1);
  } else if (slots_fit_u32) {
    const u32 b32 = static_cast<u32>(s) / static_cast<u32>(block_size);
    blk = b32;
    pg = s - static_cast<i64>(b32) * block_size;
  } else {
    blk = s / block_size;
    pg = s - blk * block_size;
  }
  return blk * block_stride + pg * page_stride;
}

// The parameters of both kernels (cuda_impl.py passes the same arguments to either).
#define KVW_KERNEL_PARAMS                                                                       \
    const u8* __restrict__ key,           /* [T_pad, H, D]; token stride key_stride (elements) */ \
    const u8* __restrict__ value,         /* [T_pad, H, D]; token stride value_stride */        \
    u8* __restrict__ key_cache,           /* [num_blocks, block_size, H, D] via strides */      \
    u8* __restrict__ value_cache,         /* same strides as key_cache */                       \
    const SlotT* __restrict__ slot_mapping,  /* [num_tokens] */                                 \
    const float* __restrict__ k_scale,    /* [1] or [H] (fp8 only, else unused) */              \
    const float* __restrict__ v_scale,    /* [1] or [H] */                                      \
    i64 num_tokens,                                                                             \
    i64 k_scale_stride, i64 v_scale_stride,  /* 0 (per tensor) or 1 (per head) */               \
    i64 key_stride, i64 value_stride,     /* token strides of key and value, in elements */     \
    i64 block_stride, i64 page_stride, i64 head_stride,  /* cache strides in elements */        \
    i64 block_size, i64 block_shift,      /* block_shift = log2(block_size), or -1 */           \
    i64 num_slots,                        /* num_blocks * block_size */                         \
    i64 chunks_per_head,                  /* D / VEC */                                         \
    i64 chunks_per_token,                 /* H * D / VEC */                                     \
    i64 head_shift                        /* log2(chunks_per_head), or -1 */

// Element sizes of a variant, and (in a build specialized for one call signature, -D
// KVWRITE_FIXED_ARGS=v0,...,v10) the arguments from key_stride on replaced by compile-time
// constants, so that none of them is read from the parameter bank and the index math folds.
// FAST_SCALE: the fp8 scales' reciprocals without a branch (rcp_rn_s2) where a chunk is one
// load per tensor (the 8-byte chunks of small calls: 0.015-0.05 us less per call). 32-byte
// chunks keep div_rn: without its branch, ptxas issues the second 16-byte loads of K and V in
// the middle of the conversion (to save registers), a memory round trip more per thread
// (H=8 T=4096 5.4 -> 6.0 us); it keeps loads above a branch. docs/performance.md, change 28.
#ifdef KVWRITE_FIXED_ARGS
#define KVW_FIXED_ARGS_PROLOGUE()                                                               \
  {                                                                                             \
    constexpr i64 fixed[] = {KVWRITE_FIXED_ARGS};                                               \
    static_assert(sizeof(fixed) / sizeof(fixed[0]) == 11, "KVWRITE_FIXED_ARGS: 11 values");    \
    key_stride = fixed[0]; value_stride = fixed[1];                                             \
    block_stride = fixed[2]; page_stride = fixed[3]; head_stride = fixed[4];                    \
    block_size = fixed[5]; block_shift = fixed[6]; num_slots = fixed[7];                        \
    chunks_per_head = fixed[8]; chunks_per_token = fixed[9]; head_shift = fixed[10];            \
  }
#else
#define KVW_FIXED_ARGS_PROLOGUE()
#endif
#define KVW_KERNEL_PROLOGUE()                                                                   \
  constexpr int IB = elem_bytes(IN);                                                            \
  constexpr int OB = OUT == DT_COPY ? IB : elem_bytes(OUT);                                     \
  constexpr int IN_BYTES = VEC * IB;                                                            \
  constexpr int OUT_BYTES = VEC * OB;                                                           \
  constexpr bool FP8 = OUT == DT_E4M3 || OUT == DT_E5M2;                                        \
  constexpr bool FAST_SCALE = IN_BYTES <= 16;                                                   \
  KVW_FIXED_ARGS_PROLOGUE()                                                                     \
  const bool slots_fit_u32 = (static_cast<u64>(num_slots) >> 32) == 0;

template <int IN, int OUT, int VEC, typename SlotT>
__global__ void __launch_bounds__(256)
reshape_and_cache_flash_grid_stride_kernel(KVW_KERNEL_PARAMS) {
  KVW_KERNEL_PROLOGUE()

  const u32 row = blockDim.x;
  const u32 tx = threadIdx.x;
  const i64 t_first = static_cast<i64>(blockIdx.x) * blockDim.y + threadIdx.y;
  const i64 t_step = static_cast<i64>(gridDim.x) * blockDim.y;

  if (t_first >= num_tokens) return;

  for (i64 c = static_cast<i64>(blockIdx.y) * row + tx; c < chunks_per_token;
       c += static_cast<i64>(gridDim.y) * row) {
    const i64 in_off = c * VEC * IB;  // bytes; heads are dense
    // Slots and both tokens' K and V chunks are loaded before anything is stored.
    i64 s0, s1;
    Raw<IN_BYTES> k0, v0, k1, v1;
    auto load = [&](i64 t0) {
      const i64 t1 = t0 + t_step;
      const bool has1 = t1 < num_tokens;
      s0 = static_cast<i64>(slot_mapping[t0]);
      s1 = has1 ? static_cast<i64>(slot_mapping[t1]) : -1;
      k0 = load_raw<IN_BYTES>(key + t0 * key_stride * IB + in_off);
      v0 = load_raw<IN_BYTES>(value + t0 * value_stride * IB + in_off);
      k1 = k0;
      v1 = v0;
      if (has1) {
        k1 = load_raw<IN_BYTES>(key + t1 * key_stride * IB + in_off);
        v1 = load_raw<IN_BYTES>(value + t1 * value_stride * IB + in_off);
      }
    };
    // The head of chunk c. 32-bit: c < H * D / VEC fits, and a 64-bit division is a long
    // subroutine on the GPU.
    const u32 h32 = head_shift >= 0 ? static_cast<u32>(c) >> head_shift
                                    : static_cast<u32>(c) / static_cast<u32>(chunks_per_head);
    const i64 h = h32;
    float k_s = 0.0f, v_s = 0.0f;
    if constexpr (FP8) {  // issued now, used after the data loads below
      k_s = k_scale[h * k_scale_stride];
      v_s = v_scale[h * v_scale_stride];
    }
    i64 t0 = t_first;
    load(t0);

    // Per-thread constants, computed while the first loads are in flight (code placed before
    // them would delay them: the division's branches end the region loads can be scheduled in).
    const i64 d =
        static_cast<i64>(static_cast<u32>(c) - h32 * static_cast<u32>(chunks_per_head)) * VEC;
    const i64 cache_off = (h * head_stride + d) * OB;  // bytes
    Fp8Scale ks{}, vs{};
    if constexpr (FP8) {
      ks = make_fp8_scale<FAST_SCALE>(k_s);
      vs = make_fp8_scale<FAST_SCALE>(v_s);
    }

    // Writes one token's chunk of K and V to slot s (skipped unless 0 <= s < num_slots).
    // A lambda called twice, not a conditional picking the chunk: NVRTC 13.5 narrowed
    // `const Raw<16>& kin = u == 0 ? k0 : k1;` to 4-byte loads and stores (seen in its PTX).
    auto put = [&](i64 s, const Raw<IN_BYTES>& kin, const Raw<IN_BYTES>& vin) {
      if (static_cast<u64>(s) >= static_cast<u64>(num_slots)) return;  // also s < 0
      const i64 off = slot_offset(s, block_stride, page_stride, block_size, block_shift,
                                  slots_fit_u32) * OB + cache_off;
      if constexpr (OUT == DT_COPY) {
        store_raw<OUT_BYTES>(key_cache + off, kin);
        store_raw<OUT_BYTES>(value_cache + off, vin);
      } else {
        store_raw<OUT_BYTES>(key_cache + off, convert_chunk<IN, OUT, VEC>(kin, ks));
        store_raw<OUT_BYTES>(value_cache + off, convert_chunk<IN, OUT, VEC>(vin, vs));
      }
    };

    while (true) {
      put(s0, k0, v0);
      put(s1, k1, v1);
      t0 += 2 * t_step;
      if (t0 >= num_tokens) break;
      load(t0);
    }
  }
}
// ------------------------------------------------------------------------------------------
// The loop-free kernel (see "The kernels" above). Against the grid-stride kernel it saves small
// calls about 0.1-0.2 us of index and loop control and large ones 1-3% (docs/performance.md).
// ------------------------------------------------------------------------------------------
template <int IN, int OUT, int VEC, typename SlotT>
__global__ void __launch_bounds__(256) reshape_and_cache_flash_kernel(KVW_KERNEL_PARAMS) {
  KVW_KERNEL_PROLOGUE()
  const i64 t = static_cast<i64>(blockIdx.x) * blockDim.y + threadIdx.y;
  const u32 c = blockIdx.y * blockDim.x + threadIdx.x;  // < 65535 * 256
  if (t >= num_tokens || c >= chunks_per_token) return;
  const u32 h = head_shift >= 0 ? c >> head_shift : c / static_cast<u32>(chunks_per_head);
  const i64 in_off = static_cast<i64>(c) * VEC * IB;
  const i64 s = static_cast<i64>(slot_mapping[t]);
  float k_s = 0.0f, v_s = 0.0f;
  if constexpr (FP8) {
    k_s = k_scale[h * k_scale_stride];
    v_s = v_scale[h * v_scale_stride];
  }
  // The chunks must be loaded before the slot's test, not after it (that would make them wait
  // for the slot's load, a memory round trip). Conversions come before the test, which keeps
  // their loads above it; a copy's only use of the chunk is the store under the test, and ptxas
  // moves plain loads below it, so copies load with ld.volatile, which it may not move there.
  Raw<IN_BYTES> kin, vin;
  if constexpr (OUT == DT_COPY) {
    kin = load_raw_volatile<IN_BYTES>(key + t * key_stride * IB + in_off);
    vin = load_raw_volatile<IN_BYTES>(value + t * value_stride * IB + in_off);
  } else {
    kin = load_raw<IN_BYTES>(key + t * key_stride * IB + in_off);
    vin = load_raw<IN_BYTES>(value + t * value_stride * IB + in_off);
  }
  const bool valid = static_cast<u64>(s) < static_cast<u64>(num_slots);  // also s < 0
  const i64 d = static_cast<i64>(c - h * static_cast<u32>(chunks_per_head)) * VEC;
  const i64 off = (slot_offset(s, block_stride, page_stride, block_size, block_shift,
                               slots_fit_u32) + static_cast<i64>(h) * head_stride + d) * OB;
  if constexpr (OUT == DT_COPY) {
    if (valid) {
      store_raw<OUT_BYTES>(key_cache + off, kin);
      store_raw<OUT_BYTES>(value_cache + off, vin);
    }
  } else {
    Fp8Scale ks{}, vs{};
    if constexpr (FP8) {
      ks = make_fp8_scale<FAST_SCALE>(k_s);
      vs = make_fp8_scale<FAST_SCALE>(v_s);
    }
    const auto kout = convert_chunk<IN, OUT, VEC>(kin, ks);
    const auto vout = convert_chunk<IN, OUT, VEC>(vin, vs);
    if (valid) {
      store_raw<OUT_BYTES>(key_cache + off, kout);
      store_raw<OUT_BYTES>(value_cache + off, vout);
    }
  }
}
#endif  // KVWRITE_HOST_TEST
