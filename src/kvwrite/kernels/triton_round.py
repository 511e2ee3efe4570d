"""Exact integer roundings of float32 values in Triton (no conversion instruction), shared by the
ops that quantize to small integer codes: per-token-head int8/int4 and TurboQuant's values
(§5's ``rhu``, round half up). As kvw/round.cuh for the CUDA kernels.
"""

from __future__ import annotations

from .triton_fp8 import tl, triton

__all__ = ["rne", "rhu"]

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
