// Vector loads and stores of one chunk of VEC elements, and the element conversions between
// them (copy, float casts, fp8). Device code only. Shared by every op's kernel.
#pragma once
#include "kvw/common.cuh"
#include "kvw/fp8.cuh"

// KVWRITE_EMU: the gather kernels' SIMT emulation on the CPU (tests/gather_emu.h), which needs
// this header's chunks too.
#if !defined(KVWRITE_HOST_TEST) || defined(KVWRITE_EMU)
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
#ifdef KVWRITE_EMU
  return load_raw<N>(p);  // the emulation: the same bytes
#else
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
#endif
}

// *p, a 4- or 8-byte integer of a read-only index array (a position, a slot), loaded where it
// stands: as an asm volatile statement it stays after the row's load_raw_volatile in the PTX, so
// nothing computed from the index (the table's address, an int's widening) is placed before the
// row's loads, where ptxas would wait for the index's round trip before issuing them. ptxas may
// still issue this load earlier; it waits for it after the row's loads (test_rope checks the
// machine code). ld.global.nc is the read-only path a plain load of a const __restrict__ array
// takes; with ld.volatile, hot calls whose warps share an index took up to 0.66 us more (H200,
// tuning-log change 52).
template <typename T>
KVW_HD T load_index(const T* p) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "a 4- or 8-byte integer");
#ifdef KVWRITE_EMU
  return *p;  // the emulation: the same value
#else
  T x;
  if constexpr (sizeof(T) == 8) {
    asm volatile("ld.global.nc.u64 %0, [%1];" : "=l"(x) : "l"(p));
  } else {
    asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(x) : "l"(p));
  }
  return x;
#endif
}

// *p, a float32 scale that every warp of a call may read (a per-tensor k_scale, v_scale or
// q_scale), loaded where it stands (asm volatile: issued with the rows though used only after
// the rotation) through the read-only path, as load_index: ld.global.nc is served by L1 after
// a CTA's first warp, where ld.volatile sent every warp's load to the one L2 slice holding the
// scale (the fused QK-norm write with an fp8 cache, 2 such loads a warp: 1.4x its auto cache's
// time at T = 16384 on an H200, tuning-log change 83).
KVW_HD float load_scale(const float* p) {
#ifdef KVWRITE_EMU
  return *p;  // the emulation: the same value
#else
  float x;
  asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(x) : "l"(p));
  return x;
#endif
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

// load_raw_volatile where VOLATILE, else load_raw: a copy's chunk, whose only use is its store
// under the slot's test, is loaded volatile, as ptxas moves a plain load whose only use is under
// a branch below the branch (there it would wait for the slot's load, a memory round trip); a
// converted chunk's arithmetic before the test keeps its plain load above it.
template <int N, bool VOLATILE>
KVW_HD Raw<N> load_raw_for(const u8* p) {
  if constexpr (VOLATILE) {
    return load_raw_volatile<N>(p);
  } else {
    return load_raw<N>(p);
  }
}

// N bytes at an A-byte aligned address p (A a power of two below N and 16) as N / A pieces of A
// bytes, piece i being load_piece(p + i * A) (a Raw<A>: load_raw, load_raw_volatile, a
// predicated load), assembled little endian into whole words.
template <int N, int A, typename LoadPiece>
KVW_HD Raw<N> load_pieces(const u8* p, LoadPiece load_piece) {
  Raw<N> r;
#pragma unroll
  for (int i = 0; i < (N >= 4 ? N / 4 : 1); ++i) r.w[i] = 0;
#pragma unroll
  for (int i = 0; i < N / A; ++i) {
    const Raw<A> piece = load_piece(p + i * A);
    if constexpr (A >= 4) {
#pragma unroll
      for (int k = 0; k < A / 4; ++k) r.w[i * A / 4 + k] = piece.w[k];
    } else {
      r.w[(i * A) / 4] |= piece.w[0] << (8 * ((i * A) & 3));
    }
  }
  return r;
}

// N bytes at an A-byte aligned address (A a power of two), as the widest accesses A allows.
template <int N, int A>
KVW_HD Raw<N> load_aligned(const u8* p) {
  if constexpr (A >= 16 || A >= N) {
    return load_raw<N>(p);
  } else {
    return load_pieces<N, A>(p, [](const u8* q) { return load_raw<A>(q); });
  }
}

template <int N, int A>
KVW_HD void store_aligned(u8* p, const Raw<N>& r) {
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

// The 16-bit element h (bits 0-15; IN is DT_BF16 or DT_F16) as float32 (exact). The host
// builds (tests' SIMT emulation) convert float16 through the compiler's _Float16.
template <int IN>
KVW_HD float half_f32(u32 h) {
  if constexpr (IN == DT_BF16) {
    return bits_f32(h << 16);
  } else {
#ifdef KVWRITE_HOST_TEST
    const u16 b = static_cast<u16>(h);
    _Float16 x;
    __builtin_memcpy(&x, &b, 2);
    return static_cast<float>(x);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<u16>(h)));
    return f;
#endif
  }
}

// Element i of a chunk of IN elements, as float32 (exact).
template <int IN, int N>
KVW_HD float elem_f32(const Raw<N>& r, int i) {
  if constexpr (IN == DT_F32) {
    return bits_f32(r.w[i]);
  } else {
    return half_f32<IN>((r.w[i >> 1] >> ((i & 1) * 16)) & 0xFFFFu);
  }
}

template <int OUT>
KVW_HD u32 f16ish_from_f32(float f) {
#ifdef KVWRITE_EMU
  if constexpr (OUT == DT_F16) {
    const _Float16 h = static_cast<_Float16>(f);  // round to nearest even (libgcc)
    u16 b;
    __builtin_memcpy(&b, &h, 2);
    return b;
  } else {
    return bf16_from_f32_soft(f);
  }
#endif
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

// Two float32 values rounded to nearest even to a 16-bit OUT (DT_F16 or DT_BF16), packed: lo in
// the low half. One cvt.rn.{f16,bf16}x2.f32 (overflow gives infinity, as the single
// conversions); bfloat16 before sm_80 element by element.
template <int OUT>
KVW_HD u32 f16ish_x2_from_f32(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
  u32 r;
  if constexpr (OUT == DT_F16) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
#else
  return f16ish_from_f32<OUT>(lo) | (f16ish_from_f32<OUT>(hi) << 16);
#endif
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

// A chunk of VEC 16-bit elements (IN; float32: nothing) to fp8 codes of kind OUT by
// fp8_quantize_fast16 under f (f.c2 != 0): each pair clamped, then converted exactly.
template <int IN, int OUT, int VEC>
KVW_HD void fp8_fast16_chunk(const Raw<VEC * elem_bytes(IN)>& in, u32 (&out)[(VEC + 3) / 4],
                             const Fp8Fast16& f) {
  if constexpr (IN != DT_F32) {
    Raw<VEC * 2> c;
#pragma unroll
    for (int j = 0; j < (VEC * 2 + 3) / 4; ++j) c.w[j] = fp8_fast16_clamp<IN>(in.w[j], f);
    float x[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) x[i] = elem_f32<IN>(c, i);
    fp8_quantize_fast16<OUT, VEC>(x, out, f);
  }
}

// N chunks of VEC elements (IN) to fp8 codes of kind OUT under f = fp8_fast16_scale<IN>(s): by
// fp8_quantize_fast16 where f.c2 is not 0 (16-bit inputs in its scale
// range), else by convert_chunk's quotient with fp8_fast16_fallback's constants (computed once
// for the N chunks). The one place that choice is made: the fused QK-norm write
// (convert_fp8_chunks) and the fp8 page pack (transfer.cu, one chunk a unit) ask it.
template <int IN, int OUT, int VEC, int N>
KVW_HD void fp8_fast16_or_quotient(const Raw<VEC * elem_bytes(IN)> (&in)[N],
                                   Raw<VEC> (&out)[N], const Fp8Fast16& f) {
  if (f.c2 != 0u) {
#pragma unroll
    for (int k = 0; k < N; ++k) fp8_fast16_chunk<IN, OUT, VEC>(in[k], out[k].w, f);
  } else {
    const Fp8Scale sc = fp8_fast16_fallback(f);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = convert_chunk<IN, OUT, VEC>(in[k], sc);
  }
}

// N chunks converted to an fp8 kind OUT under scale f.s (f = fp8_fast16_scale<IN>(s)), where r =
// pow2_scale_reciprocal(s): by fp8_quantize_pow2 (the quotient's codes by one product an
// element) where r is not 0 (a power of two), else by fp8_fast16_or_quotient. One test for the
// N chunks, so that each branch is a straight run of conversions.
template <int IN, int OUT, int VEC, int N>
KVW_HD void convert_fp8_chunks(const Raw<VEC * elem_bytes(IN)> (&in)[N], float r,
                               const Fp8Fast16& f, Raw<VEC> (&out)[N]) {
  static_assert(OUT == DT_E4M3 || OUT == DT_E5M2, "fp8 kinds only");
  if (r != 0.0f) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float x[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) x[i] = elem_f32<IN>(in[k], i);
      fp8_quantize_pow2<OUT, VEC>(x, out[k].w, r);
    }
  } else {
    fp8_fast16_or_quotient<IN, OUT, VEC, N>(in, out, f);
  }
}
#endif  // !KVWRITE_HOST_TEST || KVWRITE_EMU
