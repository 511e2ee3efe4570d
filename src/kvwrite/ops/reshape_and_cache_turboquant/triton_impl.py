"""The Triton implementation of reshape_and_cache_turboquant: two kernels for the four presets.

``_tq_rows_kernel`` (every MSE call; k8v4 calls of k8v4_rows_min rows and more) writes BLOCK_R
(token, head) rows a pass, the rows as ``[BLOCK_R, BLOCK_D]`` tiles (``BLOCK_D`` the power of two
>= D, +0 past D), each row's reductions along axis 1; ``_tq_kernel`` (k8v4's smaller calls)
writes one row a program. Both compute SPEC §10.2 step by step with one IEEE float32 operation
per step, launched with ``enable_fp_fusion=False`` (no product is contracted into an FMA; the
few ``tl.fma`` are explicit):

- keys, k8v4: e4m3fn codes of ``x`` by ``kvwrite.kernels.triton_fp8.e4m3`` on ``|x|`` (integer
  encoded: nearest even, saturating at 448, subnormals) with the sign bit put back; a NaN's code
  is 0x7F (the GPU's satfinite conversion's).
- keys, MSE: ``ss`` by §7.1's padded pairwise tree, ``n = sqrt_rn(ss)``, ``den = n + 1e-8``,
  ``u = RN(x / den)`` (+0 past D; the rows kernel by the product with RN(1 / den) and two
  fused corrections, as the CUDA kernel's tq_div_row), then ``y_j`` = the tree over i of
  ``RN(u_i * PiT[i, j])``: in the rows kernel by the butterflies of ``RN(u * PiT[0, 0])`` where
  D is a power of two and ``_tq_table_kernel`` found PiT to be PiT[0, 0] times Sylvester's
  signs bit for bit (checked on every call, before the rows kernel, which reads its flags),
  else by the products ``[BLOCK_J, BLOCK_D]`` summed by the tree (a row at a time in the rows
  kernel); ``idx_j`` the count of midpoints ``<= y_j`` (a binary search where the midpoints
  ascend, each program checking that once), packed (4-bit: element 2j in the low nibble of byte
  j; 3-bit: 8 codes in 3 bytes, little-endian bit order), ``fp16(n)`` after the field (a NaN
  norm as 0x7E00, the CUDA kernel's).
- values: min and max over the non-NaN elements, ``s = div_rn(mx - mn, L)`` floored to 1e-8,
  ``q = clamp(rhu(div_rn(v - mn, s)), 0, L)`` (the rows kernel without the division: the CUDA
  kernel's product, two fused corrections and two sums rounded toward -inf), ``fp16(s)``,
  ``fp16(mn)``.

Every byte goes out in a byte store (the slot's fields are at any byte offset), but k8v4 slots
at one row a program of the rows kernel, stored as 4-byte words where every slot is 4-byte
aligned (``word_slots``). bfloat16 inputs arrive as their int16 bits and are widened by a shift
(the interpreter's bfloat16 cast mangles subnormals). On CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``); its
float32 -> float16 cast is exact, and no float8 cast is used, so every preset and input dtype is
exact there. Head sizes up to 512 (the tree helper's width).
"""

from __future__ import annotations

import dataclasses

import torch

from ...kernels import triton_support
from ...kernels.triton_fp8 import IMPORT_ERROR as _IMPORT_ERROR
from ...kernels.triton_fp8 import corrected_quotient, pdl_entry, tl, triton
from ...kernels.triton_support import PdlTuning, next_pow2

__all__ = ["TritonTuning", "TUNING", "available", "unsupported", "run", "rows_per_program",
           "word_slots", "MAX_HEAD_SIZE"]

MAX_HEAD_SIZE = 512  # triton_qk_norm.tree_sum's widest tree

if triton is not None:
    from ...kernels.triton_fp8 import e4m3
    from ...kernels.triton_nvfp4 import widen
    from ...kernels.triton_qk_norm import row_tree, tree_sum
    from ...kernels.triton_round import rhu, rhu_bits


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
    # MSE calls of at least mse_rows_min rows take the rows kernel: BLOCK_R rows a pass (the
    # largest power of two within mse_rows_elems elements; one row for calls of at most
    # mse_small_rows rows), programs of mse_warps warps, at most mse_programs_per_sm an SM
    # striding over the passes. Where D is a power of two a table kernel checks PiT first
    # (check_elems entries a program of check_warps warps); the dense rotation takes
    # dense_elems products a thread a step. Measured on an H200 (4bit_nc, H = 8, D = 128, bf16,
    # cold; tuning-log 98), µs at T = 1 / 1024 / 16384: BLOCK_R 2, one warp, 16 programs an SM
    # 5.20 / 12.7 / 147; BLOCK_R 4: 7.01 / 14.7 / 185 (8 an SM: 223); two warps 4.84 / 18.2 /
    # 227; four warps 4.84 / 18.4 / 233 (BLOCK_R 8: 262). BLOCK_R 1 against 2 at T = 1 / 16 /
    # 64 / 256 / 1024: 4bit_nc 3.78 / 3.96 / 4.18 / 5.98 / 13.0 against 5.21 / 5.38 / 5.66 /
    # 6.71 / 12.9, 3bit_nc 4.28 / 4.47 / 4.71 / 6.52 / 15.0 against 4.75 / 4.80 / 5.08 / 5.96 /
    # 11.3. The program-a-row kernel: 8.37 / 244 / 3759, so every MSE call takes the rows kernel.
    mse_rows_min: int = 0
    mse_rows_elems: int = 256
    mse_small_rows: int = 512
    mse_warps: int = 1
    mse_programs_per_sm: int = 16
    check_elems: int = 2048
    check_warps: int = 4
    dense_elems: int = 32


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

    @triton.jit
    def _parity(x):
        """popcount(x) & 1 of a non-negative int32 below 2^16."""
        x = x ^ (x >> 8)
        x = x ^ (x >> 4)
        x = x ^ (x >> 2)
        x = x ^ (x >> 1)
        return x & 1

    @triton.jit
    def _tq_table_kernel(pit_ptr, P_0, P_1, flags_ptr, D: tl.constexpr,
                         CHECK_ROWS: tl.constexpr, PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr):
        """flags[p] = 0 where rows [p * CHECK_ROWS, (p + 1) * CHECK_ROWS) of PiT are
        (-1)^popcount(i & j) * PiT[0, 0] bit for bit (D a power of two), else 1: the table the
        butterflies compute, checked once a call (the rows kernel reads every flag)."""
        pdl_entry(PDL, PDL_TRIGGER)
        p = tl.program_id(0)
        hb = tl.load(pit_ptr).to(tl.int32, bitcast=True)
        i = p * CHECK_ROWS + tl.arange(0, CHECK_ROWS)
        j = tl.arange(0, D)
        w = tl.load(pit_ptr + i[:, None].to(tl.int64) * P_0 + j[None, :].to(tl.int64) * P_1)
        want = hb ^ (_parity(i[:, None] & j[None, :]) << 31)
        bad = tl.max(tl.max((w.to(tl.int32, bitcast=True) != want).to(tl.int32), axis=1), axis=0)
        tl.store(flags_ptr + p, bad)

    @triton.jit
    def _ascending(mid_ptr, MID_S, NM: tl.constexpr):
        """True where m_k <= m_{k+1} for every k (a NaN midpoint fails): the midpoints a search
        may take instead of the count."""
        k = tl.arange(0, NM + 1)
        inner = k < NM - 1
        a = tl.load(mid_ptr + k * MID_S, mask=inner, other=0.0)
        b = tl.load(mid_ptr + (k + 1) * MID_S, mask=inner, other=0.0)
        return tl.min(((a <= b) | ~inner).to(tl.int32), axis=0) == 1

    @triton.jit
    def _mid(mid_ptr, MID_S, K: tl.constexpr):
        return tl.load(mid_ptr + K * MID_S)

    @triton.jit
    def _searched_codes(y, mid_ptr, MID_S, KB: tl.constexpr):
        """idx = #{k : y >= m_k} for ascending midpoints (then a prefix of them counts): a binary
        search whose thresholds are selected by the bits found so far (a NaN y fails every
        compare: 0)."""
        if KB == 4:
            b3 = y >= _mid(mid_ptr, MID_S, 7)
            b2 = y >= tl.where(b3, _mid(mid_ptr, MID_S, 11), _mid(mid_ptr, MID_S, 3))
            b1 = y >= tl.where(b3, tl.where(b2, _mid(mid_ptr, MID_S, 13), _mid(mid_ptr, MID_S, 9)),
                               tl.where(b2, _mid(mid_ptr, MID_S, 5), _mid(mid_ptr, MID_S, 1)))
            t_hi = tl.where(b2, tl.where(b1, _mid(mid_ptr, MID_S, 14), _mid(mid_ptr, MID_S, 12)),
                            tl.where(b1, _mid(mid_ptr, MID_S, 10), _mid(mid_ptr, MID_S, 8)))
            t_lo = tl.where(b2, tl.where(b1, _mid(mid_ptr, MID_S, 6), _mid(mid_ptr, MID_S, 4)),
                            tl.where(b1, _mid(mid_ptr, MID_S, 2), _mid(mid_ptr, MID_S, 0)))
            b0 = y >= tl.where(b3, t_hi, t_lo)
            idx = (b3.to(tl.int32) * 8 + b2.to(tl.int32) * 4 + b1.to(tl.int32) * 2
                   + b0.to(tl.int32))
        else:
            b2 = y >= _mid(mid_ptr, MID_S, 3)
            b1 = y >= tl.where(b2, _mid(mid_ptr, MID_S, 5), _mid(mid_ptr, MID_S, 1))
            b0 = y >= tl.where(b2, tl.where(b1, _mid(mid_ptr, MID_S, 6), _mid(mid_ptr, MID_S, 4)),
                               tl.where(b1, _mid(mid_ptr, MID_S, 2), _mid(mid_ptr, MID_S, 0)))
            idx = b2.to(tl.int32) * 4 + b1.to(tl.int32) * 2 + b0.to(tl.int32)
        return idx

    @triton.jit
    def _counted_codes(y, mid_ptr, MID_S, NM: tl.constexpr):
        """idx = #{k : y >= m_k}, counted (midpoints in any order)."""
        idx = tl.zeros(y.shape, tl.int32)
        for k in tl.static_range(NM):
            idx += (y >= _mid(mid_ptr, MID_S, k)).to(tl.int32)
        return idx

    @triton.jit
    def _mse_codes(y, mid_ptr, MID_S, ascending, KB: tl.constexpr):
        """The MSE key indices of rotated coordinates y (a program-uniform choice of method)."""
        if ascending:
            c = _searched_codes(y, mid_ptr, MID_S, KB)
        else:
            c = _counted_codes(y, mid_ptr, MID_S, (1 << KB) - 1)
        return c

    @triton.jit
    def _butterflies(p, R: tl.constexpr, N: tl.constexpr):
        """The fast Walsh-Hadamard transform of rows p [R, N] (N a power of two), strides 1, 2,
        4, ...: each butterfly (a, b) -> (RN(a + b), RN(a - b)), the contract's tree over i of
        RN(u_i * PiT[i, j]) for PiT = PiT[0, 0] * Sylvester's signs when p = RN(u * PiT[0, 0])
        (kernel.cu's "Hadamard" has the proof; zeros' signs may differ, which no count reads).
        Each stage is two tl.sum over an axis of 2 (one addition each; a shuffle where the pair
        spans two lanes), so no stage moves the tile between layouts."""
        for lvl in tl.static_range(10):
            if (1 << lvl) < N:
                p = _butterfly_stage(p, R, N, lvl)
        return p

    @triton.jit
    def _butterfly_stage(p, R: tl.constexpr, N: tl.constexpr, LVL: tl.constexpr):
        """One stage of _butterflies: elements i and i + 2^LVL (bit LVL of i clear) paired."""
        S: tl.constexpr = 1 << LVL
        y4 = tl.reshape(p, [R, N // (2 * S), 2, S])
        upper = (tl.arange(0, 2) == 1)[None, None, :, None]
        add = tl.sum(y4, axis=2)[:, :, None, :]
        sub = tl.sum(tl.where(upper, -y4, y4), axis=2)[:, :, None, :]
        return tl.reshape(tl.where(upper, sub, add), [R, N])

    @triton.jit
    def _store_field_rows(ptr, codes, first, n, BITS: tl.constexpr, R: tl.constexpr,
                          BJ: tl.constexpr, valid):
        """Store the b-bit codes ``[R, BJ]`` of elements first .. first + BJ of each row's field
        of ``n`` elements at ``ptr`` ``[R]`` (first a multiple of 8 for 3-bit fields, of 2 for
        4-bit ones); rows not ``valid`` store nothing."""
        if BITS == 4:
            lo, hi = tl.split(tl.reshape(codes, [R, BJ // 2, 2]))
            byte = first // 2 + tl.arange(0, BJ // 2)
            tl.store(ptr[:, None] + byte[None, :], (lo | (hi << 4)).to(tl.uint8),
                     mask=valid[:, None] & (byte < n // 2)[None, :])
        else:
            g = tl.reshape(codes, [R, BJ // 8, 8])
            w = tl.sum(g << (3 * tl.arange(0, 8))[None, None, :], axis=2)  # [R, BJ // 8]
            grp = first // 8 + tl.arange(0, BJ // 8)
            k = tl.arange(0, 4)
            b = (w[:, :, None] >> (8 * k)[None, None, :]) & 255
            ok = (valid[:, None] & (grp < n // 8)[None, :])[:, :, None] & (k < 3)[None, None, :]
            tl.store(ptr[:, None, None] + (3 * grp)[None, :, None] + k[None, None, :],
                     b.to(tl.uint8), mask=ok)

    @triton.jit
    def _rows_value_codes(xv, m2, VB: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_D: tl.constexpr, COMPILED: tl.constexpr):
        """The value part of rows xv [BLOCK_R, BLOCK_D] (m2: inside the row and the call): the
        VB-bit codes [BLOCK_R, BLOCK_D], s and mn [BLOCK_R]."""
        L: tl.constexpr = (1 << VB) - 1
        mn, mx = _value_range(xv, m2 & (xv == xv), 1)
        s = _value_scale(mx - mn, L)
        w = xv - mn[:, None]
        # The codes as the CUDA kernel's tq_value_codes takes them (its comment has the proof):
        # q = RN(w / s) by the product with RN(1 / s) and two fused corrections (any q below
        # 1/2 where w / s < 1/4), the code floor(max(q, 0) + 1/2) by two sums rounded toward
        # -inf; rows whose s is out of [2^-60, 2^60] divide (div_rn).
        ys = tl.math.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), s)
        sb = tl.broadcast_to(s[:, None], [BLOCK_R, BLOCK_D])
        q = tl.maximum(corrected_quotient(w, sb, ys[:, None], 2), 0.0)
        c = rhu_bits(q, COMPILED) - 0x4B000000
        fast = (s >= 8.673617379884035e-19) & (s <= 1.152921504606847e18)  # 2^-60, 2^60
        if tl.min(fast.to(tl.int32), axis=0) == 0:  # a row with s out of range (inf, NaN)
            c = tl.where(fast[:, None], c, _value_codes_by_division(w, sb, L))
        return c, s, mn

    @triton.jit
    def _rows_values(vdst, xv, m2, valid, VB: tl.constexpr, D: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, COMPILED: tl.constexpr):
        """The value part of rows xv [BLOCK_R, BLOCK_D] (m2: inside the row and the call):
        VB-bit codes, fp16(s), fp16(mn) at vdst [BLOCK_R]."""
        c, s, mn = _rows_value_codes(xv, m2, VB, BLOCK_R, BLOCK_D, COMPILED)
        _store_field_rows(vdst, c, 0, D, VB, BLOCK_R, BLOCK_D, valid)
        VDB: tl.constexpr = D * VB // 8
        _f16_bytes_rows(vdst + VDB, s, valid)
        _f16_bytes_rows(vdst + VDB + 2, mn, valid)

    @triton.jit
    def _or(a, b):
        return a | b

    @triton.jit
    def _words(codes, BITS: tl.constexpr, R: tl.constexpr, N: tl.constexpr):
        """Codes [R, N] of BITS bits (8 or 4) as the little-endian 4-byte words of their
        field, [R, N * BITS // 32]."""
        PER: tl.constexpr = 32 // BITS
        g = tl.reshape(codes, [R, N // PER, PER])
        return tl.reduce(g << (BITS * tl.arange(0, PER))[None, None, :], 2, _or)

    @triton.jit
    def _word_slot(dst, kc, vc, s, mn, valid, VB: tl.constexpr, D: tl.constexpr,
                   R: tl.constexpr):
        """k8v4 slots at dst [R] as 4-byte words (WORDS: D a power of two >= 32, every slot
        4-byte aligned), from the key codes kc and value codes vc [R, D], s and mn [R]: one
        store a word instead of one a byte (tuning-log 116)."""
        w = dst.to(tl.pointer_type(tl.int32))
        KW: tl.constexpr = D // 4
        VW: tl.constexpr = D * VB // 32
        tl.store(w[:, None] + tl.arange(0, KW)[None, :], _words(kc, 8, R, D), mask=valid[:, None])
        tl.store(w[:, None] + (KW + tl.arange(0, VW))[None, :], _words(vc, VB, R, D),
                 mask=valid[:, None])
        tl.store(w + (KW + VW), _f16_bits(s) | (_f16_bits(mn) << 16), mask=valid)

    @triton.jit
    def _row_quotients(x, den, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """RN(x / den) for rows x [BLOCK_R, BLOCK_D] and their divisors den [BLOCK_R] (> 0): as
        kernel.cu's tq_div_row (its comment has the proof), the product with RN(1 / den) and two
        fused corrections, the sign x's, where every den is in [2^-60, 2^60] and every |x| is 0
        or in it; otherwise (a decision for the whole tile) true division."""
        LO: tl.constexpr = 8.673617379884035e-19  # 2^-60
        HI: tl.constexpr = 1.152921504606847e18  # 2^60
        db = tl.broadcast_to(den[:, None], [BLOCK_R, BLOCK_D])
        yd = tl.math.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), den)[:, None]
        q = corrected_quotient(x, db, yd, 2)
        sign = x.to(tl.int32, bitcast=True) & -2147483648
        q = ((q.to(tl.int32, bitcast=True) & 0x7FFFFFFF) | sign).to(tl.float32, bitcast=True)
        ax = tl.abs(x)
        ok = (ax <= HI) & ~((ax < LO) & (ax > 0.0)) & (db >= LO) & (db <= HI)
        if tl.min(tl.min(ok.to(tl.int32), axis=1), axis=0) == 0:
            q = tl.math.div_rn(x, db)
        return q

    @triton.jit
    def _dense_rotation_codes(cache_ptr, off, u, valid, pit_ptr, P_0, P_1, mid_ptr, MID_S,
                              ascending, D: tl.constexpr, BLOCK_D: tl.constexpr,
                              BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr, KB: tl.constexpr):
        """Any table, a row at a time (its u, slot offset and validity taken out of the tile by
        masked sums: a -0 of u may come out +0, which changes no y_j but a zero's sign): for
        blocks of BLOCK_J outputs, y_j = the tree over i of RN(u_i * PiT[i, j]) from the
        products [BLOCK_J, BLOCK_D], then their codes stored at cache_ptr + off."""
        i = tl.arange(0, BLOCK_D)
        im = i < D
        rows = tl.arange(0, BLOCK_R)
        for r in tl.static_range(BLOCK_R):
            here = rows == r
            ur = tl.sum(tl.where(here[:, None], u, 0.0), axis=0)
            off_r = tl.sum(tl.where(here, off, 0), axis=0)
            valid_r = (tl.zeros([1], tl.int32)  # [1]: broadcast by the masks
                       + tl.max(tl.where(here, valid, False).to(tl.int32), axis=0)) != 0
            for jb in range(0, BLOCK_D // BLOCK_J):
                j = jb * BLOCK_J + tl.arange(0, BLOCK_J)
                pit = tl.load(pit_ptr + i[None, :].to(tl.int64) * P_0
                              + j[:, None].to(tl.int64) * P_1,
                              mask=(j < D)[:, None] & im[None, :], other=0.0)
                prod = tl.where(im[None, :], ur[None, :] * pit, 0.0)  # [BLOCK_J, BLOCK_D]
                y = tl.reshape(tree_sum(prod[:, None, :], BLOCK_D), [BLOCK_J])
                _store_field(cache_ptr + off_r, _mse_codes(y, mid_ptr, MID_S, ascending, KB),
                             jb * BLOCK_J, D, KB, BLOCK_J, valid_r)

    @triton.jit
    def _rows_pass(rb, key_ptr, value_ptr, cache_ptr, slot_mapping_ptr, pit_ptr, mid_ptr,
                   K_TOK, K_HEAD, V_TOK, V_HEAD, C_B, C_S, C_H, P_0, P_1, MID_S, NUM_SLOTS, H,
                   ROWS, ascending, hadamard, h0, BLOCK_SIZE: tl.constexpr, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr,
                   KB: tl.constexpr, VB: tl.constexpr, KPS: tl.constexpr,
                   BF16_BITS: tl.constexpr, BUTTERFLY: tl.constexpr, COMPILED: tl.constexpr,
                   WORDS: tl.constexpr):
        """Pass rb of _tq_rows_kernel: rows rb * BLOCK_R .. + BLOCK_R, with the program's
        table decisions (ascending, hadamard, h0 = PiT[0, 0])."""
        i = tl.arange(0, BLOCK_D)
        im = i < D
        r = (rb * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # ROWS < 2^31
        rm = r < ROWS
        t = r // H
        h = r - t * H
        m2 = rm[:, None] & im[None, :]
        xk = widen(tl.load(key_ptr + (t * K_TOK + h * K_HEAD)[:, None] + i[None, :], mask=m2,
                           other=0), BF16_BITS)
        xv = widen(tl.load(value_ptr + (t * V_TOK + h * V_HEAD)[:, None] + i[None, :],
                           mask=m2, other=0), BF16_BITS)
        slot = tl.load(slot_mapping_ptr + t, mask=rm, other=-1).to(tl.int64)
        valid = rm & (slot >= 0) & (slot < NUM_SLOTS)
        blk = slot // BLOCK_SIZE
        off = blk * C_B + (slot - blk * BLOCK_SIZE) * C_S + h * C_H  # [BLOCK_R]
        dst = cache_ptr + off

        # ---- keys ----
        if KB == 8 and WORDS:  # the slots as 4-byte words (word_slots)
            c, s, mn = _rows_value_codes(xv, m2, VB, BLOCK_R, D, COMPILED)
            _word_slot(dst, _e4m3_key_codes(xk), c, s, mn, valid, VB, D, BLOCK_R)
            return
        if KB == 8:  # e4m3fn codes, a NaN's 0x7F
            tl.store(dst[:, None] + i[None, :], _e4m3_key_codes(xk).to(tl.uint8),
                     mask=valid[:, None] & im[None, :])
        else:
            ss = tl.reshape(row_tree((xk * xk)[:, None, :], BLOCK_D), [BLOCK_R])
            n = tl.sqrt_rn(ss)
            den = n + 1e-8
            u = tl.where(im[None, :], _row_quotients(xk, den, BLOCK_R, BLOCK_D), 0.0)
            if BUTTERFLY:
                # Outside the branch: its shuffles would be collective ones inside it.
                y = _butterflies(u * h0, BLOCK_R, BLOCK_D)
                if hadamard:
                    _store_field_rows(dst, _mse_codes(y, mid_ptr, MID_S, ascending, KB), 0,
                                      D, KB, BLOCK_R, BLOCK_D, valid)
                else:
                    _dense_rotation_codes(cache_ptr, off, u, valid, pit_ptr, P_0, P_1,
                                          mid_ptr, MID_S, ascending, D, BLOCK_D, BLOCK_R,
                                          BLOCK_J, KB)
            else:
                _dense_rotation_codes(cache_ptr, off, u, valid, pit_ptr, P_0, P_1, mid_ptr,
                                      MID_S, ascending, D, BLOCK_D, BLOCK_R, BLOCK_J, KB)
            KF_BYTES: tl.constexpr = D * KB // 8
            _f16_bytes_rows(dst + KF_BYTES, n, valid)

        # ---- values ----
        _rows_values(dst + KPS, xv, m2, valid, VB, D, BLOCK_R, BLOCK_D, COMPILED)

    @triton.jit(do_not_specialize=["NUM_SLOTS", "H", "ROWS"])
    def _tq_rows_kernel(
        key_ptr, value_ptr, cache_ptr, slot_mapping_ptr, pit_ptr, mid_ptr,  # as _tq_kernel's
        flags_ptr,  # int32 [NUM_FLAGS]: _tq_table_kernel's (where D is a power of two)
        K_TOK, K_HEAD, V_TOK, V_HEAD, C_B, C_S, C_H, P_0, P_1, MID_S,
        NUM_SLOTS, H, ROWS,  # ROWS = T * H
        BLOCK_SIZE: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr,  # rows a pass of a program
        BLOCK_J: tl.constexpr,  # outputs a block of the dense rotation
        NUM_FLAGS: tl.constexpr,
        KB: tl.constexpr,
        VB: tl.constexpr,
        KPS: tl.constexpr,
        BF16_BITS: tl.constexpr,
        BUTTERFLY: tl.constexpr,  # MSE, D a power of two: the flags decide the butterflies
        STRIDE: tl.constexpr,  # the programs stride over the passes (else a program a pass)
        COMPILED: tl.constexpr,  # built for a GPU (not the interpreter): add.rm.f32 in asm
        WORDS: tl.constexpr,  # k8v4 slots stored as 4-byte words (run: where and why)
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,
    ):
        """Every preset, BLOCK_R (token, head) rows a pass (row r = t * H + h), a program a pass
        or (STRIDE) the programs striding over them: _tq_kernel's steps with each row's
        reductions along axis 1.
        MSE presets: each program first reads the table check's flags and the midpoints once
        (the rotation by butterflies where PiT is the scaled Sylvester Hadamard and D a power
        of two, else the dense products; the codes by a search where the midpoints ascend, else
        counted), then every row it writes takes those (program-uniform) paths."""
        pdl_entry(PDL, PDL_TRIGGER)
        ascending = False
        hadamard = False
        h0 = 0.0
        if KB != 8:
            ascending = _ascending(mid_ptr, MID_S, (1 << KB) - 1)
            if BUTTERFLY:
                hadamard = tl.max(tl.load(flags_ptr + tl.arange(0, NUM_FLAGS)), axis=0) == 0
                h0 = tl.load(pit_ptr)
        if STRIDE:
            for rb in range(tl.program_id(0), tl.cdiv(ROWS, BLOCK_R), tl.num_programs(0)):
                _rows_pass(rb, key_ptr, value_ptr, cache_ptr, slot_mapping_ptr, pit_ptr,
                           mid_ptr, K_TOK, K_HEAD, V_TOK, V_HEAD, C_B, C_S, C_H, P_0, P_1,
                           MID_S, NUM_SLOTS, H, ROWS, ascending, hadamard, h0, BLOCK_SIZE, D,
                           BLOCK_D, BLOCK_R, BLOCK_J, KB, VB, KPS, BF16_BITS, BUTTERFLY, COMPILED,
                           WORDS)
        else:
            _rows_pass(tl.program_id(0).to(tl.int64), key_ptr, value_ptr, cache_ptr,
                       slot_mapping_ptr, pit_ptr, mid_ptr, K_TOK, K_HEAD, V_TOK, V_HEAD, C_B,
                       C_S, C_H, P_0, P_1, MID_S, NUM_SLOTS, H, ROWS, ascending, hadamard, h0,
                       BLOCK_SIZE, D, BLOCK_D, BLOCK_R, BLOCK_J, KB, VB, KPS, BF16_BITS,
                       BUTTERFLY, COMPILED, WORDS)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def word_slots(kv_cache: torch.Tensor, preset, head_size: int) -> bool:
    """Whether the rows kernel stores k8v4 slots as 4-byte words: D a power of two >= 32 (whole
    words of both fields and the scale and zero) and every slot 4-byte aligned (the cache's
    address and its block, page and head strides)."""
    d = head_size
    return (int(preset.key_bits) == 8 and d >= 32 and d & (d - 1) == 0
            and kv_cache.data_ptr() % 4 == 0 and all(st % 4 == 0 for st in kv_cache.stride()[:3]))


def rows_per_program(rows: int, block_d: int, tuning: TritonTuning = TUNING) -> int:
    """BLOCK_R of the k8v4 rows kernel for a call of ``rows`` rows: the largest power of two
    with BLOCK_R * BLOCK_D <= rows_elems and rows / BLOCK_R >= rows_programs (at least 1)."""
    block_r = 1
    while (2 * block_r * block_d <= tuning.rows_elems
           and rows // (2 * block_r) >= tuning.rows_programs):
        block_r *= 2
    return block_r


def rows_launch(rows: int, block_d: int, mse: bool, device: torch.device,
                tuning: TritonTuning = TUNING) -> tuple[int, int, int, bool] | None:
    """(BLOCK_R, programs, warps, STRIDE) of the rows kernel for a call of ``rows`` rows, or
    None where the call takes the program-a-row kernel. k8v4: from k8v4_rows_min rows,
    rows_per_program's BLOCK_R, a program a pass. MSE: from mse_rows_min rows, BLOCK_R the
    largest power of two within mse_rows_elems (1 for calls of at most mse_small_rows rows),
    at most mse_programs_per_sm programs an SM (1 SM off the GPU) striding over the passes."""
    if not mse:
        if rows < tuning.k8v4_rows_min:
            return None
        block_r = rows_per_program(rows, block_d, tuning)
        return block_r, -(-rows // block_r), tuning.rows_warps, False
    if rows < tuning.mse_rows_min:
        return None
    block_r = 1 if rows <= tuning.mse_small_rows else max(1, tuning.mse_rows_elems // block_d)
    cap = triton_support.programs_to_fill(device, tuning.mse_programs_per_sm)
    return block_r, max(1, min(-(-rows // block_r), cap)), tuning.mse_warps, True


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
    mse = bool(preset.mse)
    pit = PiT if mse else kv_cache  # any pointer: never read for k8v4
    mid = midpoints if mse else kv_cache
    tables = (*(PiT.stride() if mse else (0, 0)), midpoints.stride(0) if mse else 0)
    common = dict(BLOCK_SIZE=bs, D=d, BLOCK_D=block_d, KB=kb, VB=vb,
                  KPS=int(preset.key_packed_size), BF16_BITS=key.dtype == torch.bfloat16,
                  enable_fp_fusion=False)
    rows = num_tokens * h
    launch = rows_launch(rows, block_d, mse, key.device, tuning)
    if launch is not None:
        block_r, programs, warps, stride = launch
        butterfly = mse and block_d == d  # the table kernel's flags pick the butterflies
        flags, num_flags = kv_cache, 1  # any pointer: read only where butterfly
        if butterfly:
            check_rows = max(1, min(d, tuning.check_elems // d))
            num_flags = d // check_rows
            flags = torch.empty(num_flags, dtype=torch.int32, device=key.device)
            pdl, trigger = triton_support.pdl_launch(key.device, num_flags,
                                                     tuning.pdl_max_programs,
                                                     tuning.pdl_trigger_max_programs)
            _tq_table_kernel[(num_flags,)](PiT, *PiT.stride(), flags, D=d, CHECK_ROWS=check_rows,
                                           PDL=pdl, PDL_TRIGGER=trigger, launch_pdl=pdl,
                                           num_warps=tuning.check_warps)
        # The dense rotation's outputs a block: dense_elems a thread, at least 8 where BLOCK_D
        # allows (3-bit fields pack 8 codes at a time), at most BLOCK_D.
        block_j = min(block_d, max(8, tuning.dense_elems * 32 * warps // block_d))
        pdl, trigger = triton_support.pdl_launch(key.device, programs, tuning.pdl_max_programs,
                                                 tuning.pdl_trigger_max_programs)
        _tq_rows_kernel[(programs,)](
            _bits(key), _bits(value), kv_cache, slot_mapping, pit, mid, flags,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            *kv_cache.stride()[:3], *tables, nb * bs, h, rows,
            BLOCK_R=block_r, BLOCK_J=block_j, NUM_FLAGS=num_flags, BUTTERFLY=butterfly,
            STRIDE=stride, COMPILED=key.device.type == "cuda",
            # k8v4's slots as words at one row a program only: H200, tuning-log 116: 0.87-0.90
            # of the time at T = 64 and 256 (cold, twice), 1.12-1.20 at 2 and 4 rows a program.
            WORDS=block_r == 1 and word_slots(kv_cache, preset, d),
            PDL=pdl, PDL_TRIGGER=trigger, num_warps=warps, launch_pdl=pdl, **common)
        return
    block_j = min(block_d, max(8, tuning.product_elems // block_d))
    pdl, trigger = triton_support.pdl_launch(key.device, rows, tuning.pdl_max_programs,
                                             tuning.pdl_trigger_max_programs)
    _tq_kernel[(num_tokens, h)](
        _bits(key), _bits(value), kv_cache, slot_mapping, pit, mid,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *kv_cache.stride()[:3], *tables, nb * bs, h,
        BLOCK_J=block_j, PDL=pdl, PDL_TRIGGER=trigger, num_warps=tuning.num_warps,
        launch_pdl=pdl, **common)
