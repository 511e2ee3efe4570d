// kvwrite's shared device code: types, element kinds, and IEEE arithmetic that no compiler flag
// can change. Included (through NVRTC's include path) by every op's kernel source; includes no
// headers itself (neither torch nor CUDA), so NVRTC needs no toolkit include directory.
//
// With -DKVWRITE_HOST_TEST the shared headers compile as plain host C++ (g++): only the element
// conversions remain, with their software fp8 paths, so tests can check them on the CPU.
#pragma once

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

// The integer type of a kernel's offsets or indices: u32 where NARROW (its launcher has checked
// that every one stays below 2^32: fewer registers and instructions), else i64.
template <bool NARROW>
struct IndexType {
  using type = i64;
};
template <>
struct IndexType<true> {
  using type = u32;
};

// Element kinds: template arguments IN (input) and OUT (cache). DT_COPY moves the input bits
// unchanged (kv_cache_dtype "auto", or a cache of the input's own dtype).
#define DT_F16 0
#define DT_BF16 1
#define DT_F32 2
#define DT_E4M3 3
#define DT_E5M2 4
#define DT_COPY 5

// ------------------------------------------------------------------------------------------
// Bit casts and IEEE arithmetic that no compiler flag can change (no FMA contraction, no
// fast-math, no flush to zero).
// ------------------------------------------------------------------------------------------
#ifdef KVWRITE_HOST_TEST
KVW_HD u32 f32_bits(float f) { u32 u; __builtin_memcpy(&u, &f, 4); return u; }
KVW_HD float bits_f32(u32 u) { float f; __builtin_memcpy(&f, &u, 4); return f; }
// Host builds use -ffp-contract=off; x86-64 SSE arithmetic is IEEE round-to-nearest-even.
KVW_HD float div_rn(float a, float b) { return a / b; }
KVW_HD float add_rn(float a, float b) { return a + b; }
KVW_HD float sub_rn(float a, float b) { return a - b; }
KVW_HD float mul_rn(float a, float b) { return a * b; }
KVW_HD float fma_rn(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
// min(a, b) that returns NaN when a is NaN (b is a constant here).
KVW_HD float min_nan(float a, float b) { return a > b ? b : a; }
#else
// float name(a, b): the one PTX instruction `op` (its rounding named in it) on a and b.
#define KVW_F32_ASM2(name, op)                                                                  \
  KVW_HD float name(float a, float b) {                                                         \
    float r;                                                                                    \
    asm(op " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));                                          \
    return r;                                                                                   \
  }
KVW_HD u32 f32_bits(float f) { return __float_as_uint(f); }
KVW_HD float bits_f32(u32 u) { return __uint_as_float(u); }
KVW_F32_ASM2(div_rn, "div.rn.f32")
KVW_F32_ASM2(mul_rn, "mul.rn.f32")
KVW_F32_ASM2(add_rn, "add.rn.f32")
KVW_F32_ASM2(sub_rn, "sub.rn.f32")
KVW_HD float fma_rn(float a, float b, float c) {
  float r;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
}
// RZ(a * b): rounded toward zero (fp8_quantize's bracket).
KVW_F32_ASM2(mul_rz, "mul.rz.f32")
#if __CUDA_ARCH__ >= 800
KVW_F32_ASM2(min_nan, "min.NaN.f32")
#else
KVW_HD float min_nan(float a, float b) { return a > b ? b : a; }
#endif
#endif

// Programmatic dependent launch (a build with -DKVWRITE_PDL, launched with programmatic stream
// serialization; sm_90 and later, nothing before): every kernel's first statement. It lets the
// next kernel of the stream be scheduled once all of this grid's CTAs have started
// (launch_dependents; not with -DKVWRITE_PDL_NO_TRIGGER, where the next kernel is scheduled when
// this one completes), and waits until the kernels before it in the stream have completed and
// their writes are visible (wait), before this kernel reads anything. A caller's inputs are
// often written by the kernel just before (the qkv projection), so no load may come earlier.
#if defined(KVWRITE_PDL) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#ifdef KVWRITE_PDL_NO_TRIGGER
#define KVW_PDL_TRIGGER() \
  do {                    \
  } while (0)
#else
#define KVW_PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#endif
#define KVW_PDL_ENTRY()                                \
  do {                                                 \
    KVW_PDL_TRIGGER();                                 \
    asm volatile("griddepcontrol.wait;" ::: "memory"); \
  } while (0)
#else
#define KVW_PDL_ENTRY() \
  do {                  \
  } while (0)
#endif

// In a build specialized for one call signature (-D KVWRITE_FIXED_ARGS=v0,...,v<N-1>): `fixed`,
// the N values as a constexpr array, and a compile error unless there are exactly N. Each op's
// kernel.cu assigns them to its trailing scalar arguments (cuda_impl.fixed_args' order), with
// KVW_ASSIGN_FIXED_ARGS or (the gathers, whose rule shares its first values) by index.
#define KVW_FIXED_ARGS_ARRAY(N)                   \
  constexpr i64 fixed[] = {KVWRITE_FIXED_ARGS}; \
  static_assert(sizeof(fixed) / sizeof(fixed[0]) == N, "KVWRITE_FIXED_ARGS: " #N " values")

// The number of a macro's arguments (1 to 32).
#define KVW_NARGS(...)                                                                          \
  KVW_NARGS_(__VA_ARGS__, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,  \
             15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define KVW_NARGS_(a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17,  \
                   a18, a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32,  \
                   n, ...)                                                                      \
  n

// KVW_ASSIGN_FIXED_ARGS(a, b, ...): in a specialized build, `a = fixed[0]; b = fixed[1]; ...`
// written out by the preprocessor (KVW_FIXED_n assigns n names from index i on), with a
// compile error unless there is one value per name; nothing in a generic build. (Text, not a
// function taking the arguments by reference: that changed some kernels' code.)
#ifdef KVWRITE_FIXED_ARGS
#define KVW_CAT_(a, b) a##b
#define KVW_CAT(a, b) KVW_CAT_(a, b)
#define KVW_FIXED_1(i, a) a = fixed[i];
#define KVW_FIXED_2(i, a, ...) a = fixed[i]; KVW_FIXED_1(i + 1, __VA_ARGS__)
#define KVW_FIXED_3(i, a, ...) a = fixed[i]; KVW_FIXED_2(i + 1, __VA_ARGS__)
#define KVW_FIXED_4(i, a, ...) a = fixed[i]; KVW_FIXED_3(i + 1, __VA_ARGS__)
#define KVW_FIXED_5(i, a, ...) a = fixed[i]; KVW_FIXED_4(i + 1, __VA_ARGS__)
#define KVW_FIXED_6(i, a, ...) a = fixed[i]; KVW_FIXED_5(i + 1, __VA_ARGS__)
#define KVW_FIXED_7(i, a, ...) a = fixed[i]; KVW_FIXED_6(i + 1, __VA_ARGS__)
#define KVW_FIXED_8(i, a, ...) a = fixed[i]; KVW_FIXED_7(i + 1, __VA_ARGS__)
#define KVW_FIXED_9(i, a, ...) a = fixed[i]; KVW_FIXED_8(i + 1, __VA_ARGS__)
#define KVW_FIXED_10(i, a, ...) a = fixed[i]; KVW_FIXED_9(i + 1, __VA_ARGS__)
#define KVW_FIXED_11(i, a, ...) a = fixed[i]; KVW_FIXED_10(i + 1, __VA_ARGS__)
#define KVW_FIXED_12(i, a, ...) a = fixed[i]; KVW_FIXED_11(i + 1, __VA_ARGS__)
#define KVW_FIXED_13(i, a, ...) a = fixed[i]; KVW_FIXED_12(i + 1, __VA_ARGS__)
#define KVW_FIXED_14(i, a, ...) a = fixed[i]; KVW_FIXED_13(i + 1, __VA_ARGS__)
#define KVW_FIXED_15(i, a, ...) a = fixed[i]; KVW_FIXED_14(i + 1, __VA_ARGS__)
#define KVW_FIXED_16(i, a, ...) a = fixed[i]; KVW_FIXED_15(i + 1, __VA_ARGS__)
#define KVW_FIXED_17(i, a, ...) a = fixed[i]; KVW_FIXED_16(i + 1, __VA_ARGS__)
#define KVW_FIXED_18(i, a, ...) a = fixed[i]; KVW_FIXED_17(i + 1, __VA_ARGS__)
#define KVW_FIXED_19(i, a, ...) a = fixed[i]; KVW_FIXED_18(i + 1, __VA_ARGS__)
#define KVW_FIXED_20(i, a, ...) a = fixed[i]; KVW_FIXED_19(i + 1, __VA_ARGS__)
#define KVW_FIXED_21(i, a, ...) a = fixed[i]; KVW_FIXED_20(i + 1, __VA_ARGS__)
#define KVW_FIXED_22(i, a, ...) a = fixed[i]; KVW_FIXED_21(i + 1, __VA_ARGS__)
#define KVW_FIXED_23(i, a, ...) a = fixed[i]; KVW_FIXED_22(i + 1, __VA_ARGS__)
#define KVW_FIXED_24(i, a, ...) a = fixed[i]; KVW_FIXED_23(i + 1, __VA_ARGS__)
#define KVW_FIXED_25(i, a, ...) a = fixed[i]; KVW_FIXED_24(i + 1, __VA_ARGS__)
#define KVW_FIXED_26(i, a, ...) a = fixed[i]; KVW_FIXED_25(i + 1, __VA_ARGS__)
#define KVW_FIXED_27(i, a, ...) a = fixed[i]; KVW_FIXED_26(i + 1, __VA_ARGS__)
#define KVW_FIXED_28(i, a, ...) a = fixed[i]; KVW_FIXED_27(i + 1, __VA_ARGS__)
#define KVW_FIXED_29(i, a, ...) a = fixed[i]; KVW_FIXED_28(i + 1, __VA_ARGS__)
#define KVW_FIXED_30(i, a, ...) a = fixed[i]; KVW_FIXED_29(i + 1, __VA_ARGS__)
#define KVW_FIXED_31(i, a, ...) a = fixed[i]; KVW_FIXED_30(i + 1, __VA_ARGS__)
#define KVW_FIXED_32(i, a, ...) a = fixed[i]; KVW_FIXED_31(i + 1, __VA_ARGS__)
#define KVW_ASSIGN_FIXED_ARGS(...) KVW_ASSIGN_FIXED_ARGS_(KVW_NARGS(__VA_ARGS__), __VA_ARGS__)
#define KVW_ASSIGN_FIXED_ARGS_(N, ...)             \
  {                                                \
    KVW_FIXED_ARGS_ARRAY(N);                       \
    KVW_CAT(KVW_FIXED_, N)(0, __VA_ARGS__)         \
  }
#else
#define KVW_ASSIGN_FIXED_ARGS(...)
#endif

// float32 -> bfloat16, round to nearest even (NaN -> 0x7FFF, as cvt.rn.bf16.f32 does).
KVW_HD u32 bf16_from_f32_soft(float x) {
  const u32 b = f32_bits(x);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;
  return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
}

// A thread's part of the small-call kernels (NVFP4, MX): thread gid of the grid takes part
// `part` (of P) of group q of one side (is_v) of token t, in the order token, side (K, V),
// group, part; `groups` groups a side a token. live: t < num_tokens (a thread past the last
// token loads nothing).
struct GroupPart {
  u32 part, q;
  bool live, is_v;
  i64 t;
};

template <int P>
KVW_HD GroupPart group_part(u32 gid, i64 groups, i64 num_tokens) {
  const u32 unit = gid / P;                          // (token, side, group)
  const u32 ts = unit / static_cast<u32>(groups);    // token * 2 + side
  const u32 t32 = ts >> 1;
  return {gid % P, unit - ts * static_cast<u32>(groups), t32 < num_tokens, (ts & 1) != 0, t32};
}
