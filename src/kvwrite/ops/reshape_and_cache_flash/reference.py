"""The plain-PyTorch implementation: the reference oracle and the baseline a user would write.

Works on CPU and CUDA tensors, on any strides (the caches are indexed logically by block and
offset). Not graph-safe: masking out padding and out-of-range slots syncs with the host.
"""

from __future__ import annotations

import torch

from ...dtypes import CacheDType, quantize
from ...layouts import written_slots


def available(device: torch.device) -> str | None:
    return None


def unsupported(key, key_cache, cache_dtype, k_scale, v_scale) -> str | None:
    return None


def run(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, cache_dtype: CacheDType, k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None) -> None:
    num_blocks, block_size = key_cache.shape[:2]
    tokens, blocks, offsets = written_slots(slot_mapping, num_blocks, block_size)
    for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        rows = quantize(src[tokens], cache_dtype, scale, cache.dtype)
        cache[blocks, offsets] = rows
