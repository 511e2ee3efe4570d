"""Triton parts of the MX group rule (SPEC §10.3, docs/ops/mx.md), as kvw/mx.cuh computes it:

- :func:`mx_scale_exp`: the scale exponent E of each group's amax, from its float32 bits;
- :func:`mx_scaled`: the elements times 2^-E (exact but below 2^-126);
- :func:`mx_rule`: (scale bytes, code bytes) of groups of 32 float32 elements.

Integer work on the amax's bits, exact products by powers of two, E4M3 and E2M1 codes by
kernels.triton_nvfp4's integer and comparison steps (never a float8 cast): so Triton's interpreter
(``TRITON_INTERPRET=1``) writes the GPU's bytes, and the CPU tests compare it in full.
"""

from __future__ import annotations

from .triton_fp8 import IMPORT_ERROR, tl, triton
from .triton_nvfp4 import e2m1, e4m3, halves

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
        """RN(x / 2^E) for ``x`` [..., 32] and E [...] in [-127, 127]: x * 2^-E as two products by
        normal powers of two, (x * 2^-63) * 2^-64 for E = 127 (2^-127 is subnormal: a build that
        flushed subnormal operands would make inf * 0 a NaN), else (x * 2^-E) * 1. The first
        product is exact wherever the result is at least 2^-126; below that both give results
        that code to a signed zero."""
        big = E == 127
        r1 = tl.where(big, 64 << 23, (127 - E) << 23).to(tl.float32, bitcast=True)
        r2 = tl.where(big, 63 << 23, 127 << 23).to(tl.float32, bitcast=True)
        return (x * r1[:, :, None]) * r2[:, :, None]

    @triton.jit
    def mx_rule(x, FP4: tl.constexpr, FLOOR: tl.constexpr, BT: tl.constexpr, BQ: tl.constexpr):
        """(scale bytes [BT, BQ] uint8, code bytes uint8: [BT, BQ, 16] for FP4, element 2j in
        byte j's low nibble, else [BT, BQ, 32] E4M3) of groups ``x`` [BT, BQ, 32] float32."""
        a = tl.max(tl.where(x != x, 0.0, tl.abs(x)), axis=2)  # NaN skipped, from 0
        E = mx_scale_exp(a, FP4, FLOOR)
        v = mx_scaled(x, E)
        if FP4:
            lo, hi = halves(e2m1(v), BT, BQ, 32)
            codes = (lo | (hi << 4)).to(tl.uint8)
        else:
            code, _ = e4m3(tl.abs(v))  # saturating at 448 (inf too), NaN -> 0x7F
            codes = (code | ((v.to(tl.int32, bitcast=True) >> 24) & 128)).to(tl.uint8)
        return (E + 127).to(tl.uint8), codes
