"""Exact integer roundings of float32 values in Triton (no conversion instruction), shared by the
ops that quantize to small integer codes: per-token-head int8/int4 and TurboQuant's values
(§5's ``rhu``, round half up), and the sum rounded toward -inf that the fast paths floor with.
As kvw/round.cuh for the CUDA kernels.
"""

from __future__ import annotations

from .triton_fp8 import tl, triton

__all__ = ["rne", "rhu", "add_rm", "rhu_bits"]

if triton is not None:

    @triton.jit
    def rne(q):
        """Round half to even, exactly, for |q| < 2^22: the sum with 1.5 * 2^23 (step 1 there)
        rounds q to the nearest integer, ties to even; the difference is exact."""
        return (q + 12582912.0) - 12582912.0

    @triton.jit
    def rhu(q):
        """Round half up, exactly, for |q| < 2^22: q - RNE(q) is exact, and RNE differs from
        rounding half up only on the ties it takes down."""
        n = rne(q)
        return tl.where(q - n == 0.5, n + 1.0, n)

    @triton.jit
    def add_rm(a, b, COMPILED: tl.constexpr):
        """RM(a + b): the sum rounded toward -inf (kvw/round.cuh's add_rm), for sums that neither
        overflow nor are zero (a zero sum's sign is RN's here). COMPILED (a kernel compiled for
        a GPU): the one add.rm.f32. Under Triton's interpreter, which has no directed rounding:
        the rounded sum s and its exact error e (TwoSum: s + e = a + b); where e < 0 the exact
        sum lies below s, and RM is the float below s."""
        if COMPILED:
            return tl.inline_asm_elementwise("add.rm.f32 $0, $1, $2;", "=f,f,f",
                                             [a, tl.zeros_like(a) + b],
                                             dtype=tl.float32, is_pure=True, pack=1)
        else:
            s = a + b
            bb = s - a
            e = (a - (s - bb)) + (b - bb)
            bits = s.to(tl.int32, bitcast=True)
            below = tl.where(s > 0, bits - 1, bits + 1).to(tl.float32, bitcast=True)
            return tl.where(e < 0, below, s)

    @triton.jit
    def rhu_bits(q, COMPILED: tl.constexpr):
        """The bits (int32) of 2^23 + rhu(q) = floor(q + 1/2), for q + 1/2 in (0, 2^23): RM(RM(q +
        1/2) + 2^23), whose floor is the exact one (kvw/round.cuh's rhu_bits)."""
        return add_rm(add_rm(q, 0.5, COMPILED), 8388608.0, COMPILED).to(tl.int32, bitcast=True)
