"""``vllm-triton``: vLLM's Triton twin of reshape_and_cache_flash,
``triton_reshape_and_cache_flash`` (``vllm.v1.attention.ops.triton_reshape_and_cache_flash``, or
``vllm.attention.ops.triton_reshape_and_cache_flash`` in older vLLM), offered where vLLM imports.

What it addresses, from its source: a 4-D cache is read as ``block * stride(0) + offset *
stride(1) + h * D + d``, so heads must be dense inside a slot (NHD with head stride D: not HND,
not packed); it loads ``k_scale[0]`` (per tensor); it stores fp8 as the platform's fp8 type
(e4m3 on CUDA), so an e5m2 cache would receive e4m3 bits; its fp8 division is Triton's default
(approximate) one, which the check before timing exposes where it differs.
"""

from __future__ import annotations

import functools
import importlib

import torch

from .vllm_cuda import call_vllm, common_unsupported

MODULES = ("vllm.v1.attention.ops.triton_reshape_and_cache_flash",
           "vllm.attention.ops.triton_reshape_and_cache_flash")


@functools.cache
def _load():
    """(the function, None) or (None, why not)."""
    errors = []
    for name in MODULES:
        try:
            return importlib.import_module(name).triton_reshape_and_cache_flash, None
        except Exception as e:  # vLLM's import can fail in many ways besides ImportError
            errors.append(f"{name}: {type(e).__name__}: {e}")
    return None, "vllm is not installed or does not import (" + "; ".join(errors) + ")"


def available(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"vllm-triton runs on CUDA devices, got {device}"
    return _load()[1]


def unsupported(key, key_cache, cache_dtype, k_scale, v_scale) -> str | None:
    reason = common_unsupported(key, key_cache, cache_dtype, k_scale, v_scale,
                                "vLLM's Triton kernel")
    if reason is not None:
        return reason
    h, d = key.shape[1], key.shape[2]
    if h > 1 and key_cache.stride(2) != d:
        return (f"vLLM's Triton kernel addresses heads as dense inside a slot (NHD, head stride "
                f"{d}); this cache has strides {tuple(key_cache.stride())} (HND or packed)")
    if cache_dtype.value == "fp8_e5m2":
        return "vLLM's Triton kernel stores fp8 as e4m3 on CUDA: an e5m2 cache would get e4m3 bits"
    return None


def run(key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale, v_scale) -> None:
    call_vllm(_load()[0], key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale,
              v_scale)
