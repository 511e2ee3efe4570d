"""Triton parts of the MX group rule (SPEC §10.3, docs/ops/mx.md), as kvw/mx.cuh computes it:

- :func:`mx_scale_exp`: the scale exponent E of each group's amax, from its float32 bits;
- :func:`mx_scaled`: the elements times 2^-E (exact but below 2^-126);
- :func:`mx_rule`: (scale bytes, code bytes) of groups of 32 float32 elements.

Integer work on the amax's bits, exact products by powers of two, E4M3 and E2M1 codes by
kernels.triton_fp8's and kernels.triton_nvfp4's integer and comparison steps (never a float8 cast
but mx_rule's NATIVE): so Triton's interpreter (``TRITON_INTERPRET=1``) writes the GPU's bytes,
and the CPU tests compare it in full.
"""

from __future__ import annotations

from .triton_fp8 import IMPORT_ERROR, fp8_bytes, tl, triton
from .triton_nvfp4 import e2m1, halves

__all__ = ["triton", "tl", "IMPORT_ERROR", "mx_scale_exp", "mx_scaled", "mx_rule"]

if triton is not None:

    @triton.jit
    def mx_scale_exp(a, FP4: tl.constexpr, FLOOR: tl.constexpr):
        """E (int32) of amax ``a`` (float32 >= +0, never NaN): a = m * 2^k, 1 <= m < 2; zero and
        subnormal a -> -127 (k <= -127 there, below -127 + e_M under both rules), +inf -> 127;
        "ceil": max(-127, k - e_M + [m > m_M]); "floor": max(-127, k - e_M) (k - e_M <= 125).
        (e_M, m_M) = (2, 1.5) for E2M1 (FP4), (8, 1.75) for E4M3; m > m_M on the fraction
        bits."""
        if FP4:
            EM: tl.constexpr = 2
            MM: tl.constexpr = 0x400000
        else:
            EM: tl.constexpr = 8
            MM: tl.constexpr = 0x600000
        b = a.to(tl.int32, bitcast=True)
        e = b >> 23
        E = e - (127 + EM)
        if not FLOOR:
            E = E + ((b & 0x7FFFFF) > MM).to(tl.int32)
        E = tl.maximum(E, -127)
        E = tl.where(e == 0, -127, E)
        return tl.where(e == 255, 127, E)

    @triton.jit
    def mx_scaled(x, E):
        """RN(x / 2^E) for ``x`` [..., 32] and E [...] in [-127, 127]: one product by 2^-E,
        2^127 .. 2^-126 normal and 2^-127 the subnormal 0x00400000 (kvw/mx.cuh's mx_rcp): exact
        wherever the result is at least 2^-126 (mul.f32 without .ftz keeps subnormal operands
        and results: the kernel's PTX has no .ftz, tests/test_mx_kernels.py checks it); below
        that it rounds to codes of a signed zero."""
        r = tl.where(E == 127, 0x00400000, (127 - E) << 23).to(tl.float32, bitcast=True)
        return x * r[:, :, None]

    @triton.jit
    def mx_rule(x, FP4: tl.constexpr, FLOOR: tl.constexpr, BT: tl.constexpr, BQ: tl.constexpr,
                NATIVE: tl.constexpr = False):
        """(scale bytes [BT, BQ] uint8, code bytes uint8: [BT, BQ, 16] for FP4, element 2j in
        byte j's low nibble, else [BT, BQ, 32] E4M3) of groups ``x`` [BT, BQ, 32] float32.
        NATIVE (compiled kernels on sm_89 and later, not the interpreter): the E4M3 codes by
        Triton's float8 conversion (cvt.rn.satfinite.e4m3x2.f32, two elements an instruction:
        nearest even, subnormals rounded, +-inf and past 448 saturating to +-448, NaN a NaN
        code), the same bytes as the integer steps (but which NaN code: unspecified) in a fraction
        of their instructions; the interpreter's conversion rounds differently, so it keeps
        them."""
        a = tl.max(tl.where(x != x, 0.0, tl.abs(x)), axis=2)  # NaN skipped, from 0
        E = mx_scale_exp(a, FP4, FLOOR)
        v = mx_scaled(x, E)
        if FP4:
            lo, hi = halves(e2m1(v), BT, BQ, 32)
            codes = (lo | (hi << 4)).to(tl.uint8)
        else:
            codes = fp8_bytes(v, 1, NATIVE)  # E4M3, saturating at 448 (inf too)
        return (E + 127).to(tl.uint8), codes
