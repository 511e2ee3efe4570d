"""Triton parts shared by every op: the fp8 rule of docs/ops/reshape_and_cache_flash.md without a
division per element.

- :func:`fp8_scale` (once per scale): the constants ``(m, s2, y)`` that turn ``x / s`` into an
  exact product and one correction;
- :func:`fp8_quotient` (per element): ``RN_f32(x / s)`` clamped to ±FMAX, NaN and the sign of zero
  kept;
- :func:`load_scale`, :func:`load_scale_pair`, :func:`scale_constants`, :func:`fp8_scale_pair`:
  a key's and a value's scale, each per tensor or per head on its own (the launcher passes each
  tensor's kind, kvwrite.dtypes.scale_is_per_head), and those constants of them;
- :func:`fp8_code`, :func:`fp8_bytes`: the fp8 codes of a quotient, by the float8 conversion where
  the kernel is compiled for a GPU that has it (``NATIVE``: sm_89 and later,
  kvwrite.kernels.triton_support.native_fp8) and by integer steps elsewhere (below sm_89 Triton
  has no e4m3 type; its interpreter rounds float8 casts otherwise than the GPU); :func:`e4m3`:
  E4M3 by those steps;
- :func:`store_quantized`: store ``Q(x)`` (a copy or float cast when ``QUANT == COPY``, else fp8
  e4m3fn or e5m2 bits) into a cache of any element type (uint8 or float8 for fp8; the launchers
  pass a float8 one as :func:`code_view`'s uint8 view); :func:`store_quantized_uniform`: the
  same, with one product per element where a per-tensor scale is a power of two;
- :func:`ue8m0_round_up`: a positive scale rounded up to a power of two from its bits (vLLM's
  "ue8m0" scales; ``kvwrite.dtypes.ue8m0_round_up`` says how);
- :func:`pdl_entry`: every kernel's first statement, programmatic dependent launch's entry when
  ``PDL`` (kvwrite.kernels.triton_support.pdl_launch says when), nothing otherwise.

Triton's float32 ``/`` is approximate; ``tl.math.div_rn`` is exact but slow per element, hence
this. ``triton`` is optional at import time: where it is missing, :data:`triton` is None and
:data:`IMPORT_ERROR` says why.
"""

from __future__ import annotations

import torch

from ..dtypes import FLOAT8_FORMAT, CacheDType
from ..gather import bits_view

try:
    import triton
    import triton.language as tl
except ImportError as _e:  # optional: implementations report it through `available`
    triton = tl = None
    IMPORT_ERROR: ImportError | None = _e
else:
    IMPORT_ERROR = None

__all__ = ["triton", "tl", "IMPORT_ERROR", "COPY", "E4M3", "E5M2", "quant_code", "code_view",
           "fp8_scale", "fp8_quotient", "corrected_quotient", "e4m3", "fp8_code", "fp8_bytes",
           "store_quantized", "store_quantized_uniform", "load_scale", "load_scale_pair",
           "scale_constants", "fp8_scale_pair", "pdl_entry", "ue8m0_round_up"]

# QUANT codes of store_quantized: a copy or float cast to the cache's element type, fp8 e4m3fn,
# fp8 e5m2 (E4M3 and E5M2 are fp8_code's and fp8_bytes's FMT too).
COPY, E4M3, E5M2 = 0, 1, 2


_QUANT_CODES = {CacheDType.FP8_E4M3: E4M3, CacheDType.FP8_E5M2: E5M2}


def quant_code(fmt) -> int:
    """store_quantized's QUANT for ``fmt``, a cache's kvwrite.dtypes.CacheDType or a float8
    torch dtype (a quantized query's): E4M3 or E5M2, else COPY."""
    return _QUANT_CODES.get(FLOAT8_FORMAT.get(fmt, fmt), COPY)


def code_view(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as a kernel that writes fp8 codes takes it: a float8 tensor (an fp8 cache or query
    of torch's float8 dtype, a key of kvwrite.dtypes.FLOAT8_FORMAT) as its uint8 view
    (kvwrite.gather.bits_view), the same bytes (below sm_89 Triton refuses a kernel with a
    float8_e4m3fn pointer argument); any other tensor (or None) as it is: a float16, bfloat16 or
    float32 one stays a float tensor, since the kernels compute on it."""
    return bits_view(t) if t is not None and t.dtype in FLOAT8_FORMAT else t

if triton is not None:

    @triton.jit
    def fp8_scale(s):
        """Per-scale constants of the division in `store_quantized` (scalar or per-head vector).

        Returns (m, s2, y): m = ±2^(1-e) for a finite nonzero scale s = ±1.f * 2^e (2^127 for a
        subnormal one), carrying the sign of s, so that x * m is exact wherever it matters and
        x / s = (x * m) / s2 with s2 = |s| * |m| in [2^-22, 4); y = RN(1 / s2). For s = ±0, ±inf
        or NaN, m = 1/s (±inf, ±0, NaN) and s2 = y = 1, so x * m already is the quotient's
        class: ±inf (saturates), ±0 or NaN.
        """
        s = s.to(tl.float32)
        a = tl.abs(s)
        e = a.to(tl.int32, bitcast=True) >> 23  # biased exponent field (0 for zero/subnormal)
        m = ((255 - tl.maximum(e, 1)) << 23).to(tl.float32, bitcast=True)  # 2^(1-e), normal
        special = (a == 0.0) | (e == 255)  # zero, inf, NaN
        inv = tl.where(a == 0.0, float("inf"), tl.where(a == float("inf"), 0.0, a))  # 1/a there
        m = tl.where(special, inv, m)
        s2 = tl.where(special, 1.0, a * m)
        y = tl.math.div_rn(tl.full(a.shape, 1.0, tl.float32), s2)
        sign = s.to(tl.int32, bitcast=True) & -2147483648
        m = (m.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        return m, s2, y

    @triton.jit
    def ue8m0_round_up(s):
        """The smallest power of two >= s for positive float32 s, from the bits: s itself when its
        mantissa is zero (a power of two, +inf), else 2^(e+1) for s in (2^e, 2^(e+1)); as
        ``kvwrite.dtypes.ue8m0_round_up`` and kvw/fp8.cuh's ``ue8m0_round_up``."""
        bits = s.to(tl.int32, bitcast=True)
        bits = tl.where((bits & 0x7FFFFF) != 0, ((bits >> 23) + 1) << 23, bits)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def corrected_quotient(a, d, y, STEPS: tl.constexpr):
        """RN(a / d) from y = RN(1 / d) without a division: the product a * y and STEPS fused
        corrections q + RN(a - d q) y (kvw's fast quotients). Exact where each caller shows it:
        fp8_quotient's scaled dividends below, the per-token-head fast path's, TurboQuant's rows
        (kernel.cu's tq_div_row). Signs and zeros are the caller's to fix."""
        q = a * y
        for _ in tl.static_range(STEPS):
            q = tl.fma(tl.fma(-d, q, a), y, q)
        return q

    @triton.jit
    def fp8_quotient(x, m, s2, y, FMAX: tl.constexpr, STEPS: tl.constexpr):
        """RN_f32(x / s) clamped to ±FMAX (NaN kept), without a division per element; (m, s2, y)
        from `fp8_scale(s)`.

        x' = x * m is exact (or so large or so small that the code is ±MAX or ±0 anyway), and
        x / s = x' / s2. With a = min(|x'|, 2^20) (NaN kept; a quotient past 2^18 saturates in
        both formats), q = RN(a * y) and STEPS corrections q = fma(fma(-s2, q, a), y, q) give
        RN(a / s2) exactly: one step for float16/bfloat16 inputs (checked in
        tests/test_fp8_division.py: every bfloat16 significand against every scale significand,
        every float16 one against every 64th), two for float32 (the first makes q faithful, and
        the second is then exact by Markstein's theorem). Where a / s2 < 2^-40 the intermediates may be subnormal and q inexact, but it
        stays far below the smallest fp8 midpoint (2^-17), so the code is zero all the same. The
        sign is put back last, which keeps -0 and the sign of tiny quotients.
        """
        xs = x.to(tl.float32) * m
        a = tl.minimum(tl.abs(xs), 1048576.0, propagate_nan=tl.PropagateNan.ALL)
        q = tl.minimum(corrected_quotient(a, s2, y, STEPS), FMAX, propagate_nan=tl.PropagateNan.ALL)
        sign = xs.to(tl.int32, bitcast=True) & -2147483648
        return (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def e4m3(s):
        """(code int32, float32 value) of E4M3(s) for s >= 0: nearest even, subnormals rounded,
        s >= 448 (and +inf) saturating to 448 (0x7E); NaN (a scale outside its range) -> 0x7F."""
        b = s.to(tl.int32, bitcast=True)
        # Normal: the float32 bits rounded to 3 mantissa bits, the exponent rebiased 127 -> 7.
        normal = ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20) - (120 << 3)
        # Below 2^-6: RN(s / 2^-9) is the last bits of s + 2^14 (whose ulp is 2^-9).
        sub = (s + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
        code = tl.where(s < 0.015625, sub, normal)
        code = tl.where(s >= 448.0, 0x7E, code)
        code = tl.where(s != s, 0x7F, code)
        val = tl.where(code < 8, code.to(tl.float32) * 0.001953125,
                       ((code + (120 << 3)) << 20).to(tl.float32, bitcast=True))
        return code, val

    @triton.jit
    def _float8_bits(q, FMT: tl.constexpr):
        """uint8 bits of Triton's float8 conversion of float32 ``q`` (FMT: E4M3 or E5M2): on
        sm_89 and later cvt.rn.satfinite.{e4m3,e5m2}x2.f32 (nearest even, subnormals rounded,
        saturating to ±MAX). Below sm_89 an e4m3 one does not compile, and the interpreter
        rounds both otherwise."""
        if FMT == 1:
            bits = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            bits = q.to(tl.float8e5).to(tl.uint8, bitcast=True)
        return bits

    @triton.jit
    def fp8_code(q, FMT: tl.constexpr, NATIVE: tl.constexpr):
        """fp8 codes (int32, 0-255; FMT: E4M3 or E5M2) of float32 ``q`` (fp8_quotient's result:
        NaN kept): nearest even, subnormals rounded, past ±MAX (±inf too) saturating, the sign
        kept (-0 too), NaN -> 0x7F with q's sign. ``NATIVE`` (compiled for sm_89 and later:
        kvwrite.kernels.triton_support.native_fp8): the float8 conversion, NaN set apart; else
        integer operations on the bits (below sm_89 Triton has no e4m3 type, and its
        interpreter rounds float8 casts otherwise than the GPU): E4M3 is :func:`e4m3` of |q|,
        E5M2 the same steps with 2 mantissa bits and bias 15. tests/test_fp8_code.py checks
        both formats against PyTorch's conversion."""
        sign = (q.to(tl.int32, bitcast=True) >> 24) & 128
        if NATIVE:
            code = _float8_bits(q, FMT).to(tl.int32)
            return tl.where(q != q, 0x7F | sign, code)
        a = tl.abs(q)
        if FMT == 1:
            code, _ = e4m3(a)
        else:
            b = a.to(tl.int32, bitcast=True)
            normal = ((b + 0xFFFFF + ((b >> 21) & 1)) >> 21) - (112 << 2)
            # Below 2^-14: RN(a / 2^-16) is the last bits of a + 2^7 (whose ulp is 2^-16).
            sub = (a + 128.0).to(tl.int32, bitcast=True) - 0x43000000
            code = tl.where(a < 6.103515625e-05, sub, normal)
            code = tl.where(a >= 57344.0, 0x7B, code)
            code = tl.where(a != a, 0x7F, code)
        return code | sign

    @triton.jit
    def fp8_bytes(q, FMT: tl.constexpr, NATIVE: tl.constexpr):
        """The fp8 rule's code bytes (uint8) of ``q``: where ``NATIVE``, the float8 conversion
        alone (one instruction per two codes; a NaN's code the conversion's, which the rule
        leaves open), else :func:`fp8_code`'s integer steps."""
        if NATIVE:
            return _float8_bits(q, FMT)
        return fp8_code(q, FMT, False).to(tl.uint8)

    @triton.jit
    def store_quantized(cache_ptr, offs, mask, x, m, s2, y, QUANT: tl.constexpr,
                        STEPS: tl.constexpr, NATIVE: tl.constexpr):
        """Store Q(x) (the fp8 rule) through `cache_ptr + offs`; (m, s2, y) from `fp8_scale`;
        ``NATIVE``: :func:`fp8_bytes`'s."""
        if QUANT == 0:
            tl.store(cache_ptr + offs, x.to(cache_ptr.dtype.element_ty), mask=mask)
        else:
            if QUANT == 1:
                fmax: tl.constexpr = 448.0
            else:
                fmax: tl.constexpr = 57344.0
            q = fp8_quotient(x, m, s2, y, fmax, STEPS)
            bits = fp8_bytes(q, QUANT, NATIVE)
            # The cache is uint8 (vLLM's storage) or the float8 type itself: store the bits.
            tl.store(cache_ptr + offs, bits.to(cache_ptr.dtype.element_ty, bitcast=True), mask=mask)

    @triton.jit
    def store_quantized_uniform(cache_ptr, offs, mask, x, m, s2, y, QUANT: tl.constexpr,
                                STEPS: tl.constexpr, NATIVE: tl.constexpr,
                                UNIFORM: tl.constexpr):
        """`store_quantized`, and where the scale is one value for the whole program
        (``UNIFORM``: a per-tensor scale, scalar m, s2, y) that is a power of two ±2^E with
        E <= 126 (s2 == 2 and |m| >= 2^-125), the quotient as one product: x * (m / 2) =
        x * 2^-E rounds once, as RN(x / s) does, to the same float32 (past ±MAX, ±inf and NaN
        give the same codes too: the conversion saturates, and a NaN's code is open). vLLM's
        default scale 1.0 is such a scale. A branch on a value every thread shares."""
        if UNIFORM and QUANT != 0:
            if (s2 == 2.0) & (tl.abs(m) >= 2.350988701644575e-38):  # 2^-125
                q = x.to(tl.float32) * (m * 0.5)
                bits = fp8_bytes(q, QUANT, NATIVE)
                tl.store(cache_ptr + offs, bits.to(cache_ptr.dtype.element_ty, bitcast=True),
                         mask=mask)
            else:
                store_quantized(cache_ptr, offs, mask, x, m, s2, y, QUANT, STEPS, NATIVE)
        else:
            store_quantized(cache_ptr, offs, mask, x, m, s2, y, QUANT, STEPS, NATIVE)

    @triton.jit
    def load_scale(scale_ptr, h, NUM_HEADS: tl.constexpr, PER_HEAD: tl.constexpr):
        """One fp8 scale: per head (``PER_HEAD``), ``[BLOCK_H]`` of the heads ``h`` (ones past
        ``NUM_HEADS``); else the tensor's one value."""
        if PER_HEAD:
            s = tl.load(scale_ptr + h, mask=h < NUM_HEADS, other=1.0)
        else:
            s = tl.load(scale_ptr)
        return s

    @triton.jit
    def load_scale_pair(k_scale_ptr, v_scale_ptr, h, NUM_HEADS: tl.constexpr,
                        QUANT: tl.constexpr, K_PER_HEAD: tl.constexpr, V_PER_HEAD: tl.constexpr):
        """The key's and the value's fp8 scale (`load_scale`), both loads issued together; ones
        where ``QUANT == COPY``. Each scale has its own kind (``K_PER_HEAD``, ``V_PER_HEAD``:
        kvwrite.dtypes.scale_is_per_head of each tensor): the contract lets a per-head key
        scale come with a per-tensor value scale and the reverse."""
        if QUANT == 0:
            ks, vs = 1.0, 1.0
        else:
            ks = load_scale(k_scale_ptr, h, NUM_HEADS, K_PER_HEAD)
            vs = load_scale(v_scale_ptr, h, NUM_HEADS, V_PER_HEAD)
        return ks, vs

    @triton.jit
    def scale_constants(s, QUANT: tl.constexpr, PER_HEAD: tl.constexpr):
        """`fp8_scale`'s (m, s2, y) of one scale from `load_scale` (``PER_HEAD``: its kind; per
        head as ``[1, BLOCK_H, 1]``), ones where ``QUANT == COPY``. Its division (div_rn) may
        branch to a slow path, which the compiler moves no load across: compute it where it is
        needed."""
        if QUANT == 0:
            m, s2, y = 1.0, 1.0, 1.0
        else:
            m, s2, y = fp8_scale(s)
            if PER_HEAD:
                m, s2, y = m[None, :, None], s2[None, :, None], y[None, :, None]
        return m, s2, y

    @triton.jit
    def fp8_scale_pair(k_scale_ptr, v_scale_ptr, h, NUM_HEADS: tl.constexpr, QUANT: tl.constexpr,
                       K_PER_HEAD: tl.constexpr, V_PER_HEAD: tl.constexpr,
                       LOADS_FIRST: tl.constexpr):
        """(km, ks2, ky, vm, vs2, vy): `scale_constants` of the key's and of the value's scale,
        each of its own kind. A per-head scale, or ``LOADS_FIRST``: both loads
        (`load_scale_pair`), then both constants. Two per-tensor scales without it: the value's
        scale is loaded after the key's constants."""
        if LOADS_FIRST or K_PER_HEAD or V_PER_HEAD or QUANT == 0:
            ks, vs = load_scale_pair(k_scale_ptr, v_scale_ptr, h, NUM_HEADS, QUANT, K_PER_HEAD,
                                     V_PER_HEAD)
            km, ks2, ky = scale_constants(ks, QUANT, K_PER_HEAD)
            vm, vs2, vy = scale_constants(vs, QUANT, V_PER_HEAD)
        else:
            km, ks2, ky = fp8_scale(tl.load(k_scale_ptr))
            vm, vs2, vy = fp8_scale(tl.load(v_scale_ptr))
        return km, ks2, ky, vm, vs2, vy

    @triton.jit
    def pdl_entry(PDL: tl.constexpr, TRIGGER: tl.constexpr):
        """With PDL (a launch with launch_pdl=True): with TRIGGER, let the next kernel of the
        stream be scheduled once every program has started; then wait until the kernels before
        this one have completed and their writes are visible, before anything is read (as
        kvw/common.cuh's KVW_PDL_ENTRY)."""
        if PDL:
            if TRIGGER:
                tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
