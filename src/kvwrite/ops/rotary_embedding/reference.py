"""The plain-PyTorch implementation of rotary_embedding: the reference oracle
(docs/ops/rotary_embedding.md).

Every product and sum is its own float32 tensor op (eager PyTorch never fuses them), so each is
rounded to float32 as the contract says. Works on CPU and CUDA tensors of any token stride.
"""

from __future__ import annotations

import torch

__all__ = ["available", "unsupported", "run", "rotate", "store_rotated"]


def available(device: torch.device) -> str | None:
    return None


def unsupported(query, key, cos_sin_cache, is_neox) -> str | None:
    return None


def rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
           is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``t < T_rot`` of ``x`` (``[T_pad, H, D]``) rotated, as a new ``[T_rot, H, D]`` tensor of
    x's dtype, and ``valid`` (``[T_rot]`` bool): whether the token's position is in the table.
    Rows of invalid tokens hold a rotation by position 0 (to be discarded)."""
    num_rot = positions.numel()
    max_position, rot_dim = cos_sin_cache.shape
    half = rot_dim // 2
    pos = positions.long()
    valid = (pos >= 0) & (pos < max_position)
    cs = cos_sin_cache[torch.where(valid, pos, 0)].float()  # never indexes outside the table
    c, s = cs[:, None, :half], cs[:, None, half:]
    rows = x[:num_rot]
    xf = rows.float()
    if is_neox:
        a, b = xf[..., :half], xf[..., half:rot_dim]
    else:
        a, b = xf[..., 0:rot_dim:2], xf[..., 1:rot_dim:2]
    a2 = a * c - b * s
    b2 = b * c + a * s
    out = rows.clone()
    if is_neox:
        out[..., :half] = a2.to(x.dtype)
        out[..., half:rot_dim] = b2.to(x.dtype)
    else:
        out[..., 0:rot_dim:2] = a2.to(x.dtype)
        out[..., 1:rot_dim:2] = b2.to(x.dtype)
    return out, valid


def store_rotated(dest: torch.Tensor, rotated: torch.Tensor, valid: torch.Tensor) -> None:
    """``dest[t] = rotated[t]`` for each valid token ``t < T_rot``; other rows keep their bits."""
    n = rotated.shape[0]
    dest[:n].copy_(torch.where(valid[:, None, None], rotated, dest[:n]))


def run(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
        cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    rq, valid = rotate(query, positions, cos_sin_cache, is_neox)
    rk = None if key is None else rotate(key, positions, cos_sin_cache, is_neox)[0]
    store_rotated(query, rq, valid)
    if key is not None:
        store_rotated(key, rk, valid)
