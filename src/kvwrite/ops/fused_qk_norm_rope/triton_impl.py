"""The Triton implementation of fused_qk_norm_rope: one kernel, neox and GPT-J, partial rotary,
any weight dtypes.

Grid (token tiles, query head tiles + key head tiles): a program normalizes and rotates a
``[BLOCK_T, BLOCK_H, BLOCK_D]`` tile of query or key heads (kvwrite.kernels.triton_qk_norm) and
stores whole rows back in place, only for tokens whose position is in the table. qkv's token
stride is a run-time argument, its head stride a compile-time one (HEAD_STRIDE: a model has one,
and dense heads, HEAD_STRIDE == HEAD_SIZE, compile to the code of a constant head size). Tiles as
rotary_embedding's (its ``tiling``). Graph-safe: nothing is read on the host per call.

Under Triton's interpreter (CPU) bfloat16 rows, tables and weights are refused (its bfloat16
casts differ from the GPU's).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...kernels import triton_support
from ...kernels.triton_fp8 import IMPORT_ERROR as _IMPORT_ERROR
from ...kernels.triton_fp8 import tl, triton
from ...kernels.triton_rope import LAUNCH_OPTIONS
from .op import float32_bits

if triton is not None:  # without triton this module imports, and `available` says why
    from ...kernels.triton_qk_norm import norm_rope_tile, qk_norm_prologue
    from ..rotary_embedding.triton_impl import TUNING, interpreter_reason, tiling

__all__ = ["available", "unsupported", "run", "interpreter_dtypes", "signed_bits", "QkLaunch",
           "qk_launch"]


def available(device: torch.device) -> str | None:
    return triton_support.available(device, triton, lambda: _qk_norm_rope_kernel, _IMPORT_ERROR)


def interpreter_dtypes(qkv, q_weight, k_weight, cos_sin_cache) -> tuple[torch.dtype, ...]:
    """The dtypes Triton's interpreter converts in a call (rows, table, weights)."""
    return (qkv.dtype, cos_sin_cache.dtype,
            *(w.dtype for w in (q_weight, k_weight) if w is not None))


def unsupported(qkv, q_weight, k_weight, cos_sin_cache, is_neox) -> str | None:
    if qkv.device.type == "cuda":
        return None
    return interpreter_reason(*interpreter_dtypes(qkv, q_weight, k_weight, cos_sin_cache))


def signed_bits(x: float) -> int:
    """float32(x)'s bits as a signed 32-bit int (a Triton i32 argument)."""
    b = float32_bits(x)
    return b - (1 << 32) if b >= 1 << 31 else b



class QkLaunch(NamedTuple):
    """A QK-norm kernel's launch: its tuning, tiles, warps, grid and PDL (:func:`qk_launch`)."""

    tuning: object  # a RopeTuning
    block_t: int
    block_h: int
    block_d: int
    warps: int
    q_tiles: int
    grid: tuple[int, int]
    pdl: bool
    trigger: bool


def qk_launch(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, position_ids: torch.Tensor,
              tuning) -> QkLaunch | None:
    """The launch of this op's kernel and of fused_qk_norm_rope_and_reshape_cache_flash's for a
    call (``tuning`` None: rotary_embedding's ``TUNING``): rotary_embedding's tiling of the
    rotated tokens' q and k heads, grid (token tiles, q tiles + k tiles); None where no token is
    rotated (nothing to launch)."""
    num_rot = position_ids.numel()
    if num_rot == 0:
        return None
    tuning = TUNING if tuning is None else tuning
    block_t, block_h, block_d, warps, nq, nk = tiling(num_rot, num_heads_q, num_heads_k,
                                                      qkv.shape[2], qkv.element_size(), tuning)
    grid = (triton.cdiv(num_rot, block_t), nq + nk)
    pdl, trigger = triton_support.pdl_launch(qkv.device, grid[0] * grid[1],
                                             tuning.pdl_max_programs,
                                             tuning.pdl_trigger_max_programs)
    return QkLaunch(tuning, block_t, block_h, block_d, warps, nq, grid, pdl, trigger)

if triton is not None:

    @triton.jit(do_not_specialize=["num_rot", "eps_bits", "offset_bits"])
    def _qk_norm_rope_kernel(
        positions_ptr,  # [T_rot] int64 or int32
        qkv_ptr,  # [T_pad, Hq + Hk + Hv, D], token stride qkv_stride, head stride HEAD_STRIDE
        cos_sin_ptr,  # [max_position, ROT]: cos | sin
        q_weight_ptr, k_weight_ptr,  # [D] each (None where HAS_QW / HAS_KW is false)
        num_rot,  # T_rot
        qkv_stride,  # token stride in elements
        max_position,
        eps_bits, offset_bits,  # float32(eps), float32(weight_offset) as int32 bits
        NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
        HEAD_STRIDE: tl.constexpr, ROT: tl.constexpr, IS_NEOX: tl.constexpr, HAS_QW: tl.constexpr,
        HAS_KW: tl.constexpr, ADD_OFFSET: tl.constexpr, Q_TILES: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
        PDL_TRIGGER: tl.constexpr,
    ):
        t, tile, valid, c, s, partner, first, is_rot, eps, offset, d, t64 = qk_norm_prologue(
            positions_ptr, cos_sin_ptr, num_rot, max_position, eps_bits, offset_bits, ROT,
            IS_NEOX, BLOCK_T, BLOCK_D, PDL, PDL_TRIGGER)
        if tile < Q_TILES:
            h = tile * BLOCK_H + tl.arange(0, BLOCK_H)[None, :, None]
            mask = valid[:, None, None] & (h < NUM_Q_HEADS) & (d < HEAD_SIZE)
            row = (t64 * qkv_stride)[:, None, None] + h * HEAD_STRIDE
            out = norm_rope_tile(qkv_ptr, row, d, partner, mask, q_weight_ptr, eps, offset, c, s,
                                 first, is_rot, HEAD_SIZE, HAS_QW, ADD_OFFSET, BLOCK_D)
        else:
            h = (tile - Q_TILES) * BLOCK_H + tl.arange(0, BLOCK_H)[None, :, None]
            mask = valid[:, None, None] & (h < NUM_K_HEADS) & (d < HEAD_SIZE)
            row = (t64 * qkv_stride)[:, None, None] + (NUM_Q_HEADS + h) * HEAD_STRIDE
            out = norm_rope_tile(qkv_ptr, row, d, partner, mask, k_weight_ptr, eps, offset, c, s,
                                 first, is_rot, HEAD_SIZE, HAS_KW, ADD_OFFSET, BLOCK_D)
        tl.store(qkv_ptr + row + d, out.to(qkv_ptr.dtype.element_ty), mask=mask)


def run(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, eps: float,
        q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
        cos_sin_cache: torch.Tensor, is_neox: bool, position_ids: torch.Tensor,
        weight_offset: float, *, tuning=None) -> None:
    """Launch on PyTorch's current stream; arguments as validated by the public op. ``tuning``:
    a ``RopeTuning`` (rotary_embedding's; None: its ``TUNING``)."""
    q = qk_launch(qkv, num_heads_q, num_heads_k, position_ids, tuning)
    if q is None:
        return
    _qk_norm_rope_kernel[q.grid](
        position_ids, qkv, cos_sin_cache, q_weight, k_weight, position_ids.numel(), qkv.stride(0),
        cos_sin_cache.shape[0], signed_bits(eps), signed_bits(weight_offset),
        NUM_Q_HEADS=num_heads_q, NUM_K_HEADS=num_heads_k, HEAD_SIZE=qkv.shape[2],
        HEAD_STRIDE=qkv.stride(1), ROT=cos_sin_cache.shape[1], IS_NEOX=is_neox,
        HAS_QW=q_weight is not None,
        HAS_KW=k_weight is not None, ADD_OFFSET=weight_offset != 0, Q_TILES=q.q_tiles,
        BLOCK_T=q.block_t, BLOCK_H=q.block_h, BLOCK_D=q.block_d, num_warps=q.warps, PDL=q.pdl,
        PDL_TRIGGER=q.trigger, launch_pdl=q.pdl, **LAUNCH_OPTIONS,
    )
