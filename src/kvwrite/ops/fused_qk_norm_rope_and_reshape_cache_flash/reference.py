"""The plain-PyTorch implementation of fused_qk_norm_rope_and_reshape_cache_flash: the reference
oracle (docs/ops/fused_qk_norm_rope.md).

Literally the unfused sequence: fused_qk_norm_rope's reference, then reshape_and_cache_flash's
reference on the key heads as rounded to qkv's dtype and the value heads, with the slots of
out-of-range positions masked to -1; an fp8 query_out is the cache write's fp8 rule with
q_scale. Not graph-safe (the cache write's masking syncs with the host).
"""

from __future__ import annotations

import torch

from ...dtypes import CacheDType, quantize
from ..fused_qk_norm_rope.reference import norm_rope
from ..reshape_and_cache_flash import reference as cache_write
from ..rotary_embedding.reference import store_rotated
from .op import QUERY_FP8

__all__ = ["available", "unsupported", "run"]


def available(device: torch.device) -> str | None:
    return None


def unsupported(qkv, q_weight, k_weight, cos_sin_cache, is_neox, key_cache, cache_dtype,
                query_out) -> str | None:
    return None


def run(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, eps: float,
        q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
        cos_sin_cache: torch.Tensor, is_neox: bool, position_ids: torch.Tensor,
        weight_offset: float, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, cache_dtype: CacheDType, k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None, rotate_key_in_place: bool,
        query_out: torch.Tensor | None, q_scale: torch.Tensor | None) -> None:
    hq, hk = num_heads_q, num_heads_k
    out, valid = norm_rope(qkv, hq, hk, eps, q_weight, k_weight, cos_sin_cache, is_neox,
                           position_ids, weight_offset)
    rq, rk = out[:, :hq], out[:, hq:]
    key = qkv[:, hq:hq + hk]
    if query_out is None:
        store_rotated(qkv[:, :hq], rq, valid)
    elif query_out.dtype in QUERY_FP8:
        codes = quantize(rq, QUERY_FP8[query_out.dtype], q_scale, torch.uint8)
        store_rotated(query_out.view(torch.uint8), codes, valid)
    else:
        store_rotated(query_out, rq, valid)
    rk = torch.where(valid[:, None, None], rk, key[:rk.shape[0]])
    if rotate_key_in_place:
        key[:rk.shape[0]].copy_(rk)
    num_tokens = slot_mapping.numel()
    slots = torch.where(valid[:num_tokens], slot_mapping, -1)
    cache_write.run(rk, qkv[:, hq + hk:], key_cache, value_cache, slots, cache_dtype, k_scale,
                    v_scale)
