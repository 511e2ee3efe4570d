"""fused_qk_norm_rope_and_reshape_cache_flash: the public op, its validation and its
torch.compile custom op (docs/ops/fused_qk_norm_rope.md)."""

from __future__ import annotations

import torch

from ... import registry
from ...dtypes import FLOAT8_FORMAT
from ...validation import check_at_most, check_mutation_safe, require_same_device, require_tensor
from ...validation import shape_str as _shape
from ..fused_qk_norm_rope.op import validate_norm
from ..reshape_and_cache_flash.op import validate as validate_cache_write

__all__ = ["OP", "fused_qk_norm_rope_and_reshape_cache_flash", "validate", "QUERY_FP8"]

OP = "fused_qk_norm_rope_and_reshape_cache_flash"

# The fp8 query_out dtypes and their format.
QUERY_FP8 = FLOAT8_FORMAT  # a float8 query_out's format


def _query_out(query_out, qkv: torch.Tensor, view: torch.Tensor, num_heads_q: int,
               head_dim: int) -> torch.Tensor:
    """``query_out`` as a ``[T_pad, Hq, D]`` view, checked against qkv."""
    require_tensor("query_out", query_out)
    rows = view.shape[0]
    if query_out.dim() == 2:
        if query_out.shape != (rows, num_heads_q * head_dim):
            raise ValueError(
                f"query_out: expected [qkv.shape[0], num_heads_q * head_dim] = [{rows}, "
                f"{num_heads_q * head_dim}] or [{rows}, {num_heads_q}, {head_dim}], got shape "
                f"{_shape(query_out)}")
        if query_out.stride(1) != 1:
            raise ValueError(f"query_out: expected a unit stride in dim 1, got strides "
                             f"{tuple(query_out.stride())}")
        qo = query_out.unflatten(1, (num_heads_q, head_dim))
    elif query_out.dim() == 3:
        if query_out.shape != (rows, num_heads_q, head_dim):
            raise ValueError(
                f"query_out: expected [qkv.shape[0], num_heads_q, head_dim] = [{rows}, "
                f"{num_heads_q}, {head_dim}], got shape {_shape(query_out)}")
        if query_out.stride(2) != 1 or num_heads_q > 1 and query_out.stride(1) != head_dim:
            raise ValueError(
                f"query_out: expected dense heads (stride(2) == 1, stride(1) == head_dim = "
                f"{head_dim}), got strides {tuple(query_out.stride())}")
        qo = query_out
    else:
        raise ValueError(f"query_out: expected 2 or 3 dims, got shape {_shape(query_out)}")
    if query_out.dtype != qkv.dtype and query_out.dtype not in QUERY_FP8:
        raise ValueError(f"query_out: expected the dtype of qkv ({qkv.dtype}), float8_e4m3fn or "
                         f"float8_e5m2, got {query_out.dtype}")
    require_same_device(qkv.device, "qkv", (("query_out", query_out),))
    return qo


def _q_scale(q_scale, query_out: torch.Tensor, num_heads_q: int, device) -> None:
    if q_scale is None:
        raise ValueError(f"q_scale: an fp8 query_out ({query_out.dtype}) needs a float32 scale "
                         f"tensor of 1 or num_heads_q = {num_heads_q} elements, got None")
    require_tensor("q_scale", q_scale)
    if q_scale.dtype != torch.float32:
        raise ValueError(f"q_scale: expected dtype float32, got {q_scale.dtype}")
    if q_scale.numel() not in (1, num_heads_q):
        raise ValueError(f"q_scale: expected 1 (per tensor) or num_heads_q = {num_heads_q} (per "
                         f"head) elements, got {q_scale.numel()}")
    if q_scale.device != device:
        raise ValueError(f"q_scale: expected device {device} (that of qkv), got "
                         f"{q_scale.device}")
    if q_scale.numel() > 1 and not q_scale.is_contiguous():
        raise ValueError(f"q_scale: expected a contiguous tensor, got strides "
                         f"{tuple(q_scale.stride())}")


def validate(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight,
             cos_sin_cache, is_neox, position_ids, key_cache, value_cache, slot_mapping, k_scale,
             v_scale, kv_cache_dtype="auto", weight_offset=0.0, rotate_key_in_place=True,
             query_out=None, q_scale=None):
    """Check every argument of :func:`fused_qk_norm_rope_and_reshape_cache_flash`.

    Returns ``(qkv view [T_pad, Hq+Hk+Hv, D], eps, weight_offset, cache_dtype, query_out view
    [T_pad, Hq, D] or None, q_scale or None)`` (q_scale None unless query_out is fp8). The cache
    arguments are checked as reshape_and_cache_flash checks them, with the key and value heads
    of qkv as its key and value. Raises TypeError/ValueError naming the argument, before
    anything is written.
    """
    view, eps, weight_offset = validate_norm(
        qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight,
        cos_sin_cache, is_neox, position_ids, -1, weight_offset)
    if not isinstance(rotate_key_in_place, bool):
        raise TypeError(
            f"rotate_key_in_place: expected a bool, got {type(rotate_key_in_place).__name__}")
    if num_heads_v != num_heads_k:
        raise ValueError(f"num_heads_v: expected num_heads_k = {num_heads_k} (every key head "
                         f"has its value head in the cache), got {num_heads_v}")
    require_tensor("key_cache", key_cache)
    if key_cache.dim() != 4 or key_cache.shape[2] != num_heads_k:
        raise ValueError(
            f"key_cache: expected [num_blocks, block_size, num_heads_k = {num_heads_k}, "
            f"head_dim = {head_dim}], got shape {_shape(key_cache)}")
    require_tensor("value_cache", value_cache)
    hq, hk = num_heads_q, num_heads_k
    qo = None
    qs = None
    if query_out is not None:
        qo = _query_out(query_out, qkv, view, hq, head_dim)
        if query_out.dtype in QUERY_FP8:
            _q_scale(q_scale, query_out, hq, qkv.device)
            qs = q_scale
    # What this op writes besides the caches (qkv where it is written, query_out) against each
    # other, against what it reads, and against the caches; then the caches against the key and
    # value heads, the slots and the scales, as reshape_and_cache_flash checks them.
    qkv_written = query_out is None or rotate_key_in_place
    written = [("qkv", qkv)] if qkv_written else []
    read = [("position_ids", position_ids), ("cos_sin_cache", cos_sin_cache),
            ("q_weight", q_weight), ("k_weight", k_weight), ("q_scale", qs)]
    if not qkv_written:
        read.append(("qkv", qkv))
    if query_out is not None:
        written.append(("query_out", query_out))
    check_mutation_safe(outputs=written,
                        inputs=(*read, ("key_cache", key_cache), ("value_cache", value_cache)))
    k, v = view[:, hq:hq + hk], view[:, hq + hk:]
    cache_dtype = validate_cache_write(k, v, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                       k_scale, v_scale, free_head_stride=True)
    check_at_most("slot_mapping", slot_mapping, position_ids.numel(), "position_ids.numel()")
    return view, eps, weight_offset, cache_dtype, qo, qs


@registry.custom_op(OP, mutates=("qkv", "key_cache", "value_cache", "query_out"))
def fused_qk_norm_rope_and_reshape_cache_flash(
        qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int, head_dim: int,
        eps: float, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
        cos_sin_cache: torch.Tensor, is_neox: bool, position_ids: torch.Tensor,
        key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, kv_cache_dtype: str = "auto",
        *, weight_offset: float = 0.0, rotate_key_in_place: bool = True,
        query_out: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
        implementation: str | None = None) -> None:
    """QK-norm and RoPE of qkv's query and key heads, then the key and value heads written into
    the paged caches, in one call; the contract is docs/ops/fused_qk_norm_rope.md.

    Exactly the effect of ``fused_qk_norm_rope(qkv, ...)`` followed by
    ``reshape_and_cache_flash(key heads, value heads, key_cache, value_cache, slot_mapping,
    kv_cache_dtype, k_scale, v_scale)``, byte for byte (fp8 caches too: the cache holds Q of the
    key as rounded to qkv's dtype), except that a token whose position is outside
    ``[0, max_position)`` is left entirely alone: its qkv rows, query_out rows and cache rows (K
    and V) keep their bytes. Needs ``num_heads_v == num_heads_k`` == the caches' H;
    ``slot_mapping.numel() <= position_ids.numel()``.

    ``rotate_key_in_place=False`` leaves qkv's key heads unchanged (the cache holds the only
    normalized copy). ``query_out`` (``[T_pad, Hq, D]`` or ``[T_pad, Hq*D]``, memory apart from
    qkv's elements) receives the query instead of qkv: in qkv's dtype, or fp8 (float8_e4m3fn /
    float8_e5m2) as ``fp8(float32(query as rounded to qkv's dtype) / q_scale[h])`` with
    ``q_scale`` float32 of 1 or Hq elements, read on the device. ``implementation`` names a
    registered one; None picks the preferred one.
    """
    view, eps, weight_offset, cache_dtype, qo, qs = validate(
        qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight,
        cos_sin_cache, is_neox, position_ids, key_cache, value_cache, slot_mapping, k_scale,
        v_scale, kv_cache_dtype, weight_offset, rotate_key_in_place, query_out, q_scale)
    info = registry.select(OP, (view, q_weight, k_weight, cos_sin_cache, is_neox, key_cache,
                                cache_dtype, qo), implementation)
    if position_ids.numel() == 0:
        return
    if not cache_dtype.is_fp8:
        k_scale = v_scale = None
    info.run(view, num_heads_q, num_heads_k, eps, q_weight, k_weight, cos_sin_cache, is_neox,
             position_ids, weight_offset, key_cache, value_cache, slot_mapping, cache_dtype,
             k_scale, v_scale, rotate_key_in_place, qo, qs)
