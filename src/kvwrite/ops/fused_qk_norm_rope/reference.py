"""The plain-PyTorch implementation of fused_qk_norm_rope: the reference oracle
(docs/ops/fused_qk_norm_rope.md).

Every float32 step is its own tensor op (eager PyTorch never fuses them), so each is rounded to
float32 as the contract says; the square root is taken in float64 and rounded once (PyTorch's
float32 CPU square root is not correctly rounded; the float64 one rounded to float32 is). The
RoPE is rotary_embedding's reference, applied to the float32 values. Works on CPU and CUDA
tensors of any token and head stride (it reads and writes through qkv's views: padding between
heads is untouched).
"""

from __future__ import annotations

import torch

from ...kernels.triton_support import next_pow2
from ..rotary_embedding.reference import rotate, store_rotated
from .op import float32_value

__all__ = ["available", "unsupported", "run", "norm_rope", "sum_of_squares"]


def available(device: torch.device) -> str | None:
    return None


def unsupported(qkv, q_weight, k_weight, cos_sin_cache, is_neox) -> str | None:
    return None


def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """The squares of ``x`` (float32 ``[..., D]``) summed over the last dim in the contract's tree:
    leaves RN(x*x), +0 up to the next power of two, neighbours added level by level."""
    sq = x * x
    d = sq.shape[-1]
    pad = next_pow2(d) - d
    if pad:
        sq = torch.cat([sq, sq.new_zeros((*sq.shape[:-1], pad))], dim=-1)
    while sq.shape[-1] > 1:
        sq = sq[..., 0::2] + sq[..., 1::2]
    return sq[..., 0]


def _weights(q_weight, k_weight, num_heads_q: int, num_heads_k: int, head_dim: int,
             weight_offset: float, like: torch.Tensor) -> torch.Tensor:
    """g per head, ``[Hq + Hk, D]`` float32: the weight (plus the offset where it is not 0), ones
    where there is none (RN(u * 1) = u)."""
    rows = []
    for w, n in ((q_weight, num_heads_q), (k_weight, num_heads_k)):
        if w is None:
            g = like.new_ones(head_dim)
        else:
            g = w.float()
            if weight_offset != 0:
                g = g + float32_value(weight_offset)
        rows.append(g.expand(n, head_dim))
    return torch.cat(rows)


def norm_rope(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, eps: float,
              q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
              cos_sin_cache: torch.Tensor, is_neox: bool, position_ids: torch.Tensor,
              weight_offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The query and key heads of rows ``t < T_rot`` of ``qkv`` (``[T_pad, Hq+Hk+Hv, D]``)
    normalized and rotated, as a new ``[T_rot, Hq+Hk, D]`` tensor of qkv's dtype, and ``valid``
    (``[T_rot]`` bool: whether the token's position is in the table; other rows hold values to be
    discarded)."""
    num_rot = position_ids.numel()
    heads = num_heads_q + num_heads_k
    d = qkv.shape[2]
    x = qkv[:num_rot, :heads].float()
    ss = sum_of_squares(x)
    # A tensor divisor: PyTorch's CUDA division by a Python scalar multiplies by its reciprocal.
    m = ss / torch.full_like(ss, d)
    a = m + float32_value(eps)
    sigma = a.double().sqrt().float()
    r = torch.div(torch.ones_like(sigma), sigma)
    u = x * r[..., None]
    n = u * _weights(q_weight, k_weight, num_heads_q, num_heads_k, d, weight_offset, x)
    rotated, valid = rotate(n, position_ids, cos_sin_cache, is_neox)
    return rotated.to(qkv.dtype), valid


def run(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, eps: float,
        q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
        cos_sin_cache: torch.Tensor, is_neox: bool, position_ids: torch.Tensor,
        weight_offset: float) -> None:
    out, valid = norm_rope(qkv, num_heads_q, num_heads_k, eps, q_weight, k_weight, cos_sin_cache,
                           is_neox, position_ids, weight_offset)
    store_rotated(qkv[:, :num_heads_q + num_heads_k], out, valid)
