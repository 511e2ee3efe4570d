"""The Triton implementation of reshape_and_cache_turboquant: one kernel for the four presets.

A program writes one (token, head): it loads the slot (a negative or out-of-range one masks
every store), the key and value rows ``[BLOCK_D]`` (``BLOCK_D`` the power of two >= D, +0 past
D) and computes SPEC §10.2 step by step with one IEEE float32 operation per step, launched with
``enable_fp_fusion=False`` (no product is contracted into an FMA):

- keys, k8v4: e4m3fn codes of ``x`` by ``kvwrite.kernels.triton_nvfp4.e4m3`` on ``|x|`` (integer
  encoded: nearest even, saturating at 448, subnormals) with the sign bit put back; a NaN's code
  is 0x7F (the GPU's satfinite conversion's).
- keys, MSE: ``ss`` by ``kvwrite.kernels.triton_qk_norm.tree_sum`` (§7.1's padded pairwise tree),
  ``n = sqrt_rn(ss)``, ``den = n + 1e-8``, ``u = div_rn(x, den)`` (+0 past D: the tree's padding
  leaves), then for blocks of ``BLOCK_J`` outputs the products ``u_i * PiT[i, j]`` ``[BLOCK_J,
  BLOCK_D]`` summed over i by the same tree, ``idx_j`` the count of midpoints ``<= y_j``, packed
  (4-bit: element 2j in the low nibble of byte j; 3-bit: 8 codes in 3 bytes, little-endian bit
  order), ``fp16(n)`` after the field (a NaN norm as 0x7E00, the CUDA kernel's).
- values: min and max over the non-NaN elements, ``s = div_rn(mx - mn, L)`` floored to 1e-8,
  ``q = clamp(rhu(div_rn(v - mn, s)), 0, L)`` (``kvwrite.kernels.triton_round.rhu`` after a clamp
  to ``L + 1``, NaN -> 0), ``fp16(s)``, ``fp16(mn)``.

Every byte goes out in a byte store (the slot's fields are at any byte offset). bfloat16 inputs
arrive as their int16 bits and are widened by a shift (the interpreter's bfloat16 cast mangles
subnormals). On CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``); its
float32 -> float16 cast is exact, and no float8 cast is used, so every preset and input dtype is
exact there. Head sizes up to 512 (the tree helper's width).
"""

from __future__ import annotations

import dataclasses

import torch

from ...kernels import triton_support
from ...kernels.triton_fp8 import IMPORT_ERROR as _IMPORT_ERROR
from ...kernels.triton_fp8 import pdl_entry, tl, triton
from ...kernels.triton_support import PdlTuning, next_pow2

__all__ = ["TritonTuning", "TUNING", "available", "unsupported", "run", "rows_per_program",
           "MAX_HEAD_SIZE"]

MAX_HEAD_SIZE = 512  # triton_qk_norm.tree_sum's widest tree

if triton is not None:
    from ...kernels.triton_nvfp4 import e4m3, widen
    from ...kernels.triton_qk_norm import tree_sum
    from ...kernels.triton_round import rhu


def available(device: torch.device) -> str | None:
    return triton_support.available(device, triton, lambda: _tq_kernel, _IMPORT_ERROR)


def unsupported(key, kv_cache, preset) -> str | None:
    d = key.shape[2]
    if d > MAX_HEAD_SIZE:
        return f"head size {d} > {MAX_HEAD_SIZE}: the triton kernel's widest tree (torch runs it)"
    return None


# eq=False: hashed and compared by identity.
@dataclasses.dataclass(frozen=True, eq=False)
class TritonTuning(PdlTuning):
    """Launch constants (the rows kernel's measured; the rest not measured yet)."""

    num_warps: int = 4
    # Elements of one block of rotation products [BLOCK_J, BLOCK_D].
    product_elems: int = 4096
    # k8v4 calls of at least k8v4_rows_min (token, head) rows take the rows kernel: a program
    # of rows_warps warps for BLOCK_R rows (rows_per_program: at most rows_elems elements, and
    # at least rows_programs programs while BLOCK_R > 1); smaller calls a program a row.
    # Measured on an H200 (k8v4, H = 8, D = 128, cold; tuning-log 94): against a program a row
    # 0.90 at T = 64, 0.55 at T = 1024, 0.39 at T = 16384; BLOCK_R 4 fastest from T = 1024,
    # 2 at T = 512, 1 below; 2 or 4 warps a program slower.
    k8v4_rows_min: int = 512
    rows_elems: int = 512
    rows_programs: int = 2048
    rows_warps: int = 1


TUNING = TritonTuning()


if triton is not None:

    @triton.jit
    def _value_range(xv, ok, AXIS: tl.constexpr):
        """A value row's least and greatest elements where ``ok`` (not NaN, inside the row)
        along AXIS: both 0 where there is none, a zero minimum +0."""
        mn = tl.min(tl.where(ok, xv, float("inf")), axis=AXIS)
        mx = tl.max(tl.where(ok, xv, -float("inf")), axis=AXIS)
        none = ~(mn <= mx)
        return tl.where(none | (mn == 0.0), 0.0, mn), tl.where(none, 0.0, mx)

    @triton.jit
    def _e4m3_key_codes(xk):
        """k8v4's key codes: e4m3fn of each element, a NaN's 0x7F whatever its sign."""
        code, _ = e4m3(tl.abs(xk))
        sign = (xk.to(tl.int32, bitcast=True) >> 24) & 0x80
        return tl.where(xk != xk, 0x7F, code | sign)

    @triton.jit
    def _value_scale(rng, L: tl.constexpr):
        """s = RN(rng / L), FL (1e-8) unless s > FL (a NaN rng gives FL)."""
        s = tl.math.div_rn(rng, tl.full(rng.shape, L, tl.float32))
        return tl.where(s > 1e-8, s, 1e-8)

    @triton.jit
    def _value_codes_by_division(w, s, L: tl.constexpr):
        """The contract's value codes: clamp(rhu(RN(w / s)), 0, L), a NaN quotient 0."""
        q = tl.math.div_rn(w, s)
        q = tl.minimum(tl.maximum(tl.where(q == q, q, 0.0), 0.0), L + 1.0)
        return tl.minimum(rhu(q), L).to(tl.int32)

    @triton.jit
    def _f16_bits(v):
        """fp16(v)'s bits (nearest even, overflow to inf, subnormals kept); a NaN as 0x7E00 (as
        the CUDA kernel: the contract leaves its encoding free)."""
        b = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return tl.where(v == v, b, 0x7E00)

    @triton.jit
    def _f16_bytes(ptr, v, mask):
        """Store fp16(v) little-endian at ptr (a scalar)."""
        b = _f16_bits(v)
        tl.store(ptr, (b & 255).to(tl.uint8), mask=mask)
        tl.store(ptr + 1, (b >> 8).to(tl.uint8), mask=mask)

    @triton.jit
    def _f16_bytes_rows(ptr, v, mask):
        """Store fp16(v[r]) little-endian at ptr[r] for a [BLOCK_R] vector, as one [BLOCK_R, 2]
        store. Measured on an H200 (Triton 3.6): _f16_bytes' two [BLOCK_R] stores of a row's
        reduced values wrote wrong bytes for some rows in programs of one warp with BLOCK_D <= 16
        and BLOCK_R * BLOCK_D of 128 or 256 (right under the interpreter, with two warps, and as
        here)."""
        two = tl.arange(0, 2)
        b = (_f16_bits(v)[:, None] >> (8 * two)[None, :]) & 255
        tl.store(ptr[:, None] + two[None, :], b.to(tl.uint8), mask=mask[:, None])

    @triton.jit
    def _store_field(ptr, codes, first, n, BITS: tl.constexpr, BJ: tl.constexpr, valid):
        """Store the b-bit codes ``[BJ]`` of elements first .. first + BJ of a field of ``n``
        elements (first a multiple of 8 for 3-bit fields, of 2 for 4-bit ones)."""
        if BITS == 4:
            lo, hi = tl.split(tl.reshape(codes, [BJ // 2, 2]))
            byte = first // 2 + tl.arange(0, BJ // 2)
            tl.store(ptr + byte, (lo | (hi << 4)).to(tl.uint8), mask=valid & (byte < n // 2))
        else:
            g = tl.reshape(codes, [BJ // 8, 8])
            shift = 3 * tl.arange(0, 8)
            w = tl.sum(g << shift[None, :], axis=1)
            grp = first // 8 + tl.arange(0, BJ // 8)
            ok = valid & (grp < n // 8)
            tl.store(ptr + 3 * grp, (w & 255).to(tl.uint8), mask=ok)
            tl.store(ptr + 3 * grp + 1, ((w >> 8) & 255).to(tl.uint8), mask=ok)
            tl.store(ptr + 3 * grp + 2, ((w >> 16) & 255).to(tl.uint8), mask=ok)

    @triton.jit(do_not_specialize=["NUM_SLOTS", "H"])
    def _tq_kernel(
        key_ptr,  # [T_pad, H, D] via (K_TOK, K_HEAD, 1); bfloat16 as int16 bits
        value_ptr,  # via (V_TOK, V_HEAD, 1)
        cache_ptr,  # uint8 [nb, bs, H, S] via (C_B, C_S, C_H, 1)
        slot_mapping_ptr,  # [T] int32 or int64
        pit_ptr,  # MSE: float32 [D, D] via (P_0, P_1)
        mid_ptr,  # MSE: float32 [2^KB - 1] via MID_S
        K_TOK, K_HEAD, V_TOK, V_HEAD, C_B, C_S, C_H, P_0, P_1, MID_S,
        NUM_SLOTS, H,
        BLOCK_SIZE: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_J: tl.constexpr,
        KB: tl.constexpr,  # key bits: 8 (k8v4), 4 or 3
        VB: tl.constexpr,  # value bits: 4 or 3
        KPS: tl.constexpr,  # key part bytes
        BF16_BITS: tl.constexpr,
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,
    ):
        pdl_entry(PDL, PDL_TRIGGER)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        i = tl.arange(0, BLOCK_D)
        im = i < D
        xk = widen(tl.load(key_ptr + t * K_TOK + h * K_HEAD + i, mask=im, other=0), BF16_BITS)
        xv = widen(tl.load(value_ptr + t * V_TOK + h * V_HEAD + i, mask=im, other=0), BF16_BITS)
        slot = tl.load(slot_mapping_ptr + t + tl.arange(0, 1)).to(tl.int64)  # [1]: masks broadcast
        valid = (slot >= 0) & (slot < NUM_SLOTS)
        blk = slot // BLOCK_SIZE
        dst = cache_ptr + blk * C_B + (slot - blk * BLOCK_SIZE) * C_S + h * C_H

        # ---- keys ----
        if KB == 8:
            tl.store(dst + i, _e4m3_key_codes(xk).to(tl.uint8), mask=valid & im)
        else:
            NM: tl.constexpr = (1 << KB) - 1
            k = tl.arange(0, NM + 1)
            mids = tl.load(mid_ptr + k * MID_S, mask=k < NM, other=float("inf"))
            ss = tl.reshape(tree_sum((xk * xk)[None, None, :], BLOCK_D), [1])
            n = tl.sqrt_rn(ss)
            den = n + 1e-8
            u = tl.where(im, tl.math.div_rn(xk, tl.broadcast_to(den, [BLOCK_D])), 0.0)
            for jb in range(0, BLOCK_D // BLOCK_J):
                j = jb * BLOCK_J + tl.arange(0, BLOCK_J)
                pm = (j < D)[:, None] & im[None, :]
                pit = tl.load(pit_ptr + i[None, :].to(tl.int64) * P_0 + j[:, None].to(tl.int64) * P_1,
                              mask=pm, other=0.0)
                prod = tl.where(im[None, :], u[None, :] * pit, 0.0)  # [BLOCK_J, BLOCK_D]
                y = tl.reshape(tree_sum(prod[:, None, :], BLOCK_D), [BLOCK_J])
                # The +inf padding midpoint never counts (y >= inf only for y = inf: excluded).
                cnt = tl.sum(((y[:, None] >= mids[None, :]) & (k < NM)[None, :]).to(tl.int32),
                             axis=1)
                _store_field(dst, cnt, jb * BLOCK_J, D, KB, BLOCK_J, valid)
            KF_BYTES: tl.constexpr = D * KB // 8
            _f16_bytes(dst + KF_BYTES + tl.arange(0, 1), n, valid)

        # ---- values ----
        L: tl.constexpr = (1 << VB) - 1
        mn, mx = _value_range(xv, im & (xv == xv), 0)
        s = _value_scale(tl.full([1], 0.0, tl.float32) + (mx - mn), L)
        c = _value_codes_by_division(xv - mn, tl.broadcast_to(s, [BLOCK_D]), L)
        vdst = dst + KPS
        _store_field(vdst, c, 0, D, VB, BLOCK_D, valid)
        VDB: tl.constexpr = D * VB // 8
        _f16_bytes(vdst + VDB + tl.arange(0, 1), s, valid)
        _f16_bytes(vdst + VDB + 2 + tl.arange(0, 1), tl.broadcast_to(mn, [1]), valid)


if triton is not None:

    @triton.jit(do_not_specialize=["NUM_SLOTS", "H", "ROWS"])
    def _tq_k8v4_rows_kernel(
        key_ptr, value_ptr, cache_ptr, slot_mapping_ptr,  # as _tq_kernel's
        K_TOK, K_HEAD, V_TOK, V_HEAD, C_B, C_S, C_H,
        NUM_SLOTS, H, ROWS,  # ROWS = T * H
        BLOCK_SIZE: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr,  # rows a program
        KPS: tl.constexpr,
        BF16_BITS: tl.constexpr,
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,
    ):
        """turboquant_k8v4 for BLOCK_R (token, head) rows a program (row r = t * H + h): the
        steps of _tq_kernel's k8v4 keys and 4-bit values, each row's reductions along axis 1."""
        pdl_entry(PDL, PDL_TRIGGER)
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        rm = r < ROWS
        t = r // H
        h = r - t * H
        i = tl.arange(0, BLOCK_D)
        im = i < D
        m2 = rm[:, None] & im[None, :]
        xk = widen(tl.load(key_ptr + (t * K_TOK + h * K_HEAD)[:, None] + i[None, :], mask=m2,
                           other=0), BF16_BITS)
        xv = widen(tl.load(value_ptr + (t * V_TOK + h * V_HEAD)[:, None] + i[None, :], mask=m2,
                           other=0), BF16_BITS)
        slot = tl.load(slot_mapping_ptr + t, mask=rm, other=-1).to(tl.int64)
        valid = rm & (slot >= 0) & (slot < NUM_SLOTS)
        blk = slot // BLOCK_SIZE
        dst = cache_ptr + blk * C_B + (slot - blk * BLOCK_SIZE) * C_S + h * C_H  # [BLOCK_R]

        # ---- keys: e4m3fn codes, a NaN's 0x7F ----
        tl.store(dst[:, None] + i[None, :], _e4m3_key_codes(xk).to(tl.uint8),
                 mask=valid[:, None] & im[None, :])

        # ---- values: 4-bit codes, fp16(s), fp16(mn) ----
        mn, mx = _value_range(xv, m2 & (xv == xv), 1)
        s = _value_scale(mx - mn, 15)
        w = xv - mn[:, None]
        # The codes as the CUDA kernel's tq_value_codes takes them (its comment has the proof):
        # k = floor(RN(w * RN(1/s))), then k + [RN(RN(w - s B) + s d) >= 0] for B = k + 1/2, d
        # half the gap below B; rows whose s is out of [2^-60, 2^60] divide (div_rn).
        ys = tl.math.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), s)
        k = tl.floor(tl.maximum(w * ys[:, None], 0.0))
        B = k + 0.5
        sb = tl.broadcast_to(s[:, None], [BLOCK_R, BLOCK_D])
        rem = tl.fma(-sb, B, w)
        d = (((B.to(tl.int32, bitcast=True) - 1) & 0x7F800000) - (24 << 23)).to(
            tl.float32, bitcast=True)
        c = k.to(tl.int32) + ((rem + sb * d) >= 0.0).to(tl.int32)
        fast = (s >= 8.673617379884035e-19) & (s <= 1.152921504606847e18)  # 2^-60, 2^60
        if tl.min(fast.to(tl.int32), axis=0) == 0:  # a row with s out of range (inf, NaN)
            c = tl.where(fast[:, None], c, _value_codes_by_division(w, sb, 15))
        lo, hi = tl.split(tl.reshape(c, [BLOCK_R, BLOCK_D // 2, 2]))
        byte = tl.arange(0, BLOCK_D // 2)
        vdst = dst + KPS
        tl.store(vdst[:, None] + byte[None, :], (lo | (hi << 4)).to(tl.uint8),
                 mask=valid[:, None] & (byte < D // 2)[None, :])
        VDB: tl.constexpr = D // 2
        _f16_bytes_rows(vdst + VDB, s, valid)
        _f16_bytes_rows(vdst + VDB + 2, mn, valid)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def rows_per_program(rows: int, block_d: int, tuning: TritonTuning = TUNING) -> int:
    """BLOCK_R of the k8v4 rows kernel for a call of ``rows`` rows: the largest power of two
    with BLOCK_R * BLOCK_D <= rows_elems and rows / BLOCK_R >= rows_programs (at least 1)."""
    block_r = 1
    while (2 * block_r * block_d <= tuning.rows_elems
           and rows // (2 * block_r) >= tuning.rows_programs):
        block_r *= 2
    return block_r


def run(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor, preset, PiT: torch.Tensor | None,
        midpoints: torch.Tensor | None, *, tuning: TritonTuning = TUNING) -> None:
    """Launch the kernel on PyTorch's current stream; arguments as validated by the public op."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    h, d = key.shape[1], key.shape[2]
    nb, bs = kv_cache.shape[:2]
    kb, vb = int(preset.key_bits), int(preset.value_bits)
    block_d = next_pow2(d)
    # At most BLOCK_D, at least 8 where BLOCK_D allows (3-bit fields pack 8 codes at a time).
    block_j = min(block_d, max(8, tuning.product_elems // block_d))
    mse = kb != 8
    rows = num_tokens * h
    if not mse and rows >= tuning.k8v4_rows_min:
        block_r = rows_per_program(rows, block_d, tuning)
        programs = -(-rows // block_r)
        pdl, trigger = triton_support.pdl_launch(key.device, programs, tuning.pdl_max_programs,
                                                 tuning.pdl_trigger_max_programs)
        _tq_k8v4_rows_kernel[(programs,)](
            _bits(key), _bits(value), kv_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            *kv_cache.stride()[:3], nb * bs, h, rows,
            BLOCK_SIZE=bs, D=d, BLOCK_D=block_d, BLOCK_R=block_r,
            KPS=int(preset.key_packed_size), BF16_BITS=key.dtype == torch.bfloat16,
            PDL=pdl, PDL_TRIGGER=trigger, num_warps=tuning.rows_warps, launch_pdl=pdl,
            enable_fp_fusion=False,
        )
        return
    pit = PiT if mse else kv_cache  # any pointer: never read for k8v4
    mid = midpoints if mse else kv_cache
    grid = (num_tokens, h)
    pdl, trigger = triton_support.pdl_launch(key.device, num_tokens * h,
                                             tuning.pdl_max_programs,
                                             tuning.pdl_trigger_max_programs)
    _tq_kernel[grid](
        _bits(key), _bits(value), kv_cache, slot_mapping, pit, mid,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *kv_cache.stride()[:3], *(PiT.stride() if mse else (0, 0)),
        midpoints.stride(0) if mse else 0, nb * bs, h,
        BLOCK_SIZE=bs, D=d, BLOCK_D=block_d, BLOCK_J=block_j, KB=kb, VB=vb,
        KPS=int(preset.key_packed_size), BF16_BITS=key.dtype == torch.bfloat16,
        PDL=pdl, PDL_TRIGGER=trigger, num_warps=tuning.num_warps, launch_pdl=pdl,
        enable_fp_fusion=False,
    )
