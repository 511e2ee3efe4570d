"""The Triton implementation of fused_qk_norm_rope_and_reshape_cache_flash: one launch normalizes
and rotates query and key heads, stores them and writes the caches.

Grid (token tiles, query head tiles + key head tiles), tiles as rotary_embedding's; qkv's head
stride compiled in as fused_qk_norm_rope's kernel's (query_out keeps dense heads). A query
program normalizes and rotates a ``[BLOCK_T, BLOCK_H, BLOCK_D]`` tile of query heads
(kvwrite.kernels.triton_qk_norm) and stores it in place, to query_out, or fp8-quantized to
query_out (kvwrite.kernels.triton_fp8.store_quantized_uniform with q_scale's constants). A key
program does the same for key heads, stores them back (unless ``rotate_key_in_place`` is
false), loads the same tile of value heads and stores key and value into the caches through
their strides (every layout) with the cache write's conversion (copies, casts, fp8 with
per-tensor or per-head scales read on the device; a per-tensor power-of-two scale as one
product per element, store_quantized_uniform's). Tokens whose position is outside the table are not
touched; tokens ``t >= T`` are normalized and rotated but not cached; padding and out-of-range
slots are skipped. Graph-safe. Large calls with rot_dim == head_size == a power of two take
``_qk_norm_rope_cache_rows_kernel``, the same program on fused_qk_norm_rope's whole-row tiles
(its ``rows_launch`` and ``RowsTuning`` decide).

Under Triton's interpreter (CPU) the cases whose casts it rounds differently from the GPU are
refused (bfloat16 rows, tables or weights, and the cache write's and the query's inexact casts:
kvwrite.kernels.triton_support.interpreter_inexact).
"""

from __future__ import annotations

import torch

from ...dtypes import CacheDType, scale_is_per_head
from ...kernels import triton_support
from ...kernels.triton_fp8 import COPY as _COPY
from ...kernels.triton_fp8 import IMPORT_ERROR as _IMPORT_ERROR
from ...kernels.triton_fp8 import code_view, quant_code, tl, triton
from ...kernels.triton_rope import LAUNCH_OPTIONS
from ...kernels.triton_support import inexact_cast_reason
from ..fused_qk_norm_rope import triton_impl as _norm
from ..fused_qk_norm_rope.triton_impl import interpreter_dtypes, qk_launch, signed_bits

if triton is not None:  # without triton this module imports, and `available` says why
    from ...kernels.triton_fp8 import (
        fp8_scale_pair,
        pdl_entry,
        scale_constants,
        store_quantized_uniform,
    )
    from ...kernels.triton_kv import cache_offsets
    from ...kernels.triton_qk_norm import (
        f32_from_bits,
        load_row_pairs,
        norm_rope_pairs,
        norm_rope_tile,
        pair_tables,
        qk_norm_prologue,
        row_weights,
        store_pairs_quantized,
        store_row_pairs,
    )
    from ..rotary_embedding.triton_impl import interpreter_reason

__all__ = ["available", "unsupported", "run"]


def available(device: torch.device) -> str | None:
    return triton_support.available(device, triton, lambda: _qk_norm_rope_cache_kernel,
                                    _IMPORT_ERROR)




def unsupported(qkv, q_weight, k_weight, cos_sin_cache, is_neox, key_cache,
                cache_dtype: CacheDType, query_out) -> str | None:
    if qkv.device.type == "cuda":
        return None
    reason = (interpreter_reason(*interpreter_dtypes(qkv, q_weight, k_weight, cos_sin_cache))
              or inexact_cast_reason(qkv.dtype, cache_dtype.element_dtype(qkv.dtype), False))
    if reason is None and query_out is not None and quant_code(query_out.dtype) != _COPY:
        reason = inexact_cast_reason(qkv.dtype, query_out.dtype, False)
    return reason


if triton is not None:

    @triton.jit(do_not_specialize=["num_rot", "num_tokens", "eps_bits", "offset_bits"])
    def _qk_norm_rope_cache_kernel(
        positions_ptr,  # [T_rot] int64 or int32
        qkv_ptr,  # [T_pad, Hq + Hk + Hv, D], token stride qkv_stride, head stride HEAD_STRIDE
        query_out_ptr,  # [T_pad, Hq, D], token stride qo_stride (qkv itself when in place)
        cos_sin_ptr,  # [max_position, ROT]: cos | sin
        q_weight_ptr, k_weight_ptr,  # [D] each (None where HAS_QW / HAS_KW is false)
        key_cache_ptr,  # [num_blocks, block_size, Hk, D] via (stride_b, stride_s, stride_h, 1)
        value_cache_ptr,  # same logical shape and strides, other base
        slot_mapping_ptr,  # [T] int64 or int32
        k_scale_ptr, v_scale_ptr,  # [1] or [Hk] float32 (fp8 caches only; None otherwise)
        q_scale_ptr,  # [1] or [Hq] float32 (fp8 query_out only; None otherwise)
        num_rot, num_tokens,  # T_rot, T
        qkv_stride, qo_stride,  # token strides in elements
        max_position, num_slots,
        stride_b, stride_s, stride_h,  # cache strides in elements
        eps_bits, offset_bits,  # float32(eps), float32(weight_offset) as int32 bits
        NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
        HEAD_STRIDE: tl.constexpr, ROT: tl.constexpr, IS_NEOX: tl.constexpr, HAS_QW: tl.constexpr,
        HAS_KW: tl.constexpr, ADD_OFFSET: tl.constexpr, STORE_KEY: tl.constexpr,
        QUERY_IN_PLACE: tl.constexpr,
        QUERY_QUANT: tl.constexpr, Q_PER_HEAD_SCALE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        QUANT: tl.constexpr, K_PER_HEAD: tl.constexpr, V_PER_HEAD: tl.constexpr,  # own kinds
        Q_TILES: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
        PDL_TRIGGER: tl.constexpr,
        NATIVE: tl.constexpr,  # fp8 codes by the float8 conversion (triton_support.native_fp8)
    ):
        t, tile, valid, c, s, partner, first, is_rot, eps, offset, d, t64 = qk_norm_prologue(
            positions_ptr, cos_sin_ptr, num_rot, max_position, eps_bits, offset_bits, ROT,
            IS_NEOX, BLOCK_T, BLOCK_D, PDL, PDL_TRIGGER)
        STEPS: tl.constexpr = 2 if qkv_ptr.dtype.element_ty == tl.float32 else 1
        if tile < Q_TILES:
            hq = tile * BLOCK_H + tl.arange(0, BLOCK_H)
            h = hq[None, :, None]
            mask = valid[:, None, None] & (h < NUM_Q_HEADS) & (d < HEAD_SIZE)
            row = (t64 * qkv_stride)[:, None, None] + h * HEAD_STRIDE
            q = norm_rope_tile(qkv_ptr, row, d, partner, mask, q_weight_ptr, eps, offset, c, s,
                               first, is_rot, HEAD_SIZE, HAS_QW, ADD_OFFSET, BLOCK_D)
            q = q.to(qkv_ptr.dtype.element_ty)
            if QUERY_IN_PLACE:
                tl.store(qkv_ptr + row + d, q, mask=mask)
            else:
                q_row = (t64 * qo_stride)[:, None, None] + h * HEAD_SIZE
                if QUERY_QUANT == 0:
                    tl.store(query_out_ptr + q_row + d, q, mask=mask)
                else:
                    if Q_PER_HEAD_SCALE:
                        qsc = tl.load(q_scale_ptr + hq, mask=hq < NUM_Q_HEADS, other=1.0)
                    else:
                        qsc = tl.load(q_scale_ptr)
                    qm, qs2, qy = scale_constants(qsc, QUERY_QUANT, Q_PER_HEAD_SCALE)
                    store_quantized_uniform(query_out_ptr, q_row + d, mask, q, qm, qs2, qy,
                                            QUERY_QUANT, STEPS, NATIVE, not Q_PER_HEAD_SCALE)
        else:
            hv = (tile - Q_TILES) * BLOCK_H + tl.arange(0, BLOCK_H)
            h = hv[None, :, None]
            in_row = (h < NUM_K_HEADS) & (d < HEAD_SIZE)
            mask = valid[:, None, None] & in_row
            row = (t64 * qkv_stride)[:, None, None] + (NUM_Q_HEADS + h) * HEAD_STRIDE
            cached = t < num_tokens
            slot = tl.load(slot_mapping_ptr + t, mask=cached, other=-1).to(tl.int64)
            k = norm_rope_tile(qkv_ptr, row, d, partner, mask, k_weight_ptr, eps, offset, c, s,
                               first, is_rot, HEAD_SIZE, HAS_KW, ADD_OFFSET, BLOCK_D)
            k = k.to(qkv_ptr.dtype.element_ty)
            v = tl.load(qkv_ptr + row + NUM_K_HEADS * HEAD_STRIDE + d,
                        mask=cached[:, None, None] & in_row)
            if STORE_KEY:
                tl.store(qkv_ptr + row + d, k, mask=mask)
            km, ks2, ky, vm, vs2, vy = fp8_scale_pair(k_scale_ptr, v_scale_ptr, hv, NUM_K_HEADS,
                                                      QUANT, K_PER_HEAD, V_PER_HEAD, False)
            store_mask, c_off = cache_offsets(slot, cached & valid, in_row, h, d, num_slots,
                                              BLOCK_SIZE, stride_b, stride_s, stride_h)
            store_quantized_uniform(key_cache_ptr, c_off, store_mask, k, km, ks2, ky, QUANT,
                                    STEPS, NATIVE, not K_PER_HEAD)
            store_quantized_uniform(value_cache_ptr, c_off, store_mask, v, vm, vs2, vy, QUANT,
                                    STEPS, NATIVE, not V_PER_HEAD)


    @triton.jit(do_not_specialize=["num_rot", "num_tokens", "eps_bits", "offset_bits"])
    def _qk_norm_rope_cache_rows_kernel(
        positions_ptr, qkv_ptr, query_out_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr,
        key_cache_ptr, value_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr, q_scale_ptr,
        num_rot, num_tokens, qkv_stride, qo_stride, max_position, num_slots, stride_b, stride_s,
        stride_h, eps_bits, offset_bits,  # all as the kernel above
        NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
        HEAD_STRIDE: tl.constexpr, IS_NEOX: tl.constexpr, HAS_QW: tl.constexpr,
        HAS_KW: tl.constexpr, ADD_OFFSET: tl.constexpr, STORE_KEY: tl.constexpr,
        QUERY_IN_PLACE: tl.constexpr,
        QUERY_QUANT: tl.constexpr, Q_PER_HEAD_SCALE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        QUANT: tl.constexpr, K_PER_HEAD: tl.constexpr, V_PER_HEAD: tl.constexpr,
        Q_TILES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
        PDL_TRIGGER: tl.constexpr, NATIVE: tl.constexpr,
    ):
        """The large-call kernel (rot_dim == head_size == a power of two; fused_qk_norm_rope's
        RowsTuning): the kernel above with kvwrite.kernels.triton_qk_norm's whole-row tiles of
        BLOCK_H heads of BLOCK_T tokens, the same stores in the same order."""
        pdl_entry(PDL, PDL_TRIGGER)
        HALF: tl.constexpr = HEAD_SIZE // 2
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tile = tl.program_id(1)
        valid, c, s = pair_tables(positions_ptr, cos_sin_ptr, t, num_rot, max_position, HALF)
        eps = f32_from_bits(eps_bits)
        offset = f32_from_bits(offset_bits)
        j = tl.arange(0, HALF)[None, None, :]
        t64 = t.to(tl.int64)
        tok = (t64 * qkv_stride)[:, None, None]
        STEPS: tl.constexpr = 2 if qkv_ptr.dtype.element_ty == tl.float32 else 1
        ty = qkv_ptr.dtype.element_ty
        if tile < Q_TILES:
            hq = tile * BLOCK_H + tl.arange(0, BLOCK_H)
            h = hq[None, :, None]
            mask = valid[:, None, None] & (h < NUM_Q_HEADS)
            row = tok + h * HEAD_STRIDE
            wa, wb = row_weights(q_weight_ptr, HALF, IS_NEOX, HAS_QW, ADD_OFFSET, offset)
            a, b = load_row_pairs(qkv_ptr, row, j, mask, HALF, IS_NEOX)
            a, b = norm_rope_pairs(a, b, wa, wb, eps, c, s, HALF, IS_NEOX, HAS_QW)
            a = a.to(ty)
            b = b.to(ty)
            if QUERY_IN_PLACE:
                store_row_pairs(qkv_ptr, row, j, mask, a, b, HALF, IS_NEOX)
            else:
                q_row = (t64 * qo_stride)[:, None, None] + h * HEAD_SIZE
                if QUERY_QUANT == 0:
                    store_row_pairs(query_out_ptr, q_row, j, mask, a, b, HALF, IS_NEOX)
                else:
                    if Q_PER_HEAD_SCALE:
                        qsc = tl.load(q_scale_ptr + hq, mask=hq < NUM_Q_HEADS, other=1.0)
                    else:
                        qsc = tl.load(q_scale_ptr)
                    qm, qs2, qy = scale_constants(qsc, QUERY_QUANT, Q_PER_HEAD_SCALE)
                    store_pairs_quantized(query_out_ptr, q_row, mask, a, b, qm, qs2, qy,
                                          QUERY_QUANT, STEPS, HALF, IS_NEOX, NATIVE,
                                          not Q_PER_HEAD_SCALE)
        else:
            hv = (tile - Q_TILES) * BLOCK_H + tl.arange(0, BLOCK_H)
            h = hv[None, :, None]
            in_row = h < NUM_K_HEADS
            mask = valid[:, None, None] & in_row
            row = tok + (NUM_Q_HEADS + h) * HEAD_STRIDE
            cached = t < num_tokens
            slot = tl.load(slot_mapping_ptr + t, mask=cached, other=-1).to(tl.int64)
            wa, wb = row_weights(k_weight_ptr, HALF, IS_NEOX, HAS_KW, ADD_OFFSET, offset)
            a, b = load_row_pairs(qkv_ptr, row, j, mask, HALF, IS_NEOX)
            a, b = norm_rope_pairs(a, b, wa, wb, eps, c, s, HALF, IS_NEOX, HAS_KW)
            a = a.to(ty)
            b = b.to(ty)
            va, vb = load_row_pairs(qkv_ptr, row + NUM_K_HEADS * HEAD_STRIDE, j,
                                    cached[:, None, None] & in_row, HALF, IS_NEOX)
            if STORE_KEY:
                store_row_pairs(qkv_ptr, row, j, mask, a, b, HALF, IS_NEOX)
            km, ks2, ky, vm, vs2, vy = fp8_scale_pair(k_scale_ptr, v_scale_ptr, hv, NUM_K_HEADS,
                                                      QUANT, K_PER_HEAD, V_PER_HEAD, False)
            store_mask, c_row = cache_offsets(slot, cached & valid, in_row, h, 0, num_slots,
                                              BLOCK_SIZE, stride_b, stride_s, stride_h)
            store_pairs_quantized(key_cache_ptr, c_row, store_mask, a, b, km, ks2, ky, QUANT,
                                  STEPS, HALF, IS_NEOX, NATIVE, not K_PER_HEAD)
            store_pairs_quantized(value_cache_ptr, c_row, store_mask, va, vb, vm, vs2, vy, QUANT,
                                  STEPS, HALF, IS_NEOX, NATIVE, not V_PER_HEAD)


def run(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, eps: float,
        q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
        cos_sin_cache: torch.Tensor, is_neox: bool, position_ids: torch.Tensor,
        weight_offset: float, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, cache_dtype: CacheDType, k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None, rotate_key_in_place: bool,
        query_out: torch.Tensor | None, q_scale: torch.Tensor | None, *,
        tuning=None, rows_tuning=None) -> None:
    """Launch on PyTorch's current stream; arguments as validated by the public op. ``tuning``:
    a ``RopeTuning`` (rotary_embedding's; None: its ``TUNING``) for the tile kernel;
    ``rows_tuning``: fused_qk_norm_rope's ``RowsTuning`` (None: its ``ROWS_TUNING``, read per
    call), which calls take the whole-row kernel."""
    quant = quant_code(cache_dtype)
    query_quant = _COPY if query_out is None else quant_code(query_out.dtype)
    num_blocks, block_size = key_cache.shape[:2]
    qo = qkv if query_out is None else code_view(query_out)
    args = (position_ids, qkv, qo, cos_sin_cache, q_weight, k_weight, code_view(key_cache),
            code_view(value_cache), slot_mapping, k_scale, v_scale,
            q_scale if query_quant else None,
            position_ids.numel(), slot_mapping.numel(), qkv.stride(0), qo.stride(0),
            cos_sin_cache.shape[0], num_blocks * block_size, *key_cache.stride()[:3],
            signed_bits(eps), signed_bits(weight_offset))
    consts = dict(
        NUM_Q_HEADS=num_heads_q, NUM_K_HEADS=num_heads_k, HEAD_SIZE=qkv.shape[2],
        HEAD_STRIDE=qkv.stride(1), IS_NEOX=is_neox, HAS_QW=q_weight is not None,
        HAS_KW=k_weight is not None, ADD_OFFSET=weight_offset != 0,
        STORE_KEY=rotate_key_in_place, QUERY_IN_PLACE=query_out is None,
        QUERY_QUANT=query_quant,
        Q_PER_HEAD_SCALE=bool(query_quant) and scale_is_per_head(q_scale),
        BLOCK_SIZE=block_size, QUANT=quant,
        K_PER_HEAD=quant != _COPY and scale_is_per_head(k_scale),
        V_PER_HEAD=quant != _COPY and scale_is_per_head(v_scale),
        NATIVE=triton_support.native_fp8(qkv.device), **LAUNCH_OPTIONS)
    r = _norm.rows_launch(qkv, num_heads_q, num_heads_k, cos_sin_cache, position_ids,
                          _norm.ROWS_TUNING if rows_tuning is None else rows_tuning)
    if r is not None:
        _qk_norm_rope_cache_rows_kernel[r.grid](
            *args, **consts, Q_TILES=r.q_tiles, BLOCK_T=r.block_t, BLOCK_H=r.block_h,
            num_warps=r.warps, PDL=r.pdl, PDL_TRIGGER=r.trigger, launch_pdl=r.pdl)
        return
    q = qk_launch(qkv, num_heads_q, num_heads_k, position_ids, tuning)
    if q is None:
        return
    _qk_norm_rope_cache_kernel[q.grid](
        *args, **consts, ROT=cos_sin_cache.shape[1], Q_TILES=q.q_tiles, BLOCK_T=q.block_t,
        BLOCK_H=q.block_h, BLOCK_D=q.block_d, num_warps=q.warps, PDL=q.pdl,
        PDL_TRIGGER=q.trigger, launch_pdl=q.pdl)
