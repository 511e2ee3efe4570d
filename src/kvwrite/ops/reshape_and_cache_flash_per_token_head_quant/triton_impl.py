"""The Triton implementation of reshape_and_cache_flash_per_token_head_quant: one kernel for the
three modes.

A program quantizes ``BLOCK_T`` tokens by ``BLOCK_H`` heads: it loads their key rows
``[BLOCK_T, BLOCK_H, BLOCK_DK]`` and value rows, then their slots (after the rows, which do not
depend on them), reduces each row to its amax (int8, fp8) or its min and max (int4), NaN and the
padding past the head size ignored, computes the scale's division by 127, 448 or 15 with the
exact quotient's constants (an exact product and one or two fused corrections, as the CUDA
kernel; infinities kept), and each element's quotient ``RN(x / s)`` exactly without a division
per element (``kvwrite.kernels.triton_fp8.fp8_quotient``: a product and one or two fused
corrections). The integer roundings are exact and need no conversion instruction: round half to
even by the 1.5 * 2^23 sum, corrected on the ties (``q - n`` is exact), and the codes' bits from
a second exact sum; int4 codes are paired with ``tl.split`` (even element in the low nibble).
Codes are stored as bytes through a uint8 view of each data cache, in accesses as wide as the
rows' alignment allows (``ALIGN``, a hint Triton cannot derive from the 4-byte-aligned V rows of
vLLM's packed layout), scales as float32. Strides are run-time arguments; head sizes, the block
size and the head and token tiles are compile-time constants. Calls of few programs take
smaller tiles spread over more threads (a thread's chain of work is the call's latency there).
Nothing is read on the host per call, so ``run`` is CUDA-graph safe.

Calls in the large calls' tiling (:func:`fast_path`) take the cuda kernel's fast path in
programs whose rows all allow it (finite values; int4: a range holding zero; every row of
ordinary data): int8 and int4 codes from two additions rounded toward -inf (int4: and one
clamp, eight codes a word by Horner's scheme), fp8 codes by the conversion with no clamp, the
rows loaded as halves so that a row lies on 8 threads; a program with any other row takes the
general path above (tuning-log 96, 97).

On CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``), where fp8 codes come from
``fp8_bytes``'s integer steps (``NATIVE`` false), so the fp8 mode is exact there as int8 and int4
are, bfloat16 rows included (the interpreter's bfloat16 -> float32 widening mangles only
subnormals, whose quotients by a scale of at least 1e-6 are zero codes either way, their sign
kept).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ...kernels import gather_cuda, triton_support
from ...kernels.triton_fp8 import IMPORT_ERROR as _IMPORT_ERROR
from ...kernels.triton_fp8 import corrected_quotient, fp8_bytes, fp8_scale, pdl_entry, tl, triton
from ...kernels.triton_nvfp4 import halves, quarters
from ...kernels.triton_round import add_rm, rhu, rhu_bits, rne
from ...kernels.triton_support import PdlTuning, next_pow2
from .op import PerTokenHeadMode

__all__ = ["TritonTuning", "TUNING", "available", "unsupported", "run", "tiling",
           "call_tiling", "small_call", "fast_path"]

_INT8, _FP8, _INT4 = 0, 1, 2
_MODE = {PerTokenHeadMode.INT8_PER_TOKEN_HEAD: _INT8, PerTokenHeadMode.FP8_PER_TOKEN_HEAD: _FP8,
         PerTokenHeadMode.INT4_PER_TOKEN_HEAD: _INT4}


def available(device: torch.device) -> str | None:
    return triton_support.available(device, triton, lambda: _pth_kernel, _IMPORT_ERROR)


def unsupported(key, value, key_cache, value_cache, mode: PerTokenHeadMode) -> str | None:
    return None


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class TritonTuning(PdlTuning):
    """Launch shapes. ``TUNING`` is what every call uses unless a caller passes another one.
    The tiles not measured beyond the first figures (H200, H=8, D=128, bfloat16, packed: T=1
    3.4-4.3 us, T=16384 57-72 us before the small-grid tiling, the wide stores and the roundings
    without conversions); for int4 before its fast path, tiles of 2048-8192 elements at 256-1024
    a warp measured 0.98-1.6x of these at T >= 4096 (tuning-log 96)."""

    # Elements (key + value, padded to powers of two) per program, and per warp (32 per thread).
    tile_elems: int = 4096
    elems_per_warp: int = 1024
    max_warps: int = 8
    # Calls whose grid would have fewer programs than small_grid take tiles of
    # tile_elems_small_grid at elems_per_warp_small_grid (8 per thread): with few programs each
    # thread's chain of work (its elements' quotients and roundings one after another) is the
    # call's latency. 0: never.
    small_grid: int = 128
    tile_elems_small_grid: int = 2048
    elems_per_warp_small_grid: int = 256
    # Programs whose rows all take the fast path (see _fast_rows) quantize them with directed
    # roundings (int4: and store whole words); False: every program takes the general path.
    fast_path: bool = True


TUNING = TritonTuning()


def _floor_pow2(n: int) -> int:
    """The largest power of two <= n (1 for n <= 1)."""
    return 1 << max(0, n.bit_length() - 1)


@functools.lru_cache(maxsize=256)
def tiling(num_heads: int, dk: int, dv: int, tuning: TritonTuning = TUNING,
           small: bool = False) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_H, num_warps): whole rows, as many heads (at most H rounded up) and then
    tokens as fit the tile (powers of two). BLOCK_T does not follow T, so that one compiled
    variant serves every call size of a tiling (a short call masks the tile's other tokens);
    ``small``: the small-grid tiling (:func:`call_tiling` says when)."""
    row = next_pow2(dk) + next_pow2(dv)
    tile, per_warp = ((tuning.tile_elems_small_grid, tuning.elems_per_warp_small_grid) if small
                      else (tuning.tile_elems, tuning.elems_per_warp))
    block_h = min(next_pow2(num_heads), _floor_pow2(tile // row))
    block_t = _floor_pow2(tile // (block_h * row))
    warps = min(tuning.max_warps, max(1, block_t * block_h * row // per_warp))
    return block_t, block_h, 1 << (warps.bit_length() - 1)


def small_call(num_tokens: int, num_heads: int, dk: int, dv: int,
               tuning: TritonTuning = TUNING) -> bool:
    """Whether a call takes the small-grid tiling: the large one would launch fewer than
    ``tuning.small_grid`` programs."""
    block_t, block_h, _ = tiling(num_heads, dk, dv, tuning)
    return -(-num_tokens // block_t) * -(-num_heads // block_h) < tuning.small_grid


def call_tiling(num_tokens: int, num_heads: int, dk: int, dv: int,
                tuning: TritonTuning = TUNING) -> tuple[int, int, int]:
    """The tiling of a call: the small-grid one where :func:`small_call` says so."""
    return tiling(num_heads, dk, dv, tuning, small_call(num_tokens, num_heads, dk, dv, tuning))


if triton is not None:

    # RN(1 / S2) of the constant divisors 127 = 3.96875 * 2^5, 448 = 3.5 * 2^7, 15 = 3.75 * 2^2
    # (the CUDA kernel's PTH_Y*; exact float32 values).
    _Y127 = tl.constexpr(float.fromhex("0x1.020408p-2"))
    _Y448 = tl.constexpr(float.fromhex("0x1.24924ap-2"))
    _Y15 = tl.constexpr(float.fromhex("0x1.111112p-2"))

    @triton.jit
    def _rhaz_mag(a):
        """floor(a + 1/2) for 0 <= a < 2^22 (|q|'s rhaz), exactly: a - RNE(a) is exact, and RNE
        differs from rounding half up only on the ties it takes down."""
        n = rne(a)
        return tl.where(a - n == 0.5, n + 1.0, n)

    @triton.jit
    def _nan0(q):
        return tl.where(q == q, q, 0.0)

    @triton.jit
    def _fmax_floor(s):
        """fmax(s, FLOOR): the floor where s is below it or NaN."""
        return tl.where(s > 1e-6, s, 1e-6)

    @triton.jit
    def _div_const(a, M: tl.constexpr, S2: tl.constexpr, Y: tl.constexpr,
                   STEPS: tl.constexpr):
        """RN(a / D) for a >= 0 (or NaN) and a constant divisor D = S2 / M (M a power of two,
        S2 in [2, 4), Y = RN(1 / S2)): the exact quotient's product and corrections on a * M,
        exact for 16-bit dividends with one step and for float32 ones with two (as the CUDA
        kernel's fast_div_const); a * M below 2^-126 only where the result is floored anyway; an
        infinite a gives inf."""
        return tl.where(a == float("inf"), a, corrected_quotient(a * M, S2, Y, STEPS))

    @triton.jit
    def _mag_quotient(xf, m, s2, y, STEPS: tl.constexpr):
        """RN(|x| / s) for int8 and fp8 rows ((m, s2, y) of fp8_scale(s)): |x| * m is exact (m > 0,
        a power of two) and at most 4 * 448.0001 (s >= RN(amax / 448), or / 127; an infinite s
        makes m 0: the product is 0, or NaN for an infinite x), so fp8_quotient's clamp and its
        sign are not needed here; the corrections as in fp8_quotient."""
        return corrected_quotient(tl.abs(xf) * m, s2, y, STEPS)

    @triton.jit
    def _signed_quotient(xf, m, s2, y, STEPS: tl.constexpr):
        """RN(x / s) with |x / s| clamped to at most about 2^19 (NaN and the sign of zero kept):
        fp8_quotient without its second clamp, which a quotient of a <= 2^20 by s2 >= 2 never
        reaches (int4: past 2^4 every code saturates)."""
        xs = xf * m
        a = tl.minimum(tl.abs(xs), 1048576.0, propagate_nan=tl.PropagateNan.ALL)
        q = corrected_quotient(a, s2, y, STEPS)
        sign = xs.to(tl.int32, bitcast=True) & -2147483648
        return (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _bits_low(v):
        """The bits of the float32 v (2^23 <= |v| < 2^24: the integer's low bits)."""
        return v.to(tl.int32, bitcast=True)

    @triton.jit
    def _quantize(x, ok, MODE: tl.constexpr, STEPS: tl.constexpr, DSTEPS: tl.constexpr,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, NATIVE: tl.constexpr):
        """(codes, entries) of rows x ``[BT, BH, BLOCK_D]`` (``ok``: the row's elements): the
        stored bytes ``[BT, BH, BLOCK_D]`` (int4: ``[BT, BH, BLOCK_D // 2]``) as int32 (their
        low byte) and the scale cache entries ``[BT, BH]`` as float32; ``NATIVE``: fp8 codes by
        the float8 conversion (triton_fp8.fp8_bytes)."""
        xf = x.to(tl.float32)
        # tl.min and tl.max ignore NaN (minnum/maxnum; the interpreter's nanmin/nanmax): a row
        # of NaN only gives NaN. Elements past the head size (masked loads: 0) are left out of
        # int4's min and max; the amax takes their zeros.
        if MODE == 2:
            if BLOCK_D == D:
                mn = tl.min(xf, axis=2)
                mx = tl.max(xf, axis=2)
            else:
                mn = tl.min(tl.where(ok, xf, float("inf")), axis=2)
                mx = tl.max(tl.where(ok, xf, -float("inf")), axis=2)
            none = ~(mn <= mx)  # no value (or none but NaN)
            mn = tl.where(none, 0.0, mn)
            mx = tl.where(none, 0.0, mx)
            # 15 = 3.75 * 2^2; RN(mx - mn) is a float32 dividend: two steps.
            s = _fmax_floor(_div_const(mx - mn, 0.25, 3.75, _Y15, 2))
            m, s2, y = fp8_scale(s)
            zp = rhu(_nan0(_signed_quotient(-mn, m, s2, y, STEPS)))
            zp = tl.minimum(tl.maximum(zp, 0.0), 15.0)
            q = _signed_quotient(xf, m[:, :, None], s2[:, :, None], y[:, :, None], STEPS)
            c = tl.minimum(tl.maximum(rhu(_nan0(q)) + zp[:, :, None], 0.0), 15.0)
            c = _bits_low(c + 8388608.0) & 15  # 2^23 + c: c in the low bits
            BT: tl.constexpr = c.shape[0]
            BH: tl.constexpr = c.shape[1]
            lo, hi = tl.split(tl.reshape(c, [BT, BH, BLOCK_D // 2, 2]))
            codes = lo | (hi << 4)
            zbits = _bits_low(zp + 8388608.0) & 15
            bits = (s.to(tl.int32, bitcast=True) & -16) | zbits
            entry = bits.to(tl.float32, bitcast=True)
        else:
            amax = tl.max(tl.abs(xf), axis=2)  # NaN for a row of NaN: the floor below
            if MODE == 0:  # 127 = 3.96875 * 2^5
                s = _fmax_floor(_div_const(amax, 0.03125, 3.96875, _Y127, DSTEPS))
            else:  # 448 = 3.5 * 2^7
                s = _fmax_floor(_div_const(amax, 0.0078125, 3.5, _Y448, DSTEPS))
            m, s2, y = fp8_scale(s)
            m, s2, y = m[:, :, None], s2[:, :, None], y[:, :, None]
            q = _mag_quotient(xf, m, s2, y, STEPS)
            if MODE == 0:
                # A NaN quotient becomes 0 by the maximum; its rhaz n; then the bits of
                # n + 2^23 + 256 (x >= 0) or n - 2^23 - 256 (x < 0), whose low byte is n or
                # 256 - n, the two's complement byte (both sums exact).
                n = _rhaz_mag(tl.maximum(q, 0.0))
                codes = _bits_low(n + tl.where(xf < 0, -8388864.0, 8388864.0)) & 255
            else:
                # Saturated (NaN kept), x's sign put back (keeps -0), rounded to fp8.
                q = tl.minimum(q, 448.0, propagate_nan=tl.PropagateNan.ALL)
                sign = xf.to(tl.int32, bitcast=True) & -2147483648
                q = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
                codes = fp8_bytes(q, 1, NATIVE).to(tl.int32)
            entry = s
        return codes, entry

    @triton.jit
    def _store_rows(codes, entry, cache_ptr, scale_ptr, blk, pg, h, write, C_B, C_S, C_H, S_B,
                    S_S, S_H, DQ: tl.constexpr, BLOCK_Q: tl.constexpr, ALIGN: tl.constexpr):
        """Store codes ``[BT, BH, BLOCK_Q]`` (the first DQ of each row) and entries ``[BT, BH]``
        where ``write`` ``[BT, BH]`` (a valid slot, a head < H). ALIGN: every row's first code
        byte is a multiple of it (the launcher's check), which lets Triton store the codes in
        accesses of up to ALIGN bytes."""
        row = (blk * C_B + pg * C_S)[:, None] + h[None, :] * C_H  # int64 [BT, BH]
        j = tl.arange(0, BLOCK_Q)
        ok = write[:, :, None] & (j < DQ)[None, None, :]
        ptrs = tl.multiple_of(cache_ptr + row[:, :, None] + j[None, None, :], [1, 1, ALIGN])
        tl.store(ptrs, codes.to(tl.uint8), mask=ok)
        srow = (blk * S_B + pg * S_S)[:, None] + h[None, :] * S_H
        tl.store(scale_ptr + srow, entry, mask=write)

    @triton.jit
    def _min_nan(a, b):
        return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _max_nan(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _load_half(ptr, row, row_ok, C: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
        """Half C (0 or 1) of rows at element offsets ``row`` ``[R]``: ``[R, BLOCK_D // 2]``
        (element j is the row's element C * BLOCK_D / 2 + j) and its mask. Loaded by halves, a
        thread holds 8 elements of each half of one row (the two tiles share a layout) and 8
        threads share a row, where a [R, BLOCK_D] tile spreads a row over 16 threads, each
        doing the row's reductions' shuffles and its per-row work."""
        HALF: tl.constexpr = BLOCK_D // 2
        d = C * HALF + tl.arange(0, HALF)
        ok = row_ok[:, None] & (d < D)[None, :]
        return tl.load(ptr + row[:, None] + d[None, :], mask=ok, other=0.0).to(tl.float32), ok

    @triton.jit
    def _row_min_max(x, ok, D: tl.constexpr, BLOCK_D: tl.constexpr):
        """NaN-propagating min and max ``[R]`` of a half ``[R, BLOCK_D // 2]`` (the elements past
        the head size left out)."""
        if BLOCK_D == D:
            return tl.reduce(x, 1, _min_nan), tl.reduce(x, 1, _max_nan)
        else:
            return (tl.reduce(tl.where(ok, x, float("inf")), 1, _min_nan),
                    tl.reduce(tl.where(ok, x, -float("inf")), 1, _max_nan))

    @triton.jit
    def _fast_rows(x0, ok0, x1, ok1, MODE: tl.constexpr, STEPS: tl.constexpr, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, COMPILED: tl.constexpr):
        """The fast path's values of rows given as halves ``x0``, ``x1`` ``[R, BLOCK_D // 2]``
        (float32, ``_load_half``; ``ok*``: the row's elements): (fast, s, y, zc, entry), each
        ``[R]``, as in the cuda kernel's fast path (kernel.cu), with y = RN(1 / s). A row is
        ``fast`` where its values are finite (NaN-propagating reductions: a NaN fails every
        test), int4's also where their range holds zero. int8 and fp8: |x / s| <= 127.00001
        or 448.0001, so no clamp and no NaN. int4: zp = rhu(RN(-mn / s)) needs no clamp, each
        code is floor(min(RM(RN(x / s) + zc), 15.5)) with zc = zp + 1/2 (exact; no lower clamp;
        the top clamp stays: rows of 16-bit values reach 16, RN(mx / s) and RN(-mn / s) both on
        halves, once in tens of rows). The other values mean nothing where ``fast`` is false."""
        if MODE == 2:
            mn0, mx0 = _row_min_max(x0, ok0, D, BLOCK_D)
            mn1, mx1 = _row_min_max(x1, ok1, D, BLOCK_D)
            mn = _min_nan(mn0, mn1)
            mx = _max_nan(mx0, mx1)
            rng = mx - mn
            s = _fmax_floor(_div_const(rng, 0.25, 3.75, _Y15, 2))  # the general path's s here
            y = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
            # The bits of 2^23 + zp: RM(RM(RN(-mn / s) + 1/2) + 2^23), whose floor is exact.
            zbits = rhu_bits(corrected_quotient(-mn, s, y, STEPS), COMPILED)
            zc = zbits.to(tl.float32, bitcast=True) - 8388607.5
            fast = (mn <= 0.0) & (mx >= 0.0) & (rng < float("inf"))
            entry = ((s.to(tl.int32, bitcast=True) & -16) | (zbits & 15)).to(tl.float32,
                                                                             bitcast=True)
        else:
            # The padding's zeros (masked loads) leave the amax as it is.
            amax = _max_nan(tl.reduce(tl.abs(x0), 1, _max_nan),
                            tl.reduce(tl.abs(x1), 1, _max_nan))
            if MODE == 0:  # the general path's s for these rows
                s = _fmax_floor(_div_const(amax, 0.03125, 3.96875, _Y127, STEPS))
            else:
                s = _fmax_floor(_div_const(amax, 0.0078125, 3.5, _Y448, STEPS))
            y = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
            zc = s  # int4's alone: any [R] value
            fast = amax < float("inf")
            entry = s
        return fast, s, y, zc, entry

    @triton.jit
    def _int4_fast_words(x, s, y, zc, STEPS: tl.constexpr, COMPILED: tl.constexpr):
        """The int4 codes of a half ``x`` ``[R, HALF]`` of fast rows (``_fast_rows``' s, y, zc)
        as little-endian uint32 words ``[R, HALF // 8]`` (element 2j in byte j's low nibble):
        each element's bits of RM(min(RM(q + zc), 15.5) + 2^23) = 2^23 + code, eight packed by
        Horner's scheme from the last down, less the 2^23 parts' 0x4B000000 * (1 + 16) =
        0xFB000000 (mod 2^32; the rest shift out), as the cuda kernel's fast_int4_pack. The
        columns are taken apart by splits (each thread holds whole groups of eight)."""
        q = corrected_quotient(x, s[:, None], y[:, None], STEPS)
        t = add_rm(tl.minimum(add_rm(q, zc[:, None], COMPILED), 15.5), 8388608.0, COMPILED)
        R: tl.constexpr = x.shape[0]
        NW: tl.constexpr = x.shape[1] // 8
        e, o = halves(tl.reshape(t.to(tl.uint32, bitcast=True), [R, NW, 8]), R, NW, 8)
        t0, t2, t4, t6 = quarters(e, R, NW)
        t1, t3, t5, t7 = quarters(o, R, NW)
        w = ((((((t7 * 16 + t6) * 16 + t5) * 16 + t4) * 16 + t3) * 16 + t2) * 16 + t1) * 16 + t0
        return w + 0x05000000

    @triton.jit
    def _fast_bytes(x, s, y, MODE: tl.constexpr, STEPS: tl.constexpr, COMPILED: tl.constexpr,
                    NATIVE: tl.constexpr):
        """The int8 or fp8 codes of a half ``x`` ``[R, HALF]`` of fast rows as uint8. int8:
        rhaz(q) = sign(q) floor(|q| + 1/2) by two sums rounded toward -inf, the sign folded into
        the second: u = RM(|q| + 1/2) (a positive sum: RM is RZ), then RM(u + C) = C + floor(u)
        for q >= 0 and RM(u - C) = -(C - floor(u)) for q < 0, C = 2^23 + 256, whose low byte
        is floor(u) or its two's complement (the cuda kernel's fast_int8_code). fp8: the
        quotient with x's sign (a zero's comes back), converted (triton_fp8.fp8_bytes; at most
        448 by a hair, which rounds to 448)."""
        q = corrected_quotient(x, s[:, None], y[:, None], STEPS)
        if MODE == 0:
            u = add_rm(tl.abs(q), 0.5, COMPILED)
            c = ((q.to(tl.int32, bitcast=True) & -2147483648) | 0x4B000100).to(tl.float32,
                                                                             bitcast=True)
            return add_rm(u, c, COMPILED).to(tl.int32, bitcast=True).to(tl.uint8)
        else:
            sign = x.to(tl.int32, bitcast=True) & -2147483648
            v = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
            return fp8_bytes(v, 1, NATIVE)

    @triton.jit
    def _store_words(words, cache_ptr, row, write, C: tl.constexpr, DW: tl.constexpr):
        """Store half C's words ``[R, NW]`` (``_int4_fast_words``; the row's first DW = D / 8
        words in all) at the rows' byte offsets ``row`` ``[R]`` (4-byte aligned), where
        ``write``."""
        NW: tl.constexpr = words.shape[1]
        wi = C * NW + tl.arange(0, NW)
        base = (cache_ptr + row).to(tl.pointer_type(tl.uint32))
        # One word a thread: the hint of 4-byte alignment only (a wider one, the rows', makes
        # Triton move the words between threads through shared memory first, Triton 3.6 and
        # 3.9; a contiguity of 1 does that in 3.6).
        ptrs = tl.multiple_of(base[:, None] + wi[None, :], [1, 4])
        tl.store(ptrs, words, mask=write[:, None] & (wi < DW)[None, :])

    @triton.jit
    def _store_bytes(codes, cache_ptr, row, write, C: tl.constexpr, DQ: tl.constexpr,
                     VEC: tl.constexpr):
        """Store half C's bytes ``[R, HALF]`` (the row's first DQ in all) at the rows' byte
        offsets ``row`` ``[R]``, where ``write``; VEC: the alignment hint, at most one thread's 8
        bytes (a wider one moves them between threads first, as ``_store_words`` says)."""
        HALF: tl.constexpr = codes.shape[1]
        j = C * HALF + tl.arange(0, HALF)
        ptrs = tl.multiple_of(cache_ptr + row[:, None] + j[None, :], [1, VEC])
        tl.store(ptrs, codes, mask=write[:, None] & (j < DQ)[None, :])

    @triton.jit
    def _store_entries(entry, scale_ptr, srow, write, like):
        """Store the entries ``[R]`` at ``srow`` where ``write``, by the thread of each row's
        first element of ``like`` ``[R, N]`` and in its layout (a store of the [R] vector makes
        Triton move it between threads through shared memory first)."""
        first = tl.arange(0, like.shape[1]) == 0
        tl.store(tl.broadcast_to(scale_ptr + srow[:, None], like.shape),
                 tl.broadcast_to(entry[:, None], like.shape), mask=write[:, None] & first[None, :])

    @triton.jit
    def _fast_side(x0, x1, s, y, zc, entry, cache_ptr, scale_ptr, row, srow, write,
                   MODE: tl.constexpr, STEPS: tl.constexpr, D: tl.constexpr, VEC: tl.constexpr,
                   COMPILED: tl.constexpr, NATIVE: tl.constexpr):
        """One side's fast rows: both halves' codes (int4: words), then the entries."""
        if MODE == 2:
            c0 = _int4_fast_words(x0, s, y, zc, STEPS, COMPILED)
            c1 = _int4_fast_words(x1, s, y, zc, STEPS, COMPILED)
            _store_words(c0, cache_ptr, row, write, 0, D // 8)
            _store_words(c1, cache_ptr, row, write, 1, D // 8)
        else:
            c0 = _fast_bytes(x0, s, y, MODE, STEPS, COMPILED, NATIVE)
            c1 = _fast_bytes(x1, s, y, MODE, STEPS, COMPILED, NATIVE)
            _store_bytes(c0, cache_ptr, row, write, 0, D, VEC)
            _store_bytes(c1, cache_ptr, row, write, 1, D, VEC)
        _store_entries(entry, scale_ptr, srow, write, c0)

    @triton.jit
    def _row_offsets(slot, rh, C_B, C_S, C_H, S_B, S_S, S_H, BLOCK_SIZE: tl.constexpr):
        """The byte offsets of rows (slot, head rh) ``[R]`` in a code cache and their scale
        entries' offsets (valid slots)."""
        blk = slot // BLOCK_SIZE
        pg = slot - blk * BLOCK_SIZE
        h = rh.to(tl.int64)
        return blk * C_B + pg * C_S + h * C_H, blk * S_B + pg * S_S + h * S_H

    @triton.jit
    def _general_program(key_ptr, value_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_mapping_ptr,
                         num_tokens, K_TOK, K_HEAD, V_TOK, V_HEAD, KC_B, KC_S, KC_H, VC_B, VC_S,
                         VC_H, KS_B, KS_S, KS_H, VS_B, VS_S, VS_H, NUM_SLOTS, H,
                         BLOCK_SIZE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_H: tl.constexpr, MODE: tl.constexpr, ALIGN: tl.constexpr,
                         NATIVE: tl.constexpr):
        """A program's tile by the general path (every mode, any row): the rows, then the slots,
        then each side's quantization and stores."""
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        t_in = t < num_tokens
        th_ok = t_in[:, None] & (h < H)[None, :]
        t64 = t.to(tl.int64)
        h64 = h.to(tl.int64)
        STEPS: tl.constexpr = 2 if key_ptr.dtype.element_ty == tl.float32 else 1
        DSTEPS: tl.constexpr = STEPS  # amax is an input value
        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        k_ok = th_ok[:, :, None] & (dk < DK)[None, None, :]
        v_ok = th_ok[:, :, None] & (dv < DV)[None, None, :]
        k_row = (t64 * K_TOK)[:, None] + h64[None, :] * K_HEAD
        v_row = (t64 * V_TOK)[:, None] + h64[None, :] * V_HEAD
        xk = tl.load(key_ptr + k_row[:, :, None] + dk[None, None, :], mask=k_ok, other=0.0)
        xv = tl.load(value_ptr + v_row[:, :, None] + dv[None, None, :], mask=v_ok, other=0.0)
        # The slots after the rows, which do not depend on them.
        slot = tl.load(slot_mapping_ptr + t, mask=t_in, other=-1).to(tl.int64)
        valid = t_in & (slot >= 0) & (slot < NUM_SLOTS)
        blk = slot // BLOCK_SIZE
        pg = slot - blk * BLOCK_SIZE
        write = valid[:, None] & (h < H)[None, :]
        ck, ek = _quantize(xk, k_ok, MODE, STEPS, DSTEPS, DK, BLOCK_DK, NATIVE)
        cv, ev = _quantize(xv, v_ok, MODE, STEPS, DSTEPS, DV, BLOCK_DV, NATIVE)
        PACK: tl.constexpr = 2 if MODE == 2 else 1  # elements per code byte
        _store_rows(ck, ek, kc_ptr, ks_ptr, blk, pg, h64, write, KC_B, KC_S, KC_H, KS_B, KS_S,
                    KS_H, DK // PACK, BLOCK_DK // PACK, ALIGN)
        _store_rows(cv, ev, vc_ptr, vs_ptr, blk, pg, h64, write, VC_B, VC_S, VC_H, VS_B, VS_S,
                    VS_H, DV // PACK, BLOCK_DV // PACK, ALIGN)

    @triton.jit(do_not_specialize=["num_tokens", "NUM_SLOTS", "H"])
    def _pth_kernel(
        key_ptr,  # [T_pad, H, DK] via (K_TOK, K_HEAD, 1)
        value_ptr,  # [T_pad', H, DV] via (V_TOK, V_HEAD, 1)
        kc_ptr,  # uint8 view of key_cache [nb, bs, H, E] via (KC_B, KC_S, KC_H, 1)
        vc_ptr,  # uint8 view of value_cache, via (VC_B, VC_S, VC_H, 1)
        ks_ptr,  # float32 k_scale_cache [nb, bs, H] via (KS_B, KS_S, KS_H)
        vs_ptr,  # float32 v_scale_cache via (VS_B, VS_S, VS_H)
        slot_mapping_ptr,  # [T] int64 or int32
        num_tokens,  # T
        K_TOK, K_HEAD, V_TOK, V_HEAD,
        KC_B, KC_S, KC_H, VC_B, VC_S, VC_H,
        KS_B, KS_S, KS_H, VS_B, VS_S, VS_H,
        NUM_SLOTS,  # num_blocks * block_size
        H,
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block
        DK: tl.constexpr,
        DV: tl.constexpr,
        BLOCK_DK: tl.constexpr,  # DK and DV rounded up to powers of two (masked)
        BLOCK_DV: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
        MODE: tl.constexpr,  # 0 int8, 1 fp8, 2 int4
        ALIGN: tl.constexpr,  # bytes: a power of two dividing both caches' rows' addresses
        FAST: tl.constexpr,  # programs take the fast path where all their rows can
        COMPILED: tl.constexpr,  # compiled for a GPU (not Triton's interpreter): add_rm's form
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,  # programmatic dependent launch (pdl_entry)
        NATIVE: tl.constexpr,  # fp8 codes by the float8 conversion (triton_support.native_fp8)
    ):
        pdl_entry(PDL, PDL_TRIGGER)
        if FAST:
            # The tile's rows by halves (_load_half), one decision for the program (a uniform
            # branch): the fast path where every row it writes can take it, else the general
            # path (which loads the rows again, from the caches' lines).
            R: tl.constexpr = BLOCK_T * BLOCK_H
            r = tl.arange(0, R)
            rt = tl.program_id(0) * BLOCK_T + r // BLOCK_H
            rh = tl.program_id(1) * BLOCK_H + r % BLOCK_H
            STEPS: tl.constexpr = 2 if key_ptr.dtype.element_ty == tl.float32 else 1
            row_ok = (rt < num_tokens) & (rh < H)
            k_row = rt.to(tl.int64) * K_TOK + rh.to(tl.int64) * K_HEAD
            v_row = rt.to(tl.int64) * V_TOK + rh.to(tl.int64) * V_HEAD
            xk0, k_ok0 = _load_half(key_ptr, k_row, row_ok, 0, DK, BLOCK_DK)
            xk1, k_ok1 = _load_half(key_ptr, k_row, row_ok, 1, DK, BLOCK_DK)
            xv0, v_ok0 = _load_half(value_ptr, v_row, row_ok, 0, DV, BLOCK_DV)
            xv1, v_ok1 = _load_half(value_ptr, v_row, row_ok, 1, DV, BLOCK_DV)
            slot = tl.load(slot_mapping_ptr + rt, mask=rt < num_tokens, other=-1).to(tl.int64)
            write = row_ok & (slot >= 0) & (slot < NUM_SLOTS)
            fk, sk, yk, zck, ek = _fast_rows(xk0, k_ok0, xk1, k_ok1, MODE, STEPS, DK, BLOCK_DK,
                                             COMPILED)
            fv, sv, yv, zcv, ev = _fast_rows(xv0, v_ok0, xv1, v_ok1, MODE, STEPS, DV, BLOCK_DV,
                                             COMPILED)
            if tl.min(((fk & fv) | ~write).to(tl.int32)) == 1:
                kr, ksr = _row_offsets(slot, rh, KC_B, KC_S, KC_H, KS_B, KS_S, KS_H, BLOCK_SIZE)
                vr, vsr = _row_offsets(slot, rh, VC_B, VC_S, VC_H, VS_B, VS_S, VS_H, BLOCK_SIZE)
                VEC: tl.constexpr = 8 if ALIGN > 8 else ALIGN
                _fast_side(xk0, xk1, sk, yk, zck, ek, kc_ptr, ks_ptr, kr, ksr, write, MODE, STEPS,
                           DK, VEC, COMPILED, NATIVE)
                _fast_side(xv0, xv1, sv, yv, zcv, ev, vc_ptr, vs_ptr, vr, vsr, write, MODE, STEPS,
                           DV, VEC, COMPILED, NATIVE)
            else:
                _general_program(key_ptr, value_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                                 slot_mapping_ptr, num_tokens, K_TOK, K_HEAD, V_TOK, V_HEAD,
                                 KC_B, KC_S, KC_H, VC_B, VC_S, VC_H, KS_B, KS_S, KS_H, VS_B,
                                 VS_S, VS_H, NUM_SLOTS, H, BLOCK_SIZE, DK, DV, BLOCK_DK,
                                 BLOCK_DV, BLOCK_T, BLOCK_H, MODE, ALIGN, NATIVE)
        else:
            _general_program(key_ptr, value_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                             slot_mapping_ptr, num_tokens, K_TOK, K_HEAD, V_TOK, V_HEAD, KC_B,
                             KC_S, KC_H, VC_B, VC_S, VC_H, KS_B, KS_S, KS_H, VS_B, VS_S, VS_H,
                             NUM_SLOTS, H, BLOCK_SIZE, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_T,
                             BLOCK_H, MODE, ALIGN, NATIVE)


def fast_path(mode: PerTokenHeadMode, dk: int, dv: int, align: int, small: bool,
              tuning: TritonTuning = TUNING) -> bool:
    """Whether a call's kernel has the fast path: the large calls' tiling (``small``: the call
    takes the small grids', :func:`small_call`; there the fast path's per-row division and the
    program's decision lengthen the chain that is the call's latency: 2.03 against 1.65 us at
    T = 1, H = 8, D = 128, int4, H200), head sizes of at least 16 (halves of 8 or more), int4's
    whole words of codes in each half (head sizes multiples of 8, rows 4-byte aligned), and
    ``tuning.fast_path``."""
    if small or not tuning.fast_path or min(dk, dv) < 16:
        return False
    return not (mode is PerTokenHeadMode.INT4_PER_TOKEN_HEAD and (dk % 8 or dv % 8 or align < 4))


def run(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
        value_cache: torch.Tensor, k_scale_cache: torch.Tensor, v_scale_cache: torch.Tensor,
        slot_mapping: torch.Tensor, mode: PerTokenHeadMode, *,
        tuning: TritonTuning = TUNING) -> None:
    """Launch the kernel on PyTorch's current stream; arguments as validated by the public op."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    h, dk, dv = key.shape[1], key.shape[2], value.shape[2]
    nb, bs = key_cache.shape[:2]
    small = small_call(num_tokens, h, dk, dv, tuning)
    block_t, block_h, warps = tiling(h, dk, dv, tuning, small)  # call_tiling's
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(h, block_h))
    pdl, trigger = triton_support.pdl_launch(key.device, grid[0] * grid[1],
                                             tuning.pdl_max_programs,
                                             tuning.pdl_trigger_max_programs)
    kc, vc = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    align = gather_cuda.align([kc.data_ptr(), vc.data_ptr(), *kc.stride()[:3], *vc.stride()[:3]])
    _pth_kernel[grid](
        key, value, kc, vc, k_scale_cache, v_scale_cache, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *kc.stride()[:3], *vc.stride()[:3], *k_scale_cache.stride(), *v_scale_cache.stride(),
        nb * bs, h, BLOCK_SIZE=bs,
        DK=dk, DV=dv, BLOCK_DK=next_pow2(dk), BLOCK_DV=next_pow2(dv),
        BLOCK_T=block_t, BLOCK_H=block_h, MODE=_MODE[mode], ALIGN=align,
        FAST=fast_path(mode, dk, dv, align, small, tuning),
        COMPILED=key.device.type == "cuda", NATIVE=triton_support.native_fp8(key.device),
        PDL=pdl, PDL_TRIGGER=trigger, num_warps=warps, launch_pdl=pdl,
    )

