"""rotary_embedding: the public op, its validation (shared with the fused op), its torch.compile
custom op, and the host-side position check (docs/ops/rotary_embedding.md)."""

from __future__ import annotations

import torch

from ... import registry
from ...dtypes import INPUT_DTYPES
from ...validation import (
    check_at_most,
    check_in_range,
    check_like,
    check_mutation_safe,
    check_token_indices,
    require_same_device,
    require_tensor,
)
from ...validation import shape_str as _shape

__all__ = ["OP", "rotary_embedding", "validate", "as_heads", "head_stride", "check_rope_args",
           "check_positions"]

OP = "rotary_embedding"


def as_heads(name: str, t, head_size: int) -> torch.Tensor:
    """``t`` (``[T_pad, H, D]`` or ``[T_pad, H*D]``) as a ``[T_pad, H, D]`` view; checks its rank,
    dtype and strides: a unit-stride last dim, any token stride, and in the 3-D form any head
    stride (heads of ``[..., :D]`` slices of wider rows lie more than ``D`` apart); the 2-D form
    has dense heads. Elements that overlap are the caller's check (check_mutation_safe)."""
    require_tensor(name, t)
    if t.dim() == 3:
        if t.shape[2] != head_size:
            raise ValueError(f"{name}: expected head size {head_size} in dim 2, got shape {_shape(t)}")
        v = t
    elif t.dim() == 2:
        if t.shape[1] % head_size != 0:
            raise ValueError(
                f"{name}: expected [num_tokens, num_heads * {head_size}], got shape {_shape(t)}")
        if t.shape[1] == 0:
            raise ValueError(f"{name}: expected at least one head, got shape {_shape(t)}")
        v = t.unflatten(1, (t.shape[1] // head_size, head_size))
    else:
        raise ValueError(
            f"{name}: expected 2 dims [num_tokens, num_heads * head_size] or 3 dims "
            f"[num_tokens, num_heads, head_size], got shape {_shape(t)}")
    if v.shape[1] == 0:
        raise ValueError(f"{name}: expected at least one head, got shape {_shape(t)}")
    if t.dtype not in INPUT_DTYPES:
        raise ValueError(f"{name}: expected dtype float16, bfloat16 or float32, got {t.dtype}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        form = "head dim" if t.dim() == 3 else "row (the 2-D form has dense heads)"
        raise ValueError(
            f"{name}: expected a unit-stride {form}, got strides {tuple(t.stride())} for shape "
            f"{_shape(t)}")
    return v


def head_stride(t: torch.Tensor) -> int:
    """The head stride (elements) of a ``[T_pad, H, D]`` view from :func:`as_heads`, as the
    kernels take it: ``stride(1)``, or ``D`` for a single head (whose stride is never used), so
    that every call with dense heads passes ``D`` and takes the same build."""
    return t.stride(1) if t.shape[1] > 1 else t.shape[2]


def check_rope_args(positions, query: torch.Tensor, cos_sin_cache, head_size: int, *,
                    positions_name: str = "positions", query_name: str = "query") -> None:
    """Checks ``positions`` and ``cos_sin_cache`` against the (already checked) ``[T_pad, Hq, D]``
    query view; messages name them ``positions_name`` and ``query_name`` (an op's own names)."""
    pn = positions_name
    require_tensor(pn, positions)
    require_tensor("cos_sin_cache", cos_sin_cache)
    check_token_indices(pn, positions, query.shape[0], f"{query_name}.shape[0]")
    if cos_sin_cache.dim() != 2:
        raise ValueError(
            f"cos_sin_cache: expected 2 dims [max_position, rot_dim], got shape {_shape(cos_sin_cache)}")
    if cos_sin_cache.dtype not in INPUT_DTYPES:
        raise ValueError(
            f"cos_sin_cache: expected dtype float32, float16 or bfloat16, got {cos_sin_cache.dtype}")
    max_position, rot_dim = cos_sin_cache.shape
    if rot_dim == 0 or rot_dim % 2 or rot_dim > head_size:
        raise ValueError(
            f"cos_sin_cache: expected an even rot_dim in [2, head_size = {head_size}] in dim 1, got "
            f"shape {_shape(cos_sin_cache)}")
    if max_position == 0:
        raise ValueError(f"cos_sin_cache: expected at least one position (row), got shape "
                         f"{_shape(cos_sin_cache)}")
    if not cos_sin_cache.is_contiguous():
        raise ValueError(
            f"cos_sin_cache: expected a contiguous tensor, got strides {tuple(cos_sin_cache.stride())}")
    require_same_device(query.device, query_name, ((pn, positions),
                                                   ("cos_sin_cache", cos_sin_cache)))


def _check_head_size(query, head_size: int) -> None:
    """``head_size`` against query's shape (the first tensor it sizes): a mismatch there is
    head_size's error; key then is checked against head_size (a mismatch is key's)."""
    if not isinstance(query, torch.Tensor):
        return  # as_heads names query
    if query.dim() == 3 and query.shape[2] != head_size:
        raise ValueError(f"head_size: expected query's head size {query.shape[2]} (dim 2 of "
                         f"{_shape(query)}), got {head_size}")
    if query.dim() == 2 and query.shape[1] % head_size != 0:
        raise ValueError(f"head_size: expected a divisor of query's row width {query.shape[1]} "
                         f"(shape {_shape(query)}), got {head_size}")


def validate(positions, query, key, head_size, cos_sin_cache, is_neox
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Check every argument of :func:`rotary_embedding`; return ``[T_pad, H, D]`` views of query
    and key (None when key is None). Raises TypeError/ValueError naming the argument."""
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size < 1:
        raise TypeError(f"head_size: expected a positive int, got {head_size!r}")
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox: expected a bool, got {type(is_neox).__name__}")
    _check_head_size(query, head_size)
    q = as_heads("query", query, head_size)
    k = None
    if key is not None:
        k = as_heads("key", key, head_size)
        check_like("key", key, "query", query, "dtype")
        require_same_device(query.device, "query", (("key", key),))
    check_rope_args(positions, q, cos_sin_cache, head_size)
    if k is not None:
        check_at_most("positions", positions, k.shape[0], "key.shape[0]")
    check_mutation_safe(outputs=(("query", query), ("key", key)) if key is not None
                        else (("query", query),),
                        inputs=(("positions", positions), ("cos_sin_cache", cos_sin_cache)))
    return q, k


@registry.custom_op(OP, mutates=("query", "key"))
def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool, *,
                     implementation: str | None = None) -> None:
    """Rotate ``query`` (and ``key``) rows ``t < T_rot = positions.numel()`` in place (RoPE).

    Shapes: ``query`` ``[T_pad, Hq, D]`` or ``[T_pad, Hq*D]``, ``key`` ``[T_pad, H, D]`` or
    ``[T_pad, H*D]`` or None (float16/bfloat16/float32, one dtype; unit-stride last dim, any token
    stride, and in the 3-D form any head stride: padded heads; the 2-D form has dense heads);
    ``positions`` ``[T_rot]`` int64 or int32; ``cos_sin_cache`` ``[max_position, rot_dim]``
    (contiguous, float32/float16/bfloat16): cos in columns ``[0, rot_dim/2)``, sin in
    ``[rot_dim/2, rot_dim)``; rot_dim even and ``<= D``; dims ``>= rot_dim`` pass through.

    ``is_neox``: element ``i`` pairs with ``i + rot_dim/2``; else (GPT-J) ``2i`` with ``2i+1``.
    Pair ``i`` of token ``t`` uses ``c = cos[p, i]``, ``s = sin[p, i]``, ``p = positions[t]``:
    ``x' = RN(RN(x*c) - RN(y*s))``, ``y' = RN(RN(y*c) + RN(x*s))`` in float32 (no fused
    multiply-add), then rounded to nearest even in the tensor's dtype. A token whose position is
    outside ``[0, max_position)`` is left as it was (and the table is never read outside).
    """
    q, k = validate(positions, query, key, head_size, cos_sin_cache, is_neox)
    info = registry.select(OP, (q, k, cos_sin_cache, is_neox), implementation)
    if positions.numel() == 0:
        return
    info.run(positions, q, k, cos_sin_cache, is_neox)



def check_positions(positions: torch.Tensor, max_position: int) -> None:
    """Raise ValueError naming every entry of ``positions`` outside ``[0, max_position)``.

    Reads the tensor on the host (a sync): for debugging and tests; the ops skip such tokens.
    """
    require_tensor("positions", positions)
    if positions.dim() != 1:
        raise ValueError(f"positions: expected 1 dim, got shape {_shape(positions)}")
    if positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions: expected dtype int64 or int32, got {positions.dtype}")
    check_in_range("positions", positions, (positions < 0) | (positions >= max_position),
                   f"expected values in [0, max_position = {max_position})", at="indices")
