"""The Triton implementation: one kernel for every layout, cache dtype and scale shape.

One program writes a tile ``[BLOCK_T tokens, BLOCK_H heads, BLOCK_D]`` of K and the same tile of V:
it reads each token's slot once, loads both input tiles (masked by the token and head bounds
only, so the loads do not wait for the slot), converts them and stores them through the cache
strides (so NHD, HND, interleaved and packed caches are the same code). Offsets into the caches
and inputs are 64-bit. ``BLOCK_D`` is ``head_size`` rounded up to a power of two, masked. The grid
is (token tiles, head tiles). The strides and the cache's slot count are compile-time constants
(one compiled variant per cache geometry and input layout, as for the shape); tile shapes,
warps and the loads' cache hint are chosen per shape on the host by :func:`_tiling` (cached),
and nothing is read on the host per call, so ``run`` is CUDA-graph safe: a replay sees new
inputs, slots and scales.

fp8 follows the fp8 rule exactly: the true float32 quotient ``RN(x / s)`` (Triton's ``/`` on float32
is approximate), computed without a division per element (``kvwrite.kernels.triton_fp8``: ``fp8_scale`` splits the
scale's exponent off once per program or head, ``fp8_quotient`` corrects a reciprocal product
with fused multiply-adds), saturated to ±448 / ±57344 with NaN kept and the sign of zero kept, then
the round-to-nearest-even cast to ``float8e4nv`` / ``float8e5``, stored bit for bit into
``uint8`` or float8 caches.

On CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``), which rounds some float casts
differently from the GPU; :func:`unsupported` refuses those cases there
(``kvwrite.kernels.triton_support.interpreter_inexact``).
"""

from __future__ import annotations

import torch

from ...dtypes import CacheDType, scale_is_per_head
from ...kernels import triton_support
from ...kernels.triton_fp8 import COPY as _COPY
from ...kernels.triton_fp8 import E4M3 as _E4M3
from ...kernels.triton_fp8 import E5M2 as _E5M2
from ...kernels.triton_fp8 import IMPORT_ERROR as _IMPORT_ERROR
from ...kernels.triton_fp8 import store_quantized, tl, triton
from ...kernels.triton_kv import TUNING, TritonTuning, interpreter_reason, load_kv_tile
from ...kernels.triton_kv import tiling as _tiling

__all__ = ["TritonTuning", "TUNING", "available", "unsupported", "run"]


def available(device: torch.device) -> str | None:
    return triton_support.available(device, triton, lambda: _kvwrite_kernel, _IMPORT_ERROR)


def unsupported(key: torch.Tensor, key_cache: torch.Tensor, cache_dtype: CacheDType,
                k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> str | None:
    return interpreter_reason(key, cache_dtype)


# --------------------------------------------------------------------------------------------
# The kernel. QUANT: _COPY (copy or float cast to the cache's element type), _E4M3, _E5M2 (the
# codes of kvwrite.kernels.triton_fp8.store_quantized).

if triton is not None:

    # num_tokens only bounds masks: specializing on it (divisibility, == 1) would compile a new
    # variant for many token counts without making any access wider.
    @triton.jit(do_not_specialize=["num_tokens"])
    def _kvwrite_kernel(
        key_ptr,  # [T_pad, H, D], token stride KEY_STRIDE, dense heads
        value_ptr,  # [T_pad, H, D], token stride VALUE_STRIDE, dense heads
        key_cache_ptr,  # [num_blocks, block_size, H, D] via (STRIDE_B, STRIDE_S, STRIDE_H, 1)
        value_cache_ptr,  # same logical shape and strides as key_cache, other base
        slot_mapping_ptr,  # [T] int64 or int32
        k_scale_ptr,  # [1] or [H] float32 (fp8 only; None otherwise)
        v_scale_ptr,  # [1] or [H] float32 (fp8 only; None otherwise)
        num_tokens,  # T
        # Fixed by the caches and the inputs' layout, so compiled in: the index math folds and
        # nothing but the pointers and T is read from the parameter bank.
        KEY_STRIDE: tl.constexpr,  # token strides of key and value, in elements
        VALUE_STRIDE: tl.constexpr,
        STRIDE_B: tl.constexpr,  # cache strides in elements (block, slot in block, head)
        STRIDE_S: tl.constexpr,
        STRIDE_H: tl.constexpr,
        NUM_SLOTS: tl.constexpr,  # num_blocks * block_size
        NUM_HEADS: tl.constexpr,
        HEAD_SIZE: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block
        QUANT: tl.constexpr,
        K_PER_HEAD: tl.constexpr,  # each scale's own kind (scale_is_per_head)
        V_PER_HEAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        LOAD_EVICT: tl.constexpr,  # the data loads' eviction policy ("" or "evict_first")
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,  # programmatic dependent launch (pdl_entry)
    ):
        # 16-bit inputs need one correction step of the fp8 division, float32 two (fp8_quotient).
        STEPS: tl.constexpr = 2 if key_ptr.dtype.element_ty == tl.float32 else 1
        h, offs_d, k, v, km, ks2, ky, vm, vs2, vy, store_mask, slot, block = load_kv_tile(
            key_ptr, value_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr, num_tokens,
            KEY_STRIDE, VALUE_STRIDE, NUM_SLOTS, NUM_HEADS, HEAD_SIZE, BLOCK_SIZE, QUANT,
            K_PER_HEAD, V_PER_HEAD, BLOCK_T, BLOCK_H, BLOCK_D, LOAD_EVICT, PDL, PDL_TRIGGER)
        cache_row = block * STRIDE_B + (slot - block * BLOCK_SIZE) * STRIDE_S  # int64
        cache_col = h.to(tl.int64) * STRIDE_H
        c_off = cache_row[:, None, None] + cache_col[None, :, None] + offs_d[None, None, :]
        store_quantized(key_cache_ptr, c_off, store_mask, k, km, ks2, ky, QUANT, STEPS)
        store_quantized(value_cache_ptr, c_off, store_mask, v, vm, vs2, vy, QUANT, STEPS)


_QUANT = {CacheDType.FP8_E4M3: _E4M3, CacheDType.FP8_E5M2: _E5M2}


def run(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, cache_dtype: CacheDType, k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None, *, tuning: TritonTuning = TUNING) -> None:
    """Launch the kernel on PyTorch's current stream; arguments as validated by the public op."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    _, num_heads, head_size = key.shape
    num_blocks, block_size = key_cache.shape[:2]
    quant = _QUANT.get(cache_dtype, _COPY)
    block_t, block_h, block_d, num_warps, grid, evict = _tiling(
        num_tokens, num_heads, head_size, key.element_size(), quant != _COPY, tuning)
    k_per_head = quant != _COPY and scale_is_per_head(k_scale)
    v_per_head = quant != _COPY and scale_is_per_head(v_scale)
    stride_b, stride_s, stride_h, _ = key_cache.stride()
    # A stride along a dim of size 1 never multiplies a nonzero index: 0 there, so that it does
    # not compile another variant.
    t_pad = key.shape[0]
    programs = 1
    for n in grid:
        programs *= n
    pdl, trigger = triton_support.pdl_launch(key.device, programs, tuning.pdl_max_programs,
                                             tuning.pdl_trigger_max_programs)
    _kvwrite_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, num_tokens,
        KEY_STRIDE=key.stride(0) if t_pad > 1 else 0,
        VALUE_STRIDE=value.stride(0) if t_pad > 1 else 0,
        STRIDE_B=stride_b if num_blocks > 1 else 0, STRIDE_S=stride_s if block_size > 1 else 0,
        STRIDE_H=stride_h if num_heads > 1 else 0, NUM_SLOTS=num_blocks * block_size,
        NUM_HEADS=num_heads, HEAD_SIZE=head_size, BLOCK_SIZE=block_size, QUANT=quant,
        K_PER_HEAD=k_per_head, V_PER_HEAD=v_per_head, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d,
        LOAD_EVICT=evict, PDL=pdl, PDL_TRIGGER=trigger, num_warps=num_warps,
        launch_pdl=pdl,
    )
