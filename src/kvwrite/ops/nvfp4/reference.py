"""The plain-PyTorch implementation of the NVFP4 writes: the reference oracle and the baseline a
user would write.

Works on CPU and CUDA tensors and on any view strides (bytes are indexed logically by block,
offset, head and byte). Not graph-safe: masking out padding and out-of-range slots syncs with
the host.
"""

from __future__ import annotations

import torch

from ...dtypes import CacheDType
from ...layouts import written_slots
from .op import ScaleLayout
from .rule import GROUP, pack_codes, quantize_groups

__all__ = ["available", "unsupported", "run", "swizzled_positions"]


def available(device: torch.device) -> str | None:
    return None


def unsupported(key, k_data, cache_dtype, v_scale_layout) -> str | None:
    return None


def swizzled_positions(offsets: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(t', g') [n, groups] of the 4-token swizzle for token offsets ``offsets`` [n]: group g of
    offset t goes to row t' = 4*(t//4) + g//(G/4), byte g' = 4*(g % (G/4)) + t % 4 (G = D/16)."""
    q = groups // 4
    g = torch.arange(groups, device=offsets.device)
    t = offsets[:, None]
    return 4 * (t // 4) + g[None, :] // q, 4 * (g[None, :] % q) + t % 4


def run(key: torch.Tensor, value: torch.Tensor, k_data: torch.Tensor, k_sf: torch.Tensor,
        v_data: torch.Tensor, v_sf: torch.Tensor, slot_mapping: torch.Tensor,
        cache_dtype: CacheDType, k_scale, v_scale, v_scale_layout: ScaleLayout) -> None:
    num_blocks, block_size, num_heads = k_data.shape[:3]
    head_size = key.shape[2]
    groups = head_size // GROUP
    tokens, blocks, offsets = written_slots(slot_mapping, num_blocks, block_size)
    n = tokens.numel()
    four_over_six = cache_dtype is CacheDType.NVFP4_4OVER6
    for src, data, sf, scale, swizzled in (
            (key, k_data, k_sf, k_scale, False),
            (value, v_data, v_sf, v_scale, v_scale_layout is ScaleLayout.SWIZZLED)):
        x = src[tokens].reshape(n * num_heads * groups, GROUP)
        codes, s = quantize_groups(x, scale, four_over_six)
        data[blocks, offsets] = pack_codes(codes).reshape(n, num_heads, head_size // 2)
        s = s.reshape(n, num_heads, groups)
        if swizzled:
            tp, gp = swizzled_positions(offsets, groups)
            h = torch.arange(num_heads, device=s.device)
            sf[blocks[:, None, None], tp[:, None, :], h[None, :, None], gp[:, None, :]] = s
        else:
            sf[blocks, offsets] = s
