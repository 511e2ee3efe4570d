"""``vllm``: vLLM's CUDA kernel, ``vllm._custom_ops.reshape_and_cache_flash(key, value, key_cache,
value_cache, slot_mapping, kv_cache_dtype: str, k_scale, v_scale)``, offered where vLLM imports.

vLLM names the cache mode by string: "auto" (a copy; the cache has the input's dtype) or
"fp8"/"fp8_e4m3"/"fp8_e5m2" (uint8 storage); it reads one scale per tensor and int64 slots.
"""

from __future__ import annotations

import functools
import importlib

import torch

from ....dtypes import CacheDType, scale_is_per_head

MODULE = "vllm._custom_ops"


@functools.cache
def _load():
    """(the function, None) or (None, why not)."""
    try:
        return importlib.import_module(MODULE).reshape_and_cache_flash, None
    except Exception as e:  # vLLM's import can fail in many ways besides ImportError
        return None, f"vllm is not installed or does not import ({MODULE}: {type(e).__name__}: {e})"


def vllm_cache_dtype(cache_dtype: CacheDType, input_dtype: torch.dtype) -> str | None:
    """vLLM's ``kv_cache_dtype`` string for this mode, or None where vLLM has none."""
    if cache_dtype.is_fp8:
        return cache_dtype.value
    if cache_dtype.element_dtype(input_dtype) == input_dtype:
        return "auto"
    return None


def common_unsupported(key, key_cache, cache_dtype, k_scale, v_scale, who: str) -> str | None:
    if vllm_cache_dtype(cache_dtype, key.dtype) is None:
        return (f"{who} converts only to fp8 ('auto' copies); kv_cache_dtype "
                f"{cache_dtype.value} with {str(key.dtype).removeprefix('torch.')} input has no "
                f"vLLM spelling")
    if cache_dtype.is_fp8:
        # Each scale's kind from its own tensor: either may be per head without the other.
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale_is_per_head(scale):
                return (f"{who} reads one scale per tensor; per-head scales ({name}: "
                        f"{scale.numel()}) are not supported")
    return None


def available(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"vllm runs on CUDA devices, got {device}"
    return _load()[1]


def unsupported(key, key_cache, cache_dtype, k_scale, v_scale) -> str | None:
    return common_unsupported(key, key_cache, cache_dtype, k_scale, v_scale,
                              "vLLM's reshape_and_cache_flash")


def run(key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale, v_scale) -> None:
    call_vllm(_load()[0], key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale,
              v_scale)


def call_vllm(fn, key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale,
              v_scale) -> None:
    """Call one of vLLM's two kernels (the same argument order) on kvwrite's arguments."""
    if k_scale is None:  # vLLM takes scale tensors in every mode
        k_scale = v_scale = _ones(key.device)
    fn(key, value, key_cache, value_cache, slot_mapping, vllm_cache_dtype(cache_dtype, key.dtype),
       k_scale, v_scale)


@functools.cache
def _ones(device: torch.device) -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device=device)
