"""The plain-PyTorch implementation of fused_rope_and_reshape_cache_flash: the reference oracle.

Literally the unfused pair: rotary_embedding's reference, then reshape_and_cache_flash's
reference with the slots of out-of-range positions masked to -1. Not graph-safe (the cache
write's masking syncs with the host).
"""

from __future__ import annotations

import torch

from ...dtypes import CacheDType
from ..reshape_and_cache_flash import reference as cache_write
from ..rotary_embedding.reference import rotate, store_rotated

__all__ = ["available", "unsupported", "run"]


def available(device: torch.device) -> str | None:
    return None


def unsupported(query, key, key_cache, cache_dtype, cos_sin_cache, is_neox) -> str | None:
    return None


def run(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
        cos_sin_cache: torch.Tensor, is_neox: bool, key_cache: torch.Tensor,
        value_cache: torch.Tensor, slot_mapping: torch.Tensor, cache_dtype: CacheDType,
        k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, rotate_key_in_place: bool,
        query_out: torch.Tensor | None) -> None:
    rq, valid = rotate(query, positions, cos_sin_cache, is_neox)
    rk, _ = rotate(key, positions, cos_sin_cache, is_neox)
    store_rotated(query if query_out is None else query_out, rq, valid)
    rk = torch.where(valid[:, None, None], rk, key[:rk.shape[0]])
    if rotate_key_in_place:
        key[:rk.shape[0]].copy_(rk)
    num_tokens = slot_mapping.numel()
    slots = torch.where(valid[:num_tokens], slot_mapping, -1)
    cache_write.run(rk, value, key_cache, value_cache, slots, cache_dtype, k_scale, v_scale)
