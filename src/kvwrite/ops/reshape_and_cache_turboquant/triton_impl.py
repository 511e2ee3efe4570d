"""The Triton implementation of reshape_and_cache_turboquant: one kernel for the four presets.

Programs stride over blocks of ``ROWS`` rows (token, head) (a grid of at most
``programs_per_sm`` programs per SM: each program's setup below is paid once); a block loads its
rows' slots (a negative or out-of-range one masks the row's stores), the key and value rows
``[ROWS, BLOCK_D]`` (``BLOCK_D`` the power of two >= D, +0 past D) and computes SPEC §10.2 step by
step with one IEEE float32 operation per step, launched with ``enable_fp_fusion=False`` (no
product is contracted into an FMA):

- keys, k8v4: e4m3fn codes of ``x`` by ``kvwrite.kernels.triton_nvfp4.e4m3`` on ``|x|`` (integer
  encoded: nearest even, saturating at 448, subnormals) with the sign bit put back; a NaN's code
  is 0x7F (the GPU's satfinite conversion's).
- keys, MSE: ``ss`` by ``kvwrite.kernels.triton_qk_norm.tree_sum`` (§7.1's padded pairwise tree),
  ``n = sqrt_rn(ss)``, ``den = n + 1e-8``, ``u = div_rn(x, den)`` (+0 past D: the tree's padding
  leaves), then ``y = u @ PiT`` by one of two paths, the program's choice from the table's values
  (checked once per program, every call):
  * Hadamard (D a power of two and ``PiT[i, j] = (-1)^popcount(i & j) * PiT[0, 0]`` bit for bit):
    ``p = u * h`` and the fast Walsh-Hadamard transform of p, strides 1, 2, 4, ... (each stage a
    reshape to ``[ROWS, D / 2st, 2, st]``, split into the pairs, joined back as ``(a + b, a - b)``).
    It equals the tree of the products as real numbers (kernel.cu's comment has the proof: RN is
    sign-symmetric), only a zero's sign may differ, and step 4 reads nothing else of ``y_j``.
  * generic: for blocks of ``BLOCK_J`` outputs the products ``u_i * PiT[i, j]`` ``[ROWS,
    BLOCK_J, BLOCK_D]`` summed over i by the same tree.
  ``idx_j`` the count of midpoints ``<= y_j``, packed (4-bit: element 2j in the low nibble of
  byte j; 3-bit: 8 codes in 3 bytes, little-endian bit order), ``fp16(n)`` after the field (a NaN
  norm as 0x7E00, the CUDA kernel's).
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

__all__ = ["TritonTuning", "TUNING", "available", "unsupported", "run", "MAX_HEAD_SIZE"]

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
    """Launch constants (not measured yet: written without a GPU)."""

    num_warps: int = 4
    # Elements of one block of rows [ROWS, BLOCK_D] (ROWS a power of two, 1 .. 16), and of one
    # block of generic rotation products [ROWS, BLOCK_J, BLOCK_D].
    row_elems: int = 1024
    product_elems: int = 8192
    # Programs per SM (the grid's bound; the CPU interpreter takes cpu_programs).
    programs_per_sm: int = 4
    cpu_programs: int = 3


TUNING = TritonTuning()


if triton is not None:

    @triton.jit
    def _f16_bytes(ptr, v, mask):
        """Store fp16(v) (nearest even, overflow to inf, subnormals kept) little-endian at ptr; a
        NaN as 0x7E00 (as the CUDA kernel: the contract leaves its encoding free)."""
        b = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        b = tl.where(v == v, b, 0x7E00)
        tl.store(ptr, (b & 255).to(tl.uint8), mask=mask)
        tl.store(ptr + 1, (b >> 8).to(tl.uint8), mask=mask)

    @triton.jit
    def _store_field(ptr, codes, first, n, BITS: tl.constexpr, R: tl.constexpr,
                     BJ: tl.constexpr, valid):
        """Store the b-bit codes ``[R, BJ]`` of elements first .. first + BJ of the rows' fields
        of ``n`` elements at ``ptr`` ``[R, 1]`` (first a multiple of 8 for 3-bit fields, of 2 for
        4-bit ones), where ``valid`` ``[R, 1]``."""
        if BITS == 8:
            e = first + tl.arange(0, BJ)[None, :]
            tl.store(ptr + e, codes.to(tl.uint8), mask=valid & (e < n))
        elif BITS == 4:
            lo, hi = tl.split(tl.reshape(codes, [R, BJ // 2, 2]))
            byte = first // 2 + tl.arange(0, BJ // 2)[None, :]
            tl.store(ptr + byte, (lo | (hi << 4)).to(tl.uint8), mask=valid & (byte < n // 2))
        else:
            g = tl.reshape(codes, [R, BJ // 8, 8])
            shift = 3 * tl.arange(0, 8)
            w = tl.sum(g << shift[None, None, :], axis=2)
            grp = first // 8 + tl.arange(0, BJ // 8)[None, :]
            ok = valid & (grp < n // 8)
            tl.store(ptr + 3 * grp, (w & 255).to(tl.uint8), mask=ok)
            tl.store(ptr + 3 * grp + 1, ((w >> 8) & 255).to(tl.uint8), mask=ok)
            tl.store(ptr + 3 * grp + 2, ((w >> 16) & 255).to(tl.uint8), mask=ok)

    @triton.jit
    def _parity(x):
        """popcount(x) & 1 of non-negative int32 x."""
        x = x ^ (x >> 16)
        x = x ^ (x >> 8)
        x = x ^ (x >> 4)
        x = x ^ (x >> 2)
        x = x ^ (x >> 1)
        return x & 1

    @triton.jit
    def _is_hadamard(pit_ptr, P_0, P_1, D: tl.constexpr, CJ: tl.constexpr):
        """Whether every PiT[i, j] has the bits of (-1)^popcount(i & j) * PiT[0, 0] (D a power
        of two): rows of PiT CJ at a time."""
        hb = tl.load(pit_ptr).to(tl.int32, bitcast=True)
        jj = tl.arange(0, D)[None, :]
        bad = tl.zeros([CJ, D], tl.int32)
        for c in range(0, D // CJ):
            ii = c * CJ + tl.arange(0, CJ)[:, None]
            w = tl.load(pit_ptr + ii.to(tl.int64) * P_0 + jj.to(tl.int64) * P_1)
            want = hb ^ (_parity(ii & jj) << 31)
            bad = bad | (w.to(tl.int32, bitcast=True) != want).to(tl.int32)
        return tl.max(tl.max(bad, axis=1), axis=0) == 0

    @triton.jit
    def _fwht(y, R: tl.constexpr, D: tl.constexpr):
        """The fast Walsh-Hadamard transform of the rows of ``y`` ``[R, D]`` (natural order,
        strides 1, 2, 4, ...: each butterfly (a, b) -> (a + b, a - b))."""
        for s in tl.static_range(D.bit_length() - 1):  # stride 2^s
            y4 = tl.permute(tl.reshape(y, [R, D >> (s + 1), 2, 1 << s]), [0, 1, 3, 2])
            a, b = tl.split(y4)
            y4 = tl.join(a + b, a - b)
            y = tl.reshape(tl.permute(y4, [0, 1, 3, 2]), [R, D])
        return y

    @triton.jit
    def _count(y, mids, k, NM: tl.constexpr):
        """#{k < NM : y >= mids[k]} per element of ``y`` ``[R, J]`` (a NaN counts 0; the +inf
        padding midpoint is excluded by k < NM)."""
        ge = (y[:, :, None] >= mids[None, None, :]) & (k < NM)[None, None, :]
        return tl.sum(ge.to(tl.int32), axis=2)

    @triton.jit(do_not_specialize=["NUM_SLOTS", "H", "NUM_ROWS"])
    def _tq_kernel(
        key_ptr,  # [T_pad, H, D] via (K_TOK, K_HEAD, 1); bfloat16 as int16 bits
        value_ptr,  # via (V_TOK, V_HEAD, 1)
        cache_ptr,  # uint8 [nb, bs, H, S] via (C_B, C_S, C_H, 1)
        slot_mapping_ptr,  # [T] int32 or int64
        pit_ptr,  # MSE: float32 [D, D] via (P_0, P_1)
        mid_ptr,  # MSE: float32 [2^KB - 1] via MID_S
        K_TOK, K_HEAD, V_TOK, V_HEAD, C_B, C_S, C_H, P_0, P_1, MID_S,
        NUM_SLOTS, H, NUM_ROWS,  # NUM_ROWS = T * H
        BLOCK_SIZE: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_J: tl.constexpr,
        ROWS: tl.constexpr,
        KB: tl.constexpr,  # key bits: 8 (k8v4), 4 or 3
        VB: tl.constexpr,  # value bits: 4 or 3
        KPS: tl.constexpr,  # key part bytes
        BF16_BITS: tl.constexpr,
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,
    ):
        pdl_entry(PDL, PDL_TRIGGER)
        i = tl.arange(0, BLOCK_D)
        im = i < D
        NM: tl.constexpr = (1 << KB) - 1 if KB != 8 else 1
        k = tl.arange(0, NM + 1)
        if KB != 8:
            mids = tl.load(mid_ptr + k * MID_S, mask=k < NM, other=float("inf"))
            if D == BLOCK_D:
                hadamard = _is_hadamard(pit_ptr, P_0, P_1, D, min(D, max(1, 8192 // D)))
            else:
                hadamard = False
            h0 = tl.load(pit_ptr)
        num_blocks = tl.cdiv(NUM_ROWS, ROWS)
        for rb in range(tl.program_id(0), num_blocks, tl.num_programs(0)):
            r = (rb * ROWS + tl.arange(0, ROWS)).to(tl.int64)
            rin = r < NUM_ROWS
            t = r // H
            hh = r - t * H
            m2 = rin[:, None] & im[None, :]
            xk = widen(tl.load(key_ptr + (t * K_TOK + hh * K_HEAD)[:, None] + i[None, :],
                               mask=m2, other=0), BF16_BITS)
            xv = widen(tl.load(value_ptr + (t * V_TOK + hh * V_HEAD)[:, None] + i[None, :],
                               mask=m2, other=0), BF16_BITS)
            slot = tl.load(slot_mapping_ptr + t, mask=rin, other=-1).to(tl.int64)
            valid = ((slot >= 0) & (slot < NUM_SLOTS) & rin)[:, None]  # [ROWS, 1]
            blk = slot // BLOCK_SIZE
            dst = (cache_ptr + blk * C_B + (slot - blk * BLOCK_SIZE) * C_S + hh * C_H)[:, None]

            # ---- keys ----
            if KB == 8:
                code, _ = e4m3(tl.abs(xk))
                sign = (xk.to(tl.int32, bitcast=True) >> 24) & 0x80
                code = tl.where(xk != xk, 0x7F, code | sign)
                _store_field(dst, code, 0, D, 8, ROWS, BLOCK_D, valid)
            else:
                ss = tree_sum((xk * xk)[:, None, :], BLOCK_D)  # [ROWS, 1]
                n = tl.sqrt_rn(ss)
                den = n + 1e-8
                u = tl.where(im[None, :],
                             tl.math.div_rn(xk, tl.broadcast_to(den, [ROWS, BLOCK_D])), 0.0)
                if hadamard:
                    if D == BLOCK_D:
                        y = _fwht(u * h0, ROWS, BLOCK_D)
                        _store_field(dst, _count(y, mids, k, NM), 0, D, KB, ROWS, BLOCK_D,
                                     valid)
                else:
                    for jb in range(0, BLOCK_D // BLOCK_J):
                        j = jb * BLOCK_J + tl.arange(0, BLOCK_J)
                        pm = (j < D)[:, None] & im[None, :]
                        pit = tl.load(pit_ptr + i[None, :].to(tl.int64) * P_0
                                      + j[:, None].to(tl.int64) * P_1, mask=pm, other=0.0)
                        prod = tl.where(im[None, None, :], u[:, None, :] * pit[None, :, :], 0.0)
                        y = tree_sum(prod, BLOCK_D)  # [ROWS, BLOCK_J]
                        _store_field(dst, _count(y, mids, k, NM), jb * BLOCK_J, D, KB, ROWS,
                                     BLOCK_J, valid)
                KF_BYTES: tl.constexpr = D * KB // 8
                _f16_bytes(dst + KF_BYTES, n, valid)

            # ---- values ----
            L: tl.constexpr = (1 << VB) - 1
            ok = im[None, :] & (xv == xv)
            mn = tl.min(tl.where(ok, xv, float("inf")), axis=1)[:, None]
            mx = tl.max(tl.where(ok, xv, -float("inf")), axis=1)[:, None]
            none = ~(mn <= mx)
            mn = tl.where(none | (mn == 0.0), 0.0, mn)  # both 0 if no value; a zero mn is +0
            mx = tl.where(none, 0.0, mx)
            s = tl.math.div_rn(mx - mn, tl.full([ROWS, 1], L, tl.float32))
            s = tl.where(s > 1e-8, s, 1e-8)
            q = tl.math.div_rn(xv - mn, tl.broadcast_to(s, [ROWS, BLOCK_D]))
            q = tl.minimum(tl.maximum(tl.where(q == q, q, 0.0), 0.0), L + 1.0)
            c = tl.minimum(rhu(q), L).to(tl.int32)
            vdst = dst + KPS
            _store_field(vdst, c, 0, D, VB, ROWS, BLOCK_D, valid)
            VDB: tl.constexpr = D * VB // 8
            _f16_bytes(vdst + VDB, s, valid)
            _f16_bytes(vdst + VDB + 2, mn, valid)


_SM_COUNTS: dict[int, int] = {}


def _sm_count(index: int) -> int:
    n = _SM_COUNTS.get(index)
    if n is None:
        n = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


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
    rows = num_tokens * h
    block_rows = max(1, min(16, tuning.row_elems // block_d, next_pow2(rows)))
    # At most BLOCK_D, at least 8 where BLOCK_D allows (3-bit fields pack 8 codes at a time).
    block_j = min(block_d, max(8, tuning.product_elems // (block_rows * block_d)))
    mse = kb != 8
    pit = PiT if mse else kv_cache  # any pointer: never read for k8v4
    mid = midpoints if mse else kv_cache
    if key.is_cuda:
        most = _sm_count(key.get_device()) * tuning.programs_per_sm
    else:
        most = tuning.cpu_programs
    grid = (max(1, min(-(-rows // block_rows), most)),)
    pdl, trigger = triton_support.pdl_launch(key.device, grid[0], tuning.pdl_max_programs,
                                             tuning.pdl_trigger_max_programs)
    _tq_kernel[grid](
        _bits(key), _bits(value), kv_cache, slot_mapping, pit, mid,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *kv_cache.stride()[:3], *(PiT.stride() if mse else (0, 0)),
        midpoints.stride(0) if mse else 0, nb * bs, h, rows,
        BLOCK_SIZE=bs, D=d, BLOCK_D=block_d, BLOCK_J=block_j, ROWS=block_rows, KB=kb, VB=vb,
        KPS=int(preset.key_packed_size), BF16_BITS=key.dtype == torch.bfloat16,
        PDL=pdl, PDL_TRIGGER=trigger, num_warps=tuning.num_warps, launch_pdl=pdl,
        enable_fp_fusion=False,
    )
