"""The Triton implementation of fused_qk_norm_rope: one kernel, neox and GPT-J, partial rotary,
any weight dtypes.

Grid (token tiles, query head tiles + key head tiles): a program normalizes and rotates a
``[BLOCK_T, BLOCK_H, BLOCK_D]`` tile of query or key heads (kvwrite.kernels.triton_qk_norm) and
stores whole rows back in place, only for tokens whose position is in the table. qkv's token
stride is a run-time argument, its head stride a compile-time one (HEAD_STRIDE: a model has one,
and dense heads, HEAD_STRIDE == HEAD_SIZE, compile to the code of a constant head size). Tiles as
rotary_embedding's (its ``tiling``). Graph-safe: nothing is read on the host per call.

Calls of at least ``RowsTuning.min_tokens`` rotated tokens with rot_dim == head_size == a power
of two take a second kernel, ``_qk_norm_rope_rows_kernel`` (:func:`rows_launch`): BLOCK_H heads of
BLOCK_T tokens per program as kvwrite.kernels.triton_qk_norm's whole-row tiles (16-byte row
accesses, cos/sin once per token, the reduction's cross-lane levels as shuffles). Both write the
same bytes (the contract's arithmetic, step by step).

Under Triton's interpreter (CPU) bfloat16 rows, tables and weights are refused (its bfloat16
casts differ from the GPU's).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch

from ...kernels import triton_support
from ...kernels.triton_fp8 import IMPORT_ERROR as _IMPORT_ERROR
from ...kernels.triton_fp8 import tl, triton
from ...kernels.triton_rope import LAUNCH_OPTIONS
from ...kernels.triton_support import next_pow2
from .op import float32_bits

if triton is not None:  # without triton this module imports, and `available` says why
    from ...kernels.triton_fp8 import pdl_entry
    from ...kernels.triton_qk_norm import (
        f32_from_bits,
        load_row_pairs,
        norm_rope_pairs,
        norm_rope_tile,
        pair_tables,
        qk_norm_prologue,
        row_weights,
        store_row_pairs,
    )
    from ..rotary_embedding.triton_impl import TUNING, interpreter_reason, tiling

__all__ = ["available", "unsupported", "run", "interpreter_dtypes", "signed_bits", "QkLaunch",
           "qk_launch", "RowsTuning", "ROWS_TUNING", "RowsLaunch", "rows_launch"]


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

# eq=False: hashed by identity (a key of the launch cache).
@dataclasses.dataclass(frozen=True, eq=False)
class RowsTuning:
    """When the QK-norm ops take their whole-row kernels (kvwrite.kernels.triton_qk_norm's
    second part: 16-byte accesses, no lane holding another's elements) instead of the tile
    kernels, and their launch shape. The whole-row kernels need rot_dim == head_size == a power
    of two (the others always take the tile kernels).

    Not measured yet (written without a GPU; docs/tuning-log.md gets the figures): the shape
    follows the CUDA large-call kernel's reasoning, enough bytes per program that the grid is a
    few waves and every thread has several 16-byte loads in flight. Read on the CPU from the
    sm_90 PTX (tests/test_qk_norm_rope.py): the tile kernel at its large-call tiles (8 heads of
    D = 128 bfloat16, one warp) kept every element of the tile in every lane (2064 float adds,
    512 shared-memory loads per thread, 2-byte loads and stores); the whole-row kernel has only
    16-byte row loads and stores and 3 shuffles per half row."""

    # Calls of fewer rotated tokens keep the tile kernel and its small-call launch shapes
    # (their latency was measured with them: rotary_embedding's RopeTuning).
    min_tokens: int = 17
    # Input bytes of query or key rows per program, and the most warps per program.
    tile_bytes: int = 16384
    warps: int = 4
    # Smaller calls halve the tokens per program (down to one) until the grid has at least
    # min_programs programs (2 per SM of an H200), with a warp per bytes_per_warp of rows (128
    # bytes, eight 16-byte loads, per thread), so that a mid-size call is not a handful of long
    # programs.
    min_programs: int = 264
    bytes_per_warp: int = 4096


ROWS_TUNING = RowsTuning()


class RowsLaunch(NamedTuple):
    """A whole-row kernel's launch (:func:`rows_launch`)."""

    block_t: int
    block_h: int
    warps: int
    q_tiles: int
    grid: tuple[int, int]
    pdl: bool
    trigger: bool


def rows_launch(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int,
                cos_sin_cache: torch.Tensor, position_ids: torch.Tensor,
                rows_tuning: RowsTuning) -> RowsLaunch | None:
    """The whole-row kernel's launch of a call of either QK-norm op, or None where the call takes
    the tile kernel (too few tokens, or rot_dim != head_size, or head_size not a power of
    two). BLOCK_H: the fewer heads of the two kinds (rounded up to a power of two), so that
    neither kind's programs are mostly masked; BLOCK_T: tokens to fill ``tile_bytes``."""
    num_rot = position_ids.numel()
    head_size = qkv.shape[2]
    if (num_rot == 0 or num_rot < rows_tuning.min_tokens or cos_sin_cache.shape[1] != head_size
            or head_size != next_pow2(head_size) or head_size < 2):
        return None
    block_t, block_h, warps, q_tiles, k_tiles = _rows_tiling(
        num_rot, num_heads_q, num_heads_k, head_size * qkv.element_size(), rows_tuning)
    grid = (triton.cdiv(num_rot, block_t), q_tiles + k_tiles)
    tuning = TUNING
    pdl, trigger = triton_support.pdl_launch(qkv.device, grid[0] * grid[1],
                                             tuning.pdl_max_programs,
                                             tuning.pdl_trigger_max_programs)
    return RowsLaunch(block_t, block_h, warps, q_tiles, grid, pdl, trigger)


@functools.lru_cache(maxsize=512)
def _rows_tiling(num_rot: int, num_heads_q: int, num_heads_k: int, row_bytes: int,
                 rows_tuning: RowsTuning) -> tuple[int, int, int, int, int]:
    rows = max(1, rows_tuning.tile_bytes // row_bytes)
    block_h = min(next_pow2(min(num_heads_q, num_heads_k)), next_pow2(rows))
    q_tiles, k_tiles = -(-num_heads_q // block_h), -(-num_heads_k // block_h)
    block_t = min(next_pow2(num_rot), max(1, rows // block_h))
    while block_t > 1 and -(-num_rot // block_t) * (q_tiles + k_tiles) < rows_tuning.min_programs:
        block_t //= 2
    tile = block_t * block_h * row_bytes
    warps = max(1, min(rows_tuning.warps, tile // rows_tuning.bytes_per_warp))
    return block_t, block_h, warps, q_tiles, k_tiles


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


    @triton.jit(do_not_specialize=["num_rot", "eps_bits", "offset_bits"])
    def _qk_norm_rope_rows_kernel(
        positions_ptr, qkv_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr,  # as the kernel above
        num_rot, qkv_stride, max_position, eps_bits, offset_bits,
        NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
        HEAD_STRIDE: tl.constexpr, IS_NEOX: tl.constexpr, HAS_QW: tl.constexpr,
        HAS_KW: tl.constexpr, ADD_OFFSET: tl.constexpr, Q_TILES: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
        PDL_TRIGGER: tl.constexpr,
    ):
        """The large-call kernel (rot_dim == head_size == a power of two): grid (token tiles, q
        tiles + k tiles), a program normalizes and rotates BLOCK_H heads of BLOCK_T tokens as
        kvwrite.kernels.triton_qk_norm's whole-row tiles."""
        pdl_entry(PDL, PDL_TRIGGER)
        HALF: tl.constexpr = HEAD_SIZE // 2
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tile = tl.program_id(1)
        valid, c, s = pair_tables(positions_ptr, cos_sin_ptr, t, num_rot, max_position, HALF)
        eps = f32_from_bits(eps_bits)
        offset = f32_from_bits(offset_bits)
        j = tl.arange(0, HALF)[None, None, :]
        tok = (t.to(tl.int64) * qkv_stride)[:, None, None]
        if tile < Q_TILES:
            h = tile * BLOCK_H + tl.arange(0, BLOCK_H)[None, :, None]
            mask = valid[:, None, None] & (h < NUM_Q_HEADS)
            row = tok + h * HEAD_STRIDE
            wa, wb = row_weights(q_weight_ptr, HALF, IS_NEOX, HAS_QW, ADD_OFFSET, offset)
            a, b = load_row_pairs(qkv_ptr, row, j, mask, HALF, IS_NEOX)
            a, b = norm_rope_pairs(a, b, wa, wb, eps, c, s, HALF, IS_NEOX, HAS_QW)
        else:
            h = (tile - Q_TILES) * BLOCK_H + tl.arange(0, BLOCK_H)[None, :, None]
            mask = valid[:, None, None] & (h < NUM_K_HEADS)
            row = tok + (NUM_Q_HEADS + h) * HEAD_STRIDE
            wa, wb = row_weights(k_weight_ptr, HALF, IS_NEOX, HAS_KW, ADD_OFFSET, offset)
            a, b = load_row_pairs(qkv_ptr, row, j, mask, HALF, IS_NEOX)
            a, b = norm_rope_pairs(a, b, wa, wb, eps, c, s, HALF, IS_NEOX, HAS_KW)
        ty = qkv_ptr.dtype.element_ty
        store_row_pairs(qkv_ptr, row, j, mask, a.to(ty), b.to(ty), HALF, IS_NEOX)


def run(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, eps: float,
        q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
        cos_sin_cache: torch.Tensor, is_neox: bool, position_ids: torch.Tensor,
        weight_offset: float, *, tuning=None, rows_tuning: RowsTuning | None = None) -> None:
    """Launch on PyTorch's current stream; arguments as validated by the public op. ``tuning``:
    a ``RopeTuning`` (rotary_embedding's; None: its ``TUNING``) for the tile kernel;
    ``rows_tuning``: when and how the whole-row kernel runs (:func:`rows_launch`; None: the
    module's ``ROWS_TUNING``, read per call)."""
    r = rows_launch(qkv, num_heads_q, num_heads_k, cos_sin_cache, position_ids,
                    ROWS_TUNING if rows_tuning is None else rows_tuning)
    if r is not None:
        _qk_norm_rope_rows_kernel[r.grid](
            position_ids, qkv, cos_sin_cache, q_weight, k_weight, position_ids.numel(),
            qkv.stride(0), cos_sin_cache.shape[0], signed_bits(eps), signed_bits(weight_offset),
            NUM_Q_HEADS=num_heads_q, NUM_K_HEADS=num_heads_k, HEAD_SIZE=qkv.shape[2],
            HEAD_STRIDE=qkv.stride(1), IS_NEOX=is_neox, HAS_QW=q_weight is not None,
            HAS_KW=k_weight is not None, ADD_OFFSET=weight_offset != 0, Q_TILES=r.q_tiles,
            BLOCK_T=r.block_t, BLOCK_H=r.block_h, num_warps=r.warps, PDL=r.pdl,
            PDL_TRIGGER=r.trigger, launch_pdl=r.pdl, **LAUNCH_OPTIONS,
        )
        return
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
