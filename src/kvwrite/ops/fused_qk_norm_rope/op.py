"""fused_qk_norm_rope: the public op, its validation (shared with the fused cache-writing op) and
its torch.compile custom op (docs/ops/fused_qk_norm_rope.md)."""

from __future__ import annotations

import math

import numpy as np
import torch

from ... import registry
from ...dtypes import INPUT_DTYPES
from ...validation import check_mutation_safe, require_same_device, require_tensor
from ...validation import shape_str as _shape
from ..rotary_embedding.op import check_rope_args

__all__ = ["OP", "fused_qk_norm_rope", "validate", "validate_norm", "float32_value",
           "float32_bits", "MAX_HEAD_DIM"]

OP = "fused_qk_norm_rope"
MAX_HEAD_DIM = 512


def float32_value(x: float) -> float:
    """``float32(x)``, rounded to nearest even (±inf past the largest float32), as a Python float:
    the ε and weight offset every implementation uses."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def float32_bits(x: float) -> int:
    """The bits of ``float32(x)`` as an unsigned 32-bit int."""
    with np.errstate(over="ignore"):
        return int(np.array(x, dtype=np.float32).view(np.uint32))


def _require_int(name: str, x, low: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name}: expected a Python int, got {type(x).__name__}")
    if x < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {x}")
    return x


def _require_float(name: str, x, nonnegative: bool) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name}: expected a Python float (or int), got {type(x).__name__}")
    try:
        value = float(x)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value) or (nonnegative and value < 0):
        what = "a finite value >= 0" if nonnegative else "a finite value"
        raise ValueError(f"{name}: expected {what}, got {x!r}")
    return value


def validate_norm(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight,
                  cos_sin_cache, is_neox, position_ids, forced_token_heads_per_warp,
                  weight_offset) -> tuple[torch.Tensor, float, float]:
    """Check the arguments both QK-norm ops share; return ``(qkv as [T_pad, Hq+Hk+Hv, D], eps,
    weight_offset)`` (the two scalars as Python floats). qkv: 2-D ``[T_pad, (Hq+Hk+Hv)*D]`` with
    ``stride(1) == 1`` (dense heads), or 3-D with ``stride(2) == 1`` and any head stride
    (``stride(1)``); the token stride is free in both. Raises TypeError/ValueError naming the
    argument, before anything is written."""
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox: expected a bool, got {type(is_neox).__name__}")
    hq = _require_int("num_heads_q", num_heads_q, 1)
    hk = _require_int("num_heads_k", num_heads_k, 1)
    hv = _require_int("num_heads_v", num_heads_v, 0)
    d = _require_int("head_dim", head_dim, 2)
    if d % 2 or d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim: expected an even int in [2, {MAX_HEAD_DIM}], got {d}")
    eps = _require_float("eps", eps, True)
    weight_offset = _require_float("weight_offset", weight_offset, False)
    if isinstance(forced_token_heads_per_warp, bool) or not isinstance(
            forced_token_heads_per_warp, int):
        raise TypeError(f"forced_token_heads_per_warp: expected an int, got "
                        f"{type(forced_token_heads_per_warp).__name__}")

    require_tensor("qkv", qkv)
    if qkv.dtype not in INPUT_DTYPES:
        raise ValueError(f"qkv: expected dtype float16, bfloat16 or float32, got {qkv.dtype}")
    heads = hq + hk + hv
    if qkv.dim() == 2:
        if qkv.shape[1] != heads * d:
            raise ValueError(
                f"qkv: expected [num_tokens, (num_heads_q + num_heads_k + num_heads_v) * "
                f"head_dim] = [num_tokens, ({hq} + {hk} + {hv}) * {d} = {heads * d}], got shape "
                f"{_shape(qkv)}")
        if qkv.stride(1) != 1:
            raise ValueError(f"qkv: expected a unit stride in dim 1, got strides "
                             f"{tuple(qkv.stride())}")
        view = qkv.unflatten(1, (heads, d))
    elif qkv.dim() == 3:
        if qkv.shape[1:] != (heads, d):
            raise ValueError(
                f"qkv: expected [num_tokens, num_heads_q + num_heads_k + num_heads_v, head_dim] = "
                f"[num_tokens, {heads}, {d}], got shape {_shape(qkv)}")
        # The head stride is free (heads of a wider buffer, e.g. wide[..., :head_dim]); heads
        # that would share memory are refused where qkv is written (check_mutation_safe).
        if qkv.stride(2) != 1:
            raise ValueError(f"qkv: expected a unit stride in dim 2 (head_dim), got strides "
                             f"{tuple(qkv.stride())}")
        view = qkv
    else:
        raise ValueError(
            f"qkv: expected 2 dims [num_tokens, (num_heads_q + num_heads_k + num_heads_v) * "
            f"head_dim] or 3 dims [num_tokens, num_heads_q + num_heads_k + num_heads_v, "
            f"head_dim], got shape {_shape(qkv)}")

    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is None:
            continue
        require_tensor(name, w)
        if w.dim() != 1 or w.shape[0] != d:
            raise ValueError(f"{name}: expected shape [head_dim] = [{d}], got {_shape(w)}")
        if w.dtype not in INPUT_DTYPES:
            raise ValueError(f"{name}: expected dtype float16, bfloat16 or float32, got "
                             f"{w.dtype}")
        if w.stride(0) != 1:
            raise ValueError(f"{name}: expected a unit stride, got stride {w.stride(0)}")
        require_same_device(qkv.device, "qkv", ((name, w),))
    check_rope_args(position_ids, view, cos_sin_cache, d, positions_name="position_ids",
                    query_name="qkv")
    return view, eps, weight_offset


def validate(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight,
             cos_sin_cache, is_neox, position_ids, forced_token_heads_per_warp=-1,
             weight_offset=0.0) -> tuple[torch.Tensor, float, float]:
    """Check every argument of :func:`fused_qk_norm_rope`; return :func:`validate_norm`'s
    ``(qkv view, eps, weight_offset)``. Raises TypeError/ValueError naming the argument."""
    view, eps, weight_offset = validate_norm(
        qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight,
        cos_sin_cache, is_neox, position_ids, forced_token_heads_per_warp, weight_offset)
    check_mutation_safe(outputs=(("qkv", qkv),),
                        inputs=(("position_ids", position_ids), ("cos_sin_cache", cos_sin_cache),
                                ("q_weight", q_weight), ("k_weight", k_weight)))
    return view, eps, weight_offset


@registry.custom_op(OP, mutates=("qkv",))
def fused_qk_norm_rope(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int,
                       head_dim: int, eps: float, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, cos_sin_cache: torch.Tensor, is_neox: bool,
                       position_ids: torch.Tensor, forced_token_heads_per_warp: int = -1, *,
                       weight_offset: float = 0.0, implementation: str | None = None) -> None:
    """RMS-normalize every query and key head of ``qkv`` with its weight, then rotate it (RoPE),
    in place; the contract is docs/ops/fused_qk_norm_rope.md.

    ``qkv``: ``[T_pad, (Hq + Hk + Hv) * D]`` or ``[T_pad, Hq + Hk + Hv, D]`` (float16, bfloat16 or
    float32; 2-D: dense heads; 3-D: any head stride, unit-stride head_dim; any token stride):
    per token the query heads, the key heads, the value heads. Rows ``t < T_rot =
    position_ids.numel()`` whose position lies in ``[0, max_position)`` are normalized and
    rotated; value heads and every other row keep their bits. Per head, in float32 with every
    step rounded to nearest even and no fused multiply-add: the squares summed in one fixed
    pairwise tree, ``r = RN(1 / RN(sqrt(RN(RN(ss / D) + eps))))``, ``n = RN(RN(x * r) * g)``
    with ``g = w`` (or ``RN(w + weight_offset)``; no weight: ``n = RN(x * r)``), then the RoPE
    of :func:`kvwrite.rotary_embedding` on the float32 ``n`` and one rounding to qkv's dtype.

    ``q_weight``, ``k_weight``: ``[D]`` of any float dtype or None; ``cos_sin_cache``,
    ``is_neox`` as :func:`kvwrite.rotary_embedding`'s; ``forced_token_heads_per_warp`` is
    accepted and has no effect. ``implementation`` names a registered one; None picks the
    preferred one.
    """
    view, eps, weight_offset = validate(
        qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight,
        cos_sin_cache, is_neox, position_ids, forced_token_heads_per_warp, weight_offset)
    info = registry.select(OP, (view, q_weight, k_weight, cos_sin_cache, is_neox), implementation)
    if position_ids.numel() == 0:
        return
    info.run(view, num_heads_q, num_heads_k, eps, q_weight, k_weight, cos_sin_cache, is_neox,
             position_ids, weight_offset)
