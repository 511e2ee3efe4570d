"""The Triton implementation of fused_rope_and_reshape_cache_flash: one launch rotates query and
key and writes the cache.

Grid (token tiles, query head tiles + key head tiles). A query program rotates a ``[BLOCK_T,
BLOCK_H, BLOCK_D]`` tile (kvwrite.kernels.triton_rope) and stores it in place or to query_out. A
key program rotates a key tile, stores it back (unless ``rotate_key_in_place`` is false), loads
the same tile of value, and stores both into the caches through their strides (every layout)
with the cache write's conversion (kvwrite.kernels.triton_fp8.store_quantized: copies, casts,
fp8 by the fp8 rule with per-tensor or per-head scales read on the device). Tokens whose position is
outside the table are neither rotated nor cached; tokens ``t >= T`` (slot_mapping.numel()) are
rotated but not cached; padding and out-of-range slots are skipped. Graph-safe.

Under Triton's interpreter (CPU) the cases whose casts it rounds differently from the GPU are
refused (bfloat16 rows or tables, and reshape_and_cache_flash's inexact cache casts).
"""

from __future__ import annotations

import torch

from ...dtypes import CacheDType, scale_is_per_head
from ...kernels import triton_support
from ...kernels.triton_fp8 import COPY as _COPY
from ...kernels.triton_fp8 import (
    code_view,
    fp8_scale_pair,
    load_scale_pair,
    quant_code,
    scale_constants,
    store_quantized,
    tl,
    triton,
)
from ...kernels.triton_kv import cache_offsets
from ...kernels.triton_rope import LAUNCH_OPTIONS, rope_prologue, rope_rotate
from ...kernels.triton_support import inexact_cast_reason
from ..rotary_embedding.op import head_stride
from ..rotary_embedding.triton_impl import TUNING, RopeTuning, interpreter_reason, tiling
from ..rotary_embedding.triton_impl import available as _available

__all__ = ["available", "unsupported", "run", "takes_value_first"]


def available(device: torch.device) -> str | None:
    return _available(device)


def unsupported(query, key, key_cache, cache_dtype: CacheDType, cos_sin_cache,
                is_neox) -> str | None:
    if query.device.type == "cuda":
        return None
    return (interpreter_reason(query.dtype, cos_sin_cache.dtype)
            or inexact_cast_reason(key.dtype, cache_dtype.element_dtype(key.dtype), False))



if triton is not None:

    @triton.jit(do_not_specialize=["num_rot", "num_tokens"])
    def _fused_kernel(
        positions_ptr,  # [T_rot] int64 or int32
        query_ptr,  # [T_pad, Hq, D], token stride q_stride, head stride Q_HEAD_STRIDE
        query_out_ptr,  # rotated query rows (query itself when in place): qo_stride, QO_HEAD_STRIDE
        key_ptr,  # [T_pad, H, D], k_stride, K_HEAD_STRIDE
        value_ptr,  # [T_pad, H, D], v_stride, V_HEAD_STRIDE
        cos_sin_ptr,  # [max_position, ROT]: cos | sin
        key_cache_ptr,  # [num_blocks, block_size, H, D] via (stride_b, stride_s, stride_h, 1)
        value_cache_ptr,  # same logical shape and strides, other base
        slot_mapping_ptr,  # [T] int64 or int32
        k_scale_ptr, v_scale_ptr,  # [1] or [H] float32 (fp8 only; None otherwise)
        num_rot, num_tokens,  # T_rot, T
        q_stride, qo_stride, k_stride, v_stride,  # token strides in elements
        max_position, num_slots,
        stride_b, stride_s, stride_h,  # cache strides in elements
        # Head strides in elements, compiled in as HEAD_SIZE (op.head_stride: HEAD_SIZE for
        # dense heads, whose kernel is then the one without head strides); the model fixes them.
        Q_HEAD_STRIDE: tl.constexpr, QO_HEAD_STRIDE: tl.constexpr, K_HEAD_STRIDE: tl.constexpr,
        V_HEAD_STRIDE: tl.constexpr,
        NUM_Q_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
        ROT: tl.constexpr, IS_NEOX: tl.constexpr, STORE_KEY: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, K_PER_HEAD: tl.constexpr,
        V_PER_HEAD: tl.constexpr,  # each scale's own kind (scale_is_per_head)
        Q_TILES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr, PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,
        VALUE_FIRST: tl.constexpr,
        NATIVE: tl.constexpr,  # fp8 codes by the float8 conversion (triton_support.native_fp8)
    ):
        t, tile, valid, c, s, partner, first, is_rot = rope_prologue(
            positions_ptr, cos_sin_ptr, num_rot, max_position, ROT, IS_NEOX, BLOCK_T, BLOCK_D,
            PDL, PDL_TRIGGER)
        d = tl.arange(0, BLOCK_D)[None, None, :]
        t64 = t.to(tl.int64)
        if tile < Q_TILES:
            h = tile * BLOCK_H + tl.arange(0, BLOCK_H)[None, :, None]
            mask = valid[:, None, None] & (h < NUM_Q_HEADS) & (d < HEAD_SIZE)
            row = (t64 * q_stride)[:, None, None] + h * Q_HEAD_STRIDE
            x = tl.load(query_ptr + row + d, mask=mask)
            y = tl.load(query_ptr + row + partner, mask=mask)
            out_row = (t64 * qo_stride)[:, None, None] + h * QO_HEAD_STRIDE
            tl.store(query_out_ptr + out_row + d, rope_rotate(x, y, c, s, first, is_rot),
                     mask=mask)
        else:
            hv = (tile - Q_TILES) * BLOCK_H + tl.arange(0, BLOCK_H)
            h = hv[None, :, None]
            in_row = (h < NUM_HEADS) & (d < HEAD_SIZE)
            mask = valid[:, None, None] & in_row
            cached = t < num_tokens
            slot = tl.load(slot_mapping_ptr + t, mask=cached, other=-1).to(tl.int64)
            STEPS: tl.constexpr = 2 if key_ptr.dtype.element_ty == tl.float32 else 1
            if VALUE_FIRST:
                # Small calls: the scales loaded before anything is stored (after the key's store
                # the compiler may not move them up, as they could alias the key), and all but
                # the key's own work done before the rotation, which waits for the table's round
                # trip (tuning-log change 46).
                ksc, vsc = load_scale_pair(k_scale_ptr, v_scale_ptr, hv, NUM_HEADS, QUANT,
                                           K_PER_HEAD, V_PER_HEAD)
            row = (t64 * k_stride)[:, None, None] + h * K_HEAD_STRIDE
            x = tl.load(key_ptr + row + d, mask=mask)
            y = tl.load(key_ptr + row + partner, mask=mask)
            v_row = (t64 * v_stride)[:, None, None] + h * V_HEAD_STRIDE
            v = tl.load(value_ptr + v_row + d, mask=cached[:, None, None] & in_row)
            if VALUE_FIRST:
                store_mask, c_off = cache_offsets(slot, cached & valid, in_row, h, d, num_slots,
                                                  BLOCK_SIZE, stride_b, stride_s, stride_h)
                vm, vs2, vy = scale_constants(vsc, QUANT, V_PER_HEAD)
                store_quantized(value_cache_ptr, c_off, store_mask, v, vm, vs2, vy, QUANT, STEPS,
                                NATIVE)
                km, ks2, ky = scale_constants(ksc, QUANT, K_PER_HEAD)
            k = rope_rotate(x, y, c, s, first, is_rot)
            if STORE_KEY:
                tl.store(key_ptr + row + d, k, mask=mask)
            if not VALUE_FIRST:
                # Large calls: the scales after the key's store, one after the other, and the
                # value last (the order of every call before change 46; with the small calls'
                # order GQA fp8 T=16384 took 5% longer).
                km, ks2, ky, vm, vs2, vy = fp8_scale_pair(k_scale_ptr, v_scale_ptr, hv,
                                                          NUM_HEADS, QUANT, K_PER_HEAD, V_PER_HEAD,
                                                          False)
                store_mask, c_off = cache_offsets(slot, cached & valid, in_row, h, d, num_slots,
                                                  BLOCK_SIZE, stride_b, stride_s, stride_h)
            store_quantized(key_cache_ptr, c_off, store_mask, k, km, ks2, ky, QUANT, STEPS,
                            NATIVE)
            if not VALUE_FIRST:
                store_quantized(value_cache_ptr, c_off, store_mask, v, vm, vs2, vy, QUANT, STEPS,
                                NATIVE)


def takes_value_first(programs: int, fp8: bool, tuning: RopeTuning = TUNING) -> bool:
    """Whether a launch of ``programs`` programs stores the value before the key's rotation
    (``tuning.fused_value_first_max_programs``; fp8 caches: ``..._fp8``)."""
    return programs <= (tuning.fused_value_first_max_programs_fp8 if fp8
                        else tuning.fused_value_first_max_programs)


def run(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
        cos_sin_cache: torch.Tensor, is_neox: bool, key_cache: torch.Tensor,
        value_cache: torch.Tensor, slot_mapping: torch.Tensor, cache_dtype: CacheDType,
        k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, rotate_key_in_place: bool,
        query_out: torch.Tensor | None, *, tuning: RopeTuning = TUNING) -> None:
    """Launch on PyTorch's current stream; arguments as validated by the public op."""
    num_rot = positions.numel()
    if num_rot == 0:
        return
    _, hq, d = query.shape
    h = key.shape[1]
    block_t, block_h, block_d, warps, nq, nk = tiling(num_rot, hq, h, d, query.element_size(),
                                                      tuning)
    quant = quant_code(cache_dtype)
    num_blocks, block_size = key_cache.shape[:2]
    qo = query if query_out is None else query_out
    grid = (triton.cdiv(num_rot, block_t), nq + nk)
    programs = grid[0] * grid[1]
    pdl, trigger = triton_support.pdl_launch(query.device, programs, tuning.pdl_max_programs,
                                             tuning.pdl_trigger_max_programs)
    value_first = takes_value_first(programs, quant != _COPY, tuning)
    _fused_kernel[grid](
        positions, query, qo, key, value, cos_sin_cache, code_view(key_cache),
        code_view(value_cache), slot_mapping,
        k_scale, v_scale, num_rot, slot_mapping.numel(), query.stride(0), qo.stride(0),
        key.stride(0), value.stride(0), cos_sin_cache.shape[0], num_blocks * block_size,
        *key_cache.stride()[:3],
        Q_HEAD_STRIDE=head_stride(query), QO_HEAD_STRIDE=head_stride(qo),
        K_HEAD_STRIDE=head_stride(key), V_HEAD_STRIDE=head_stride(value),
        NUM_Q_HEADS=hq, NUM_HEADS=h, HEAD_SIZE=d, ROT=cos_sin_cache.shape[1], IS_NEOX=is_neox,
        STORE_KEY=rotate_key_in_place, BLOCK_SIZE=block_size, QUANT=quant,
        K_PER_HEAD=quant != _COPY and scale_is_per_head(k_scale),
        V_PER_HEAD=quant != _COPY and scale_is_per_head(v_scale), Q_TILES=nq, BLOCK_T=block_t,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=warps, PDL=pdl, PDL_TRIGGER=trigger,
        VALUE_FIRST=value_first, NATIVE=triton_support.native_fp8(query.device), launch_pdl=pdl,
        **LAUNCH_OPTIONS,
    )
