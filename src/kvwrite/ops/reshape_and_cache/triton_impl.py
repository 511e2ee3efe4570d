"""The Triton implementation of reshape_and_cache: one kernel for every cache dtype, scale shape
and cache strides.

One program writes a tile ``[BLOCK_T tokens, BLOCK_H heads, BLOCK_D]`` of K and the same tile of
V, as reshape_and_cache_flash's kernel does (and with its tiling,
``kvwrite.kernels.triton_kv``): it reads each
token's slot once, loads both input tiles (masked by the token and head bounds only, so the loads
do not wait for the slot), converts them (``kvwrite.kernels.triton_fp8.store_quantized``: a copy,
a float cast, or the fp8 rule exactly) and stores them through the legacy layout's strides: the
key element ``d`` of head ``h`` at ``key_cache[b, h, d // X, o, d % X]``, the value element at
``value_cache[b, h, d, o]``. Offsets are 64-bit; strides and the geometry are compile-time
constants; nothing is read on the host per call, so ``run`` is CUDA-graph safe.

On CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``), which rounds some float casts
differently from the GPU; :func:`unsupported` refuses those cases there, as
reshape_and_cache_flash's does.
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
from ...kernels.triton_kv import TritonTuning, interpreter_reason, load_kv_tile, tiling

__all__ = ["TritonTuning", "TUNING", "available", "unsupported", "run"]

# The tiles and launch shapes of reshape_and_cache_flash's kernel: the same loads and conversions
# per program; only the stores' addresses differ.
TUNING = TritonTuning()


def available(device: torch.device) -> str | None:
    return triton_support.available(device, triton, lambda: _legacy_kernel, _IMPORT_ERROR)


def unsupported(key: torch.Tensor, key_cache: torch.Tensor, cache_dtype: CacheDType,
                k_scale: torch.Tensor | None) -> str | None:
    return interpreter_reason(key, cache_dtype)


if triton is not None:

    @triton.jit(do_not_specialize=["num_tokens"])
    def _legacy_kernel(
        key_ptr,  # [T_pad, H, D], token stride KEY_STRIDE, dense heads
        value_ptr,  # [T_pad, H, D], token stride VALUE_STRIDE, dense heads
        key_cache_ptr,  # [num_blocks, H, D / X, block_size, X] via KC_* strides
        value_cache_ptr,  # [num_blocks, H, D, block_size] via VC_* strides
        slot_mapping_ptr,  # [T] int64 or int32
        k_scale_ptr,  # [1] or [H] float32 (fp8 only; None otherwise)
        v_scale_ptr,  # [1] or [H] float32 (fp8 only; None otherwise)
        num_tokens,  # T
        KEY_STRIDE: tl.constexpr,
        VALUE_STRIDE: tl.constexpr,
        KC_B: tl.constexpr, KC_H: tl.constexpr, KC_G: tl.constexpr, KC_S: tl.constexpr,
        KC_X: tl.constexpr,  # key_cache strides (block, head, d // X, slot, d % X), elements
        VC_B: tl.constexpr, VC_H: tl.constexpr, VC_D: tl.constexpr,
        VC_S: tl.constexpr,  # value_cache strides (block, head, d, slot), elements
        X: tl.constexpr,
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
        o = slot - block * BLOCK_SIZE
        h64 = h.to(tl.int64)
        d64 = offs_d.to(tl.int64)
        kc_row = block * KC_B + o * KC_S  # int64
        kc_col = (d64 // X) * KC_G + (d64 % X) * KC_X
        kc_off = kc_row[:, None, None] + (h64 * KC_H)[None, :, None] + kc_col[None, None, :]
        vc_row = block * VC_B + o * VC_S
        vc_off = vc_row[:, None, None] + (h64 * VC_H)[None, :, None] + (d64 * VC_D)[None, None, :]
        store_quantized(key_cache_ptr, kc_off, store_mask, k, km, ks2, ky, QUANT, STEPS)
        store_quantized(value_cache_ptr, vc_off, store_mask, v, vm, vs2, vy, QUANT, STEPS)


_QUANT = {CacheDType.FP8_E4M3: _E4M3, CacheDType.FP8_E5M2: _E5M2}


def run(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, cache_dtype: CacheDType, k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None, *, tuning: TritonTuning = TUNING) -> None:
    """Launch the kernel on PyTorch's current stream; arguments as validated by the public op."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    t_pad, num_heads, head_size = key.shape
    num_blocks, _, _, block_size, x = key_cache.shape
    quant = _QUANT.get(cache_dtype, _COPY)
    block_t, block_h, block_d, num_warps, grid, evict = tiling(
        num_tokens, num_heads, head_size, key.element_size(), quant != _COPY, tuning)
    k_per_head = quant != _COPY and scale_is_per_head(k_scale)
    v_per_head = quant != _COPY and scale_is_per_head(v_scale)
    ks, vs = key_cache.stride(), value_cache.stride()
    programs = grid[0] * grid[1]
    pdl, trigger = triton_support.pdl_launch(key.device, programs, tuning.pdl_max_programs,
                                             tuning.pdl_trigger_max_programs)
    # A stride along a dim of size 1 never multiplies a nonzero index: 0 there, so that it does
    # not compile another variant.
    one = block_size > 1
    _legacy_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, num_tokens,
        KEY_STRIDE=key.stride(0) if t_pad > 1 else 0,
        VALUE_STRIDE=value.stride(0) if t_pad > 1 else 0,
        KC_B=ks[0] if num_blocks > 1 else 0, KC_H=ks[1] if num_heads > 1 else 0,
        KC_G=ks[2] if head_size > x else 0, KC_S=ks[3] if one else 0, KC_X=ks[4] if x > 1 else 0,
        VC_B=vs[0] if num_blocks > 1 else 0, VC_H=vs[1] if num_heads > 1 else 0,
        VC_D=vs[2] if head_size > 1 else 0, VC_S=vs[3] if one else 0, X=x,
        NUM_SLOTS=num_blocks * block_size, NUM_HEADS=num_heads, HEAD_SIZE=head_size,
        BLOCK_SIZE=block_size, QUANT=quant, K_PER_HEAD=k_per_head, V_PER_HEAD=v_per_head,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, LOAD_EVICT=evict, PDL=pdl,
        PDL_TRIGGER=trigger, num_warps=num_warps, launch_pdl=pdl,
    )
