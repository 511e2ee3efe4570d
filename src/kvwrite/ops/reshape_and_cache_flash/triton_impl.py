"""The Triton implementation: one kernel for every layout, cache dtype and scale shape
(``kvwrite.kernels.triton_kv.kv_write_kernel``, shared with reshape_and_cache).

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
rounded to nearest even by ``fp8_bytes`` (the cast to ``float8e4nv`` / ``float8e5`` on sm_89 and
later, integer steps on older GPUs and under the interpreter: ``NATIVE``), stored bit for bit into
``uint8`` or float8 caches (a float8 one passed as its uint8 view).

On CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``), which rounds some float casts
differently from the GPU; :func:`unsupported` refuses those cases there
(``kvwrite.kernels.triton_support.interpreter_inexact``).
"""

from __future__ import annotations

import torch

from ...dtypes import CacheDType
from ...kernels import triton_support
from ...kernels.triton_fp8 import IMPORT_ERROR as _IMPORT_ERROR
from ...kernels.triton_fp8 import triton
from ...kernels.triton_kv import TUNING, TritonTuning, interpreter_reason, kv_write_kernel, write_kv
from ...kernels.triton_kv import tiling as _tiling  # noqa: F401  (tests read the tiling here)

__all__ = ["TritonTuning", "TUNING", "available", "unsupported", "run"]


def available(device: torch.device) -> str | None:
    return triton_support.available(device, triton, lambda: kv_write_kernel, _IMPORT_ERROR)


def unsupported(key: torch.Tensor, key_cache: torch.Tensor, cache_dtype: CacheDType,
                k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> str | None:
    return interpreter_reason(key, cache_dtype)


def run(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, cache_dtype: CacheDType, k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None, *, tuning: TritonTuning = TUNING) -> None:
    """Launch the kernel on PyTorch's current stream; arguments as validated by the public op."""
    num_blocks, block_size, num_heads, _ = key_cache.shape
    stride_b, stride_s, stride_h, _ = key_cache.stride()
    # A stride along a dim of size 1 never multiplies a nonzero index: 0 there, so that it does
    # not compile another variant.
    cache = (stride_b if num_blocks > 1 else 0, stride_s if block_size > 1 else 0,
             stride_h if num_heads > 1 else 0)
    write_kv(key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale, v_scale,
             tuning, block_size, False, cache)
