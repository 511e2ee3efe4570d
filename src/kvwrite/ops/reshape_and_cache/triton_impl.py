"""The Triton implementation of reshape_and_cache: one kernel for every cache dtype, scale shape
and cache strides.

One program writes a tile ``[BLOCK_T tokens, BLOCK_H heads, BLOCK_D]`` of K and the same tile of
V with reshape_and_cache_flash's kernel and tiling (``kvwrite.kernels.triton_kv``, its
``LEGACY`` stores): it reads each token's slot once, loads both input tiles (masked by the token
and head bounds only, so the loads do not wait for the slot), converts them (``kvwrite.kernels.triton_fp8.store_quantized``: a copy,
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

from ...dtypes import CacheDType
from ...kernels import triton_support
from ...kernels.triton_fp8 import IMPORT_ERROR as _IMPORT_ERROR
from ...kernels.triton_fp8 import triton
from ...kernels.triton_kv import TritonTuning, interpreter_reason, kv_write_kernel, write_kv

__all__ = ["TritonTuning", "TUNING", "available", "unsupported", "run"]

# The tiles and launch shapes of reshape_and_cache_flash's kernel: the same loads and conversions
# per program; only the stores' addresses differ.
TUNING = TritonTuning()


def available(device: torch.device) -> str | None:
    return triton_support.available(device, triton, lambda: kv_write_kernel, _IMPORT_ERROR)


def unsupported(key: torch.Tensor, key_cache: torch.Tensor, cache_dtype: CacheDType,
                k_scale: torch.Tensor | None) -> str | None:
    return interpreter_reason(key, cache_dtype)


def run(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, cache_dtype: CacheDType, k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None, *, tuning: TritonTuning = TUNING) -> None:
    """Launch the kernel on PyTorch's current stream; arguments as validated by the public op."""
    num_blocks, num_heads, _, block_size, x = key_cache.shape
    head_size = key.shape[2]
    ks, vs = key_cache.stride(), value_cache.stride()
    # A stride along a dim of size 1 never multiplies a nonzero index: 0 there, so that it does
    # not compile another variant.
    one = block_size > 1
    cache = (ks[0] if num_blocks > 1 else 0, ks[1] if num_heads > 1 else 0,
             ks[2] if head_size > x else 0, ks[3] if one else 0, ks[4] if x > 1 else 0,
             vs[0] if num_blocks > 1 else 0, vs[1] if num_heads > 1 else 0,
             vs[2] if head_size > 1 else 0, vs[3] if one else 0, x)
    write_kv(key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale, v_scale,
             tuning, block_size, True, cache)
