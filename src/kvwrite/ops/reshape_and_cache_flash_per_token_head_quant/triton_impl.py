"""The Triton implementation of reshape_and_cache_flash_per_token_head_quant: one kernel for the
three modes.

A program quantizes ``BLOCK_T`` tokens by ``BLOCK_H`` heads: it loads their key rows
``[BLOCK_T, BLOCK_H, BLOCK_DK]`` and value rows, then their slots (after the rows, which do not
depend on them), reduces each row to its amax (int8, fp8) or its min and max (int4), NaN and the
padding past the head size ignored, computes the scale with a true division
(``tl.math.div_rn``), and each element's quotient ``RN(x / s)`` exactly without a division per
element (``kvwrite.kernels.triton_fp8.fp8_quotient``: a product and one or two fused
corrections). The integer roundings are exact (``v - floor(v)`` is exact in float32); int4
codes are paired with ``tl.split`` (even element in the low nibble). Codes are stored as bytes
through a uint8 view of each data cache, scales as float32. Strides are run-time arguments;
head sizes and the head and token tiles are compile-time constants. Nothing is read
on the host per call, so ``run`` is CUDA-graph safe.

On CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``), whose float->fp8 casts round
differently from the GPU: :func:`unsupported` refuses the fp8 mode there; int8 and int4 are
exact.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ...kernels import triton_support
from ...kernels.triton_fp8 import IMPORT_ERROR as _IMPORT_ERROR
from ...kernels.triton_fp8 import fp8_quotient, fp8_scale, pdl_entry, tl, triton
from ...kernels.triton_support import next_pow2
from .op import PerTokenHeadMode

__all__ = ["TritonTuning", "TUNING", "available", "unsupported", "run", "tiling"]

_INT8, _FP8, _INT4 = 0, 1, 2
_MODE = {PerTokenHeadMode.INT8_PER_TOKEN_HEAD: _INT8, PerTokenHeadMode.FP8_PER_TOKEN_HEAD: _FP8,
         PerTokenHeadMode.INT4_PER_TOKEN_HEAD: _INT4}


def available(device: torch.device) -> str | None:
    return triton_support.available(device, triton, lambda: _pth_kernel, _IMPORT_ERROR)


def unsupported(key, value, key_cache, value_cache, mode: PerTokenHeadMode) -> str | None:
    if key.device.type == "cuda" or mode is not PerTokenHeadMode.FP8_PER_TOKEN_HEAD:
        return None
    return (f"Triton's interpreter (TRITON_INTERPRET=1) rounds float->fp8 casts differently from "
            f"the GPU, so kv_quant_mode={mode.value!r} is not exact there; run on a CUDA device")


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class TritonTuning:
    """Launch shapes. ``TUNING`` is what every call uses unless a caller passes another one.
    Not measured yet (no GPU when this kernel was written)."""

    # Elements (key + value, padded to powers of two) per program, and per warp.
    tile_elems: int = 4096
    elems_per_warp: int = 1024
    max_warps: int = 8
    # Programmatic dependent launch, as the other ops' Triton kernels (tuning-log change 44).
    pdl_max_programs: int = 1 << 30
    pdl_trigger_max_programs: int = 1024


TUNING = TritonTuning()


def _floor_pow2(n: int) -> int:
    """The largest power of two <= n (1 for n <= 1)."""
    return 1 << max(0, n.bit_length() - 1)


@functools.lru_cache(maxsize=256)
def tiling(num_heads: int, dk: int, dv: int,
           tuning: TritonTuning = TUNING) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_H, num_warps): whole rows, as many heads (at most H rounded up) and then
    tokens as fit the tile (powers of two). BLOCK_T does not follow T, so that one compiled
    variant serves every call size (a short call masks the tile's other tokens)."""
    row = next_pow2(dk) + next_pow2(dv)
    block_h = min(next_pow2(num_heads), _floor_pow2(tuning.tile_elems // row))
    block_t = _floor_pow2(tuning.tile_elems // (block_h * row))
    warps = min(tuning.max_warps, max(1, block_t * block_h * row // tuning.elems_per_warp))
    return block_t, block_h, 1 << (warps.bit_length() - 1)


if triton is not None:

    @triton.jit
    def _rhaz(q):
        """Round half away from zero, exactly (q - trunc(q) is exact)."""
        n = tl.where(q < 0, tl.math.ceil(q), tl.math.floor(q))
        return tl.where(tl.abs(q - n) >= 0.5, n + tl.where(q < 0, -1.0, 1.0), n)

    @triton.jit
    def _rhu(q):
        """Round half up, exactly (q - floor(q) is exact)."""
        n = tl.math.floor(q)
        return tl.where(q - n >= 0.5, n + 1.0, n)

    @triton.jit
    def _nan0(q):
        return tl.where(q == q, q, 0.0)

    @triton.jit
    def _fmax_floor(s):
        """fmax(s, FLOOR): the floor where s is below it or NaN."""
        return tl.where(s > 1e-6, s, 1e-6)

    @triton.jit
    def _quantize(x, ok, MODE: tl.constexpr, STEPS: tl.constexpr, BLOCK_D: tl.constexpr):
        """(codes, entries) of rows x ``[BT, BH, BLOCK_D]`` (``ok``: the row's elements): the
        stored bytes ``[BT, BH, BLOCK_D]`` (int4: ``[BT, BH, BLOCK_D // 2]``) as int32 and the
        scale cache entries ``[BT, BH]`` as float32."""
        xf = x.to(tl.float32)
        real = ok & (xf == xf)  # NaN is ignored by every reduction
        if MODE == 2:
            mn = tl.min(tl.where(real, xf, float("inf")), axis=2)
            mx = tl.max(tl.where(real, xf, -float("inf")), axis=2)
            none = mn > mx
            mn = tl.where(none, 0.0, mn)
            mx = tl.where(none, 0.0, mx)
            s = _fmax_floor(tl.math.div_rn(mx - mn, tl.full(mn.shape, 15.0, tl.float32)))
            m, s2, y = fp8_scale(s)
            zp = _rhu(_nan0(fp8_quotient(-mn, m, s2, y, 1048576.0, STEPS)))
            zp = tl.minimum(tl.maximum(zp, 0.0), 15.0)
            q = fp8_quotient(xf, m[:, :, None], s2[:, :, None], y[:, :, None], 1048576.0, STEPS)
            c = tl.minimum(tl.maximum(_rhu(_nan0(q)) + zp[:, :, None], 0.0), 15.0).to(tl.int32)
            BT: tl.constexpr = c.shape[0]
            BH: tl.constexpr = c.shape[1]
            lo, hi = tl.split(tl.reshape(c, [BT, BH, BLOCK_D // 2, 2]))
            codes = lo | (hi << 4)
            bits = (s.to(tl.int32, bitcast=True) & -16) | zp.to(tl.int32)
            entry = bits.to(tl.float32, bitcast=True)
        else:
            amax = tl.max(tl.where(real, tl.abs(xf), 0.0), axis=2)
            div: tl.constexpr = 127.0 if MODE == 0 else 448.0
            s = _fmax_floor(tl.math.div_rn(amax, tl.full(amax.shape, div, tl.float32)))
            m, s2, y = fp8_scale(s)
            m, s2, y = m[:, :, None], s2[:, :, None], y[:, :, None]
            if MODE == 0:
                q = fp8_quotient(xf, m, s2, y, 1048576.0, STEPS)
                n = tl.minimum(tl.maximum(_rhaz(_nan0(q)), -128.0), 127.0)
                codes = n.to(tl.int32) & 255
            else:
                q = fp8_quotient(xf, m, s2, y, 448.0, STEPS)
                codes = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
            entry = s
        return codes, entry

    @triton.jit
    def _store_rows(codes, entry, cache_ptr, scale_ptr, blk, pg, h, write, C_B, C_S, C_H, S_B,
                    S_S, S_H, DQ: tl.constexpr, BLOCK_Q: tl.constexpr):
        """Store codes ``[BT, BH, BLOCK_Q]`` (the first DQ of each row) and entries ``[BT, BH]``
        where ``write`` ``[BT, BH]`` (a valid slot, a head < H)."""
        row = (blk * C_B + pg * C_S)[:, None] + h[None, :] * C_H  # int64 [BT, BH]
        j = tl.arange(0, BLOCK_Q)
        ok = write[:, :, None] & (j < DQ)[None, None, :]
        tl.store(cache_ptr + row[:, :, None] + j[None, None, :], codes.to(tl.uint8), mask=ok)
        srow = (blk * S_B + pg * S_S)[:, None] + h[None, :] * S_H
        tl.store(scale_ptr + srow, entry, mask=write)

    @triton.jit(do_not_specialize=["num_tokens", "NUM_SLOTS", "BLOCK_SIZE", "H"])
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
        BLOCK_SIZE,
        H,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BLOCK_DK: tl.constexpr,  # DK and DV rounded up to powers of two (masked)
        BLOCK_DV: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
        MODE: tl.constexpr,  # 0 int8, 1 fp8, 2 int4
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,  # programmatic dependent launch (pdl_entry)
    ):
        pdl_entry(PDL, PDL_TRIGGER)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        t_in = t < num_tokens
        th_ok = t_in[:, None] & (h < H)[None, :]
        t64 = t.to(tl.int64)
        h64 = h.to(tl.int64)
        STEPS: tl.constexpr = 2 if key_ptr.dtype.element_ty == tl.float32 else 1
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
        ck, ek = _quantize(xk, k_ok, MODE, STEPS, BLOCK_DK)
        cv, ev = _quantize(xv, v_ok, MODE, STEPS, BLOCK_DV)
        PACK: tl.constexpr = 2 if MODE == 2 else 1  # elements per code byte
        _store_rows(ck, ek, kc_ptr, ks_ptr, blk, pg, h64, write, KC_B, KC_S, KC_H, KS_B, KS_S,
                    KS_H, DK // PACK, BLOCK_DK // PACK)
        _store_rows(cv, ev, vc_ptr, vs_ptr, blk, pg, h64, write, VC_B, VC_S, VC_H, VS_B, VS_S,
                    VS_H, DV // PACK, BLOCK_DV // PACK)


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
    block_t, block_h, warps = tiling(h, dk, dv, tuning)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(h, block_h))
    pdl, trigger = triton_support.pdl_launch(key.device, grid[0] * grid[1],
                                             tuning.pdl_max_programs,
                                             tuning.pdl_trigger_max_programs)
    kc, vc = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    _pth_kernel[grid](
        key, value, kc, vc, k_scale_cache, v_scale_cache, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *kc.stride()[:3], *vc.stride()[:3], *k_scale_cache.stride(), *v_scale_cache.stride(),
        nb * bs, bs, h,
        DK=dk, DV=dv, BLOCK_DK=next_pow2(dk), BLOCK_DV=next_pow2(dv),
        BLOCK_T=block_t, BLOCK_H=block_h, MODE=_MODE[mode], PDL=pdl, PDL_TRIGGER=trigger,
        num_warps=warps, launch_pdl=pdl,
    )

