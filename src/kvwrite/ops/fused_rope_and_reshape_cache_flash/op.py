"""fused_rope_and_reshape_cache_flash: the public op, its validation and its torch.compile custom
op (docs/ops/fused_rope_and_reshape_cache_flash.md)."""

from __future__ import annotations

import torch

from ... import registry
from ...validation import (
    check_at_most,
    check_like,
    check_mutation_safe,
    require_same_device,
    require_tensor,
)
from ...validation import shape_str as _shape
from ..reshape_and_cache_flash.op import validate as validate_cache_write
from ..rotary_embedding.op import as_heads, check_rope_args

__all__ = ["OP", "fused_rope_and_reshape_cache_flash", "validate"]

OP = "fused_rope_and_reshape_cache_flash"


def _head_size(key, key_cache) -> int:
    require_tensor("key", key)
    if key.dim() == 3:
        return key.shape[2]
    require_tensor("key_cache", key_cache)
    if key_cache.dim() != 4:
        raise ValueError(
            f"key_cache: expected 4 dims [num_blocks, block_size, num_heads, head_size], got shape "
            f"{_shape(key_cache)}")
    return key_cache.shape[3]


def validate(query, key, value, positions, cos_sin_cache, is_neox, key_cache, value_cache,
             slot_mapping, k_scale, v_scale, kv_cache_dtype, rotate_key_in_place=True,
             query_out=None):
    """Check every argument of :func:`fused_rope_and_reshape_cache_flash`.

    Returns ``(q, k, v, query_out, cache_dtype)`` with q/k/v/query_out as ``[T_pad, H, D]`` views
    (query_out None when not given). The cache arguments are checked exactly as
    reshape_and_cache_flash checks them. Raises TypeError/ValueError naming the argument.
    """
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox: expected a bool, got {type(is_neox).__name__}")
    if not isinstance(rotate_key_in_place, bool):
        raise TypeError(
            f"rotate_key_in_place: expected a bool, got {type(rotate_key_in_place).__name__}")
    head_size = _head_size(key, key_cache)
    k = as_heads("key", key, head_size)
    v = as_heads("value", value, head_size)
    q = as_heads("query", query, head_size)
    check_like("query", query, "key", key, "dtype")
    require_same_device(key.device, "key", (("query", query),))
    # key and value take any head stride here (as_heads), unlike reshape_and_cache_flash's own.
    cache_dtype = validate_cache_write(k, v, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                       k_scale, v_scale, free_head_stride=True)
    check_rope_args(positions, q, cos_sin_cache, head_size)
    check_at_most("positions", positions, k.shape[0], "key.shape[0]")
    check_at_most("slot_mapping", slot_mapping, positions.numel(), "positions.numel()")
    qo = None
    if query_out is not None:
        qo = as_heads("query_out", query_out, head_size)
        if qo.shape != q.shape:
            raise ValueError(
                f"query_out: expected the shape of query {_shape(query)}, got {_shape(query_out)}")
        check_like("query_out", query_out, "query", query, "dtype")
        require_same_device(query.device, "query", (("query_out", query_out),))
    # The caches themselves, and against key, value, slots and scales, were checked with the
    # cache arguments; here what this op writes besides them (the rotated query, the key in
    # place) against each other, against what it reads, and against the caches (passed as the
    # other side of the pairs, so their own checks are not repeated). query_out may share an
    # allocation with query (a spare region of a fused qkv buffer): its elements may not.
    written = [("query_out", query_out) if query_out is not None else ("query", query)]
    read = [("positions", positions), ("cos_sin_cache", cos_sin_cache), ("value", value)]
    if query_out is not None:
        read.append(("query", query))
    (written if rotate_key_in_place else read).append(("key", key))
    check_mutation_safe(outputs=written,
                        inputs=(*read, ("key_cache", key_cache), ("value_cache", value_cache)))
    return q, k, v, qo, cache_dtype


@registry.custom_op(OP, mutates=("query", "key", "key_cache", "value_cache", "query_out"))
def fused_rope_and_reshape_cache_flash(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
        cos_sin_cache: torch.Tensor, is_neox: bool, key_cache: torch.Tensor,
        value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None, kv_cache_dtype: str = "auto", *,
        rotate_key_in_place: bool = True, query_out: torch.Tensor | None = None,
        implementation: str | None = None) -> None:
    """RoPE on query and key, then the key and value rows written into the paged caches.

    Exactly the effect of ``rotary_embedding(positions, query, key, D, cos_sin_cache, is_neox)``
    followed by ``reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
    kv_cache_dtype, k_scale, v_scale)``, byte for byte (fp8 caches too: the cache holds Q of the
    rotated key as rounded to key's dtype), except that a token whose position is outside
    ``[0, max_position)`` is left entirely alone: its query and key rows and its cache rows (K
    and V) keep their bytes.

    Shapes: ``query`` ``[T_pad, Hq, D]`` or ``[T_pad, Hq*D]``; ``key``, ``value`` ``[T_pad, H, D]``
    or ``[T_pad, H*D]`` (D from the caches for 2-D inputs; one dtype; unit-stride last dim, any
    token stride, and in the 3-D form any head stride, each tensor its own: padded heads; the
    2-D form has dense heads); ``positions`` ``[T_rot]``; ``slot_mapping`` ``[T]`` with ``T <= T_rot``; the rest as
    :func:`kvwrite.rotary_embedding` and :func:`kvwrite.reshape_and_cache_flash` say.

    ``rotate_key_in_place=False`` leaves ``key`` unchanged (the cache holds the only rotated copy);
    ``query_out`` (query's shape and dtype, other memory) receives the rotated query instead of
    ``query``. ``implementation`` names a registered one; None picks the preferred one.
    """
    q, k, v, qo, cache_dtype = validate(query, key, value, positions, cos_sin_cache, is_neox,
                                        key_cache, value_cache, slot_mapping, k_scale, v_scale,
                                        kv_cache_dtype, rotate_key_in_place, query_out)
    info = registry.select(OP, (q, k, key_cache, cache_dtype, cos_sin_cache, is_neox),
                           implementation)
    if positions.numel() == 0:
        return
    if not cache_dtype.is_fp8:
        k_scale = v_scale = None
    info.run(q, k, v, positions, cos_sin_cache, is_neox, key_cache, value_cache, slot_mapping,
             cache_dtype, k_scale, v_scale, rotate_key_in_place, qo)
