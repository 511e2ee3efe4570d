"""Triton parts of the NVFP4 group rule (docs/ops/nvfp4.md, "One group of 16 elements") shared by
every kernel that writes or reads NVFP4 groups: the NVFP4 writes (kvwrite.ops.nvfp4) and the
transfer pages (kvwrite.kernels.triton_transfer).

- :func:`group_rule`: (S codes, packed code bytes) of groups of 16 float32 elements with the
  per-tensor scale ``k`` (a scalar or a tensor broadcast against the groups' amax);
- :func:`group_rule_halves`: the same rule on groups given as two halves of 8 elements (a
  thread's whole groups), the codes packed into little-endian words;
- :func:`e2m1`, :func:`e2m1_value`: the E2M1 codes and values (E4M3's:
  kvwrite.kernels.triton_fp8.e4m3);
- :func:`store_code_words`: a group's 8 code bytes stored from its two little-endian words (word
  stores where aligned, bytes elsewhere);
- :func:`widen`, :func:`widen_words`: input elements as float32 (bfloat16 from its bits).

Each step is one IEEE float32 operation rounded to nearest even: ``tl.math.div_rn`` for the two
quotients, and a kernel using these launches with FMA contraction off (``enable_fp_fusion=False``:
the error sums of "nvfp4_4over6" are rounded products and sums). E4M3 and E2M1 are computed with
integer and comparison operations, never by a float8 cast, and bfloat16 inputs are widened from
their bits: so Triton's interpreter (``TRITON_INTERPRET=1``) writes the GPU's bytes. The one
exception in form, not in bytes: group_rule_halves's NATIVE (compiled kernels on sm_89 and later)
takes E4M3 by the float8 conversion and packs codes with a funnel shift in inline PTX.
``triton`` is optional at import time, as in :mod:`kvwrite.kernels.triton_fp8`.
"""

from __future__ import annotations

from .triton_fp8 import IMPORT_ERROR, e4m3, tl, triton

__all__ = ["triton", "tl", "IMPORT_ERROR", "e2m1", "e2m1_value", "group_rule",
           "group_rule_halves", "store_code_words", "widen", "widen_words"]

if triton is not None:

    @triton.jit
    def e2m1(v):
        """E2M1 codes (int32, 0-15) of float32 ``v``: NaN -> 7; bit 3 = signbit; bits 0-2 the
        number of thresholds |v| passes (nearest, ties to the even code, saturating at 6).

        As the CUDA kernel computes it (kvw/nvfp4.cuh, nvfp4_e2m1_t and nvfp4_split): with
        m = min(|v|, 6), the code is RNE(min(2m, m + 2, m/2 + 4)), each line plus 2^23 rounded
        once (an fma of an exact product: 2m and m/2 are exact, so fused or not gives the same
        bits), the smallest of the three (positive floats: the order of their bits) and its low
        bits. tl.minimum returns the number for a NaN (minnum, on the GPU and in the
        interpreter), so NaN takes m = 6 (code 7) and min(v, 6) = 6, whose sign bit is the
        code's bit 3 (none for NaN; -0 and negative values keep theirs). About eight
        instructions an element instead of seven comparisons, their sum and the selects."""
        m = tl.minimum(tl.abs(v), 6.0)
        l1 = tl.fma(m, 2.0, 8388608.0).to(tl.int32, bitcast=True)
        l2 = (m + 8388610.0).to(tl.int32, bitcast=True)
        l3 = tl.fma(m, 0.5, 8388612.0).to(tl.int32, bitcast=True)
        c = tl.minimum(tl.minimum(l1, l2), l3) & 7
        return c | ((tl.minimum(v, 6.0).to(tl.int32, bitcast=True) >> 28) & 8)

    @triton.jit
    def e2m1_value(c):
        """value(c) as float32 (code 8 is -0.0). The sign is bit 3 moved to the float's sign
        bit, not a negation: Triton releases before triton-lang/triton#10270 compile ``-x`` as
        ``0 - x``, which turns -(+0.0) into +0.0 on the GPU (the interpreter and later releases
        negate)."""
        mag = c & 7
        val = tl.where(mag < 5, mag.to(tl.float32) * 0.5,
                       tl.where(mag == 7, 6.0, (mag - 2).to(tl.float32)))
        return (val.to(tl.int32, bitcast=True) | ((c & 8) << 28)).to(tl.float32, bitcast=True)

    @triton.jit
    def candidate(x, a, k, C: tl.constexpr):
        """(S code, E2M1 codes, d) of groups ``x`` [BT, BQ, 16] with amax ``a`` [BT, BQ] for the
        denominator C (6, or 4 for 4over6's other candidate): :func:`scale_of`'s S, r, d."""
        S, r, d = scale_of(a, k, C, False)
        return S, e2m1(x * r[:, :, None]), d

    @triton.jit
    def halves(x, BT: tl.constexpr, BQ: tl.constexpr, N: tl.constexpr):
        """[BT, BQ, N] -> (elements 0, 2, 4, ..., elements 1, 3, 5, ...), each [BT, BQ, N/2]."""
        return tl.split(tl.reshape(x, (BT, BQ, N // 2, 2)))

    @triton.jit
    def quarters(x, BT: tl.constexpr, BQ: tl.constexpr):
        """[BT, BQ, 4] -> its four columns [BT, BQ], in order."""
        e, o = halves(x, BT, BQ, 4)  # (0, 2), (1, 3)
        c0, c2 = tl.split(e)
        c1, c3 = tl.split(o)
        return c0, c1, c2, c3

    @triton.jit
    def error_sum(x, code, d, BT: tl.constexpr, BQ: tl.constexpr):
        """sum over i = 0..15 in order of RN(delta_i^2), delta_i = RN(RN(value(c_i) * d) - x_i);
        each addition rounded (the columns are taken apart by splits, which move no bits)."""
        delta = e2m1_value(code) * d[:, :, None] - x
        sq = delta * delta
        e, o = halves(sq, BT, BQ, 16)     # even / odd i
        ee, eo = halves(e, BT, BQ, 8)     # i = 0, 4, 8, 12 / 2, 6, 10, 14
        oe, oo = halves(o, BT, BQ, 8)     # i = 1, 5, 9, 13 / 3, 7, 11, 15
        s0, s4, s8, s12 = quarters(ee, BT, BQ)
        s2, s6, s10, s14 = quarters(eo, BT, BQ)
        s1, s5, s9, s13 = quarters(oe, BT, BQ)
        s3, s7, s11, s15 = quarters(oo, BT, BQ)
        acc = s0 + s1
        acc = acc + s2
        acc = acc + s3
        acc = acc + s4
        acc = acc + s5
        acc = acc + s6
        acc = acc + s7
        acc = acc + s8
        acc = acc + s9
        acc = acc + s10
        acc = acc + s11
        acc = acc + s12
        acc = acc + s13
        acc = acc + s14
        acc = acc + s15
        return acc

    @triton.jit
    def group_rule(x, k, FOUR_OVER_SIX: tl.constexpr, BT: tl.constexpr, BQ: tl.constexpr):
        """(S codes [BT, BQ], packed code bytes [BT, BQ, 8]) of groups ``x`` [BT, BQ, 16]."""
        a = tl.max(tl.where(x != x, 0.0, tl.abs(x)), axis=2)  # NaN skipped, from 0
        S, code, d = candidate(x, a, k, 6.0)
        if FOUR_OVER_SIX:
            S4, code4, d4 = candidate(x, a, k, 4.0)
            use4 = error_sum(x, code4, d4, BT, BQ) < error_sum(x, code, d, BT, BQ)
            S = tl.where(use4, S4, S)
            code = tl.where(use4[:, :, None], code4, code)
        lo, hi = halves(code, BT, BQ, 16)
        return S, (lo | (hi << 4)).to(tl.uint8)

    @triton.jit
    def sum8(sq, acc, FIRST: tl.constexpr, BT: tl.constexpr, BQ: tl.constexpr):
        """``acc`` plus the 8 columns of ``sq`` [BT, BQ, 8], in order, each addition rounded
        (FIRST: no ``acc``, the sum starts at column 0)."""
        e, o = halves(sq, BT, BQ, 8)  # i = 0, 2, 4, 6 / 1, 3, 5, 7
        s0, s2, s4, s6 = quarters(e, BT, BQ)
        s1, s3, s5, s7 = quarters(o, BT, BQ)
        if FIRST:
            acc = s0 + s1
        else:
            acc = acc + s0
            acc = acc + s1
        acc = acc + s2
        acc = acc + s3
        acc = acc + s4
        acc = acc + s5
        acc = acc + s6
        acc = acc + s7
        return acc

    @triton.jit
    def half_error(x0, x1, r, d, BT: tl.constexpr, BQ: tl.constexpr):
        """4over6's error sum of the candidate (r, d) for groups given as halves ``x0``, ``x1``
        [BT, BQ, 8] (elements 0-7, 8-15): sum over i = 0..15 in order of RN(delta_i^2)."""
        d3 = d[:, :, None]
        r3 = r[:, :, None]
        delta0 = e2m1_value(e2m1(x0 * r3)) * d3 - x0
        delta1 = e2m1_value(e2m1(x1 * r3)) * d3 - x1
        acc = sum8(delta0 * delta0, 0.0, True, BT, BQ)
        return sum8(delta1 * delta1, acc, False, BT, BQ)

    @triton.jit
    def scale_of(a, k, C: tl.constexpr, NATIVE: tl.constexpr):
        """(S code, r, d) of groups with amax ``a`` [BT, BQ] for the denominator C: s = RN(a /
        RN(C * k)), S = E4M3(s), d = RN(float(S) * k), r = RN(1 / d) (0 for d = 0). NATIVE
        (compiled for sm_89 and later, never the interpreter: triton_support.native_fp8): S by
        Triton's float8 conversion (cvt.rn.satfinite.e4m3x2.f32: nearest even, subnormals
        rounded, +inf and past 448 saturating to 448) and float(S) by its widening (exact), the
        bytes of :func:`e4m3` for every s >= 0 (s is never NaN for k in the contract's [2^-100,
        2^100]: RN(C * k) is a positive normal float) in a few instructions instead of about
        sixteen."""
        den = tl.zeros_like(a) + k * C                      # RN(C * k)
        s = tl.math.div_rn(a, den)
        if NATIVE:
            s8 = s.to(tl.float8e4nv, fp_downcast_rounding="rtne")
            S = s8.to(tl.uint8, bitcast=True).to(tl.int32)
            Sf = s8.to(tl.float32)
        else:
            S, Sf = e4m3(s)
        d = Sf * k
        nz = d != 0.0
        r = tl.where(nz, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(nz, d, 1.0)),
                     0.0)
        return S, r, d

    @triton.jit
    def code_step(acc, x, r, NATIVE: tl.constexpr):
        """Horner's step of :func:`packed_half` for the element column ``x`` [BT, BQ]: with v =
        RN(x * r), acc * 16 + sign * 8 + (2^23 + E2M1(|v|)'s bits), mod 2^32 (uint32). The three
        lines and their minimum are :func:`e2m1`'s; the sign is bit 31 of min(v, 6) (none for
        NaN), shifted in below acc's bits: (acc << 1) | (bits >> 31), which NATIVE (compiled
        kernels) writes as the one funnel shift it is (shf.l.wrap.b32; from the integer form
        LLVM reassociates the steps and ptxas spends three instructions a step, not two)."""
        v = x * r
        m = tl.minimum(tl.abs(v), 6.0)
        l1 = tl.fma(m, 2.0, 8388608.0).to(tl.int32, bitcast=True)
        l2 = (m + 8388610.0).to(tl.int32, bitcast=True)
        l3 = tl.fma(m, 0.5, 8388612.0).to(tl.int32, bitcast=True)
        t = tl.minimum(tl.minimum(l1, l2), l3).to(tl.uint32, bitcast=True)
        sgn = tl.minimum(v, 6.0).to(tl.uint32, bitcast=True)
        if NATIVE:
            acc = tl.inline_asm_elementwise("shf.l.wrap.b32 $0, $1, $2, 1;", "=r,r,r",
                                            [sgn, acc], dtype=tl.uint32, is_pure=True, pack=1)
        else:
            acc = (acc << 1) | (sgn >> 31)
        return (acc << 3) + t

    @triton.jit
    def packed_half(x, r, BT: tl.constexpr, BQ: tl.constexpr, NATIVE: tl.constexpr):
        """The 8 codes of half a group ``x`` [BT, BQ, 8] scaled by ``r`` [BT, BQ] as one
        little-endian uint32 word [BT, BQ] (element 2j in byte j's low nibble): Horner's scheme
        over the columns from the last one down (kvw/nvfp4.cuh's nvfp4_pack_n, the same
        integers): each step multiplies by 16 and adds the sign and 2^23 + code bits, whose
        2^23 parts sum to 0x4B000000 * (1 + 16) = 0xFB000000 mod 2^32 (the rest shift out),
        taken off at the end (+ 0x05000000). The columns are taken apart by splits (no data
        moves: each thread holds whole halves)."""
        e, o = halves(x, BT, BQ, 8)
        x0, x2, x4, x6 = quarters(e, BT, BQ)
        x1, x3, x5, x7 = quarters(o, BT, BQ)
        acc = tl.zeros(r.shape, tl.uint32)
        acc = code_step(acc, x7, r, NATIVE)
        acc = code_step(acc, x6, r, NATIVE)
        acc = code_step(acc, x5, r, NATIVE)
        acc = code_step(acc, x4, r, NATIVE)
        acc = code_step(acc, x3, r, NATIVE)
        acc = code_step(acc, x2, r, NATIVE)
        acc = code_step(acc, x1, r, NATIVE)
        acc = code_step(acc, x0, r, NATIVE)
        return acc + 0x05000000

    @triton.jit
    def group_rule_halves(x0, x1, k, FOUR_OVER_SIX: tl.constexpr, BT: tl.constexpr,
                          BQ: tl.constexpr, NATIVE: tl.constexpr = False):
        """:func:`group_rule` of groups given as their halves ``x0`` (elements 0-7) and ``x1``
        (8-15), each [BT, BQ, 8] float32: (S codes [BT, BQ], code bytes 0-3 and 4-7 of each
        group, each [BT, BQ, 4]). A kernel loading a group as two such halves (each 8 contiguous
        16-bit elements: one 16-byte access) gets a whole group in one thread's registers, so
        the amax, scale and codes take no shuffles and are computed once per group. The amax is
        the NaN-skipping maximum of tl.max (max.f32 on the GPU, a NaN-skipping maximum in the
        interpreter) of |x|, then tl.maximum with 0 (a group of NaNs alone: 0). NATIVE: compiled
        for sm_89 and later (triton_support.native_fp8; see :func:`scale_of` and
        :func:`code_step`), the same bytes."""
        a = tl.maximum(tl.maximum(tl.max(tl.abs(x0), axis=2), tl.max(tl.abs(x1), axis=2)), 0.0)
        S, r, d = scale_of(a, k, 6.0, NATIVE)
        if FOUR_OVER_SIX:
            S4, r4, d4 = scale_of(a, k, 4.0, NATIVE)
            use4 = half_error(x0, x1, r4, d4, BT, BQ) < half_error(x0, x1, r, d, BT, BQ)
            S = tl.where(use4, S4, S)
            r = tl.where(use4, r4, r)
        return S, packed_half(x0, r, BT, BQ, NATIVE), packed_half(x1, r, BT, BQ, NATIVE)

    @triton.jit
    def store_code_words(ptr, c0, c1, ok3, WORDS: tl.constexpr):
        """A group's 8 code bytes at ``ptr`` [BT, BQ, 1] (uint8): the little-endian words ``c0``,
        ``c1`` [BT, BQ] (uint32, :func:`group_rule_halves`'), as two words (``WORDS``: ``ptr``
        4-byte aligned; an 8-byte store where Triton sees 8-byte alignment) or as 8 bytes (any
        alignment)."""
        if WORDS:
            w = tl.arange(0, 2)[None, None, :]
            tl.store(ptr.to(tl.pointer_type(tl.uint32)) + w, tl.join(c0, c1), mask=ok3)
        else:
            j = tl.arange(0, 4)[None, None, :]
            sh = (j * 8).to(tl.uint32)
            tl.store(ptr + j, (c0[:, :, None] >> sh).to(tl.uint8), mask=ok3)
            tl.store(ptr + 4 + j, (c1[:, :, None] >> sh).to(tl.uint8), mask=ok3)

    @triton.jit
    def widen(x, BF16_BITS: tl.constexpr):
        """Input elements as float32 (bfloat16 arrives as its int16 bits)."""
        if BF16_BITS:
            return (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        return x.to(tl.float32)

    @triton.jit
    def widen_words(w, BF16_BITS: tl.constexpr, BT: tl.constexpr, BQ: tl.constexpr):
        """16-bit input elements loaded as int32 words ``w`` [BT, BQ, N] (element 2j in word j's
        low half, little-endian) as float32 [BT, BQ, 2N], in element order: bfloat16 from its
        bits (low half shifted up, high half masked), float16 by its conversion."""
        if BF16_BITS:
            lo = (w << 16).to(tl.float32, bitcast=True)
            hi = (w & -65536).to(tl.float32, bitcast=True)
        else:
            lo = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return tl.reshape(tl.join(lo, hi), (BT, BQ, 2 * w.shape[2]))
