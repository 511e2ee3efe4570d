"""The plain-PyTorch implementation of reshape_and_cache: the reference oracle and the baseline a
user would write.

Works on CPU and CUDA tensors and on any cache strides: the rows are quantized by
``kvwrite.dtypes.quantize`` (the rule reshape_and_cache_flash's reference uses) and stored through
the caches' permuted views ``key_cache.permute(0, 3, 1, 2, 4)`` ``[nb, bs, H, D/x, x]`` and
``value_cache.permute(0, 3, 1, 2)`` ``[nb, bs, H, D]``, indexed by block and offset. Not
graph-safe: masking out padding and out-of-range slots syncs with the host.
"""

from __future__ import annotations

import torch

from ...dtypes import CacheDType, quantize
from ...layouts import written_slots


def available(device: torch.device) -> str | None:
    return None


def unsupported(key, key_cache, cache_dtype, k_scale) -> str | None:
    return None


def run(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, cache_dtype: CacheDType, k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None) -> None:
    num_blocks, num_heads, dx, block_size, x = key_cache.shape
    tokens, blocks, offsets = written_slots(slot_mapping, num_blocks, block_size)
    rows = quantize(key[tokens], cache_dtype, k_scale, key_cache.dtype)
    key_cache.permute(0, 3, 1, 2, 4)[blocks, offsets] = rows.reshape(-1, num_heads, dx, x)
    rows = quantize(value[tokens], cache_dtype, v_scale, value_cache.dtype)
    value_cache.permute(0, 3, 1, 2)[blocks, offsets] = rows
