"""The plain-PyTorch implementation of indexer_k_quant_and_cache: the reference oracle and the
baseline a user would write.

Works on CPU and CUDA tensors and on any page stride (``kv_cache.stride(0)``). Not graph-safe:
masking out padding and out-of-range slots syncs with the host.
"""

from __future__ import annotations

import torch

from ...dtypes import ue8m0_round_up
from ...layouts import written_slots
from .op import E4M3_MAX, SCALE_FLOOR_BITS, ScaleFormat

__all__ = ["available", "unsupported", "run", "group_scales", "quantize_rows", "page_views",
           "ue8m0", "scale_bytes"]


def available(device: torch.device) -> str | None:
    return None


def unsupported(k, kv_cache, fmt) -> str | None:
    return None


ue8m0 = ue8m0_round_up  # the shared rule (kvwrite.dtypes), under the name the tests know


def group_scales(x: torch.Tensor, fmt: ScaleFormat) -> torch.Tensor:
    """float32 scales ``[n, G]`` of float32 groups ``x`` ``[n, G, q]``."""
    # amax ignoring NaN, from 0 (an all-NaN group has amax 0).
    amax = torch.where(torch.isnan(x), 0.0, x.abs()).amax(dim=2)
    floor = torch.tensor(SCALE_FLOOR_BITS, dtype=torch.int32, device=x.device).view(torch.float32)
    # A true float32 division: a tensor divisor (PyTorch's CUDA division by a Python scalar
    # multiplies by its reciprocal).
    s = torch.maximum(amax, floor) / torch.full_like(amax, E4M3_MAX)
    return ue8m0(s) if fmt.power_of_two else s


def scale_bytes(s: torch.Tensor, fmt: ScaleFormat) -> torch.Tensor:
    """The ``[n, 4G]`` scale bytes of float32 scales ``s`` ``[n, G]``: each scale's little-endian
    float32 bits, or for "mxfp8" its biased exponent (bits >> 23; s > 0, so 0xFF is +inf) 4
    times."""
    if fmt.exponent_bytes:
        e = (s.contiguous().view(torch.int32) >> 23).to(torch.uint8)
        return e[:, :, None].expand(*s.shape, 4).reshape(s.shape[0], -1)
    return s.contiguous().view(torch.uint8)


def quantize_rows(k: torch.Tensor, quant_block_size: int, fmt: ScaleFormat,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [n, D] uint8, scales [n, G] float32)`` of rows ``k`` ``[n, D]``."""
    n, d = k.shape
    x = k.float().reshape(n, d // quant_block_size, quant_block_size)
    s = group_scales(x, fmt)
    # Clamp before the cast: some PyTorch versions cast overflow (and inf) to NaN.
    q = (x / s[:, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, d), s


def page_views(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [nb, bs, D], scale bytes [nb, bs, 4G])``: the two regions of every page, as uint8
    views of the cache's memory."""
    nb, bs, e = kv_cache.shape
    pages = kv_cache.as_strided((nb, bs * e), (kv_cache.stride(0), 1), kv_cache.storage_offset())
    return (pages[:, :bs * head_dim].view(nb, bs, head_dim),
            pages[:, bs * head_dim:].view(nb, bs, e - head_dim))


def run(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
        quant_block_size: int, fmt: ScaleFormat) -> None:
    num_blocks, block_size, _ = kv_cache.shape
    tokens, blocks, offsets = written_slots(slot_mapping, num_blocks, block_size)
    codes, scales = quantize_rows(k[tokens], quant_block_size, fmt)
    code_view, scale_view = page_views(kv_cache, k.shape[1])
    code_view[blocks, offsets] = codes
    scale_view[blocks, offsets] = scale_bytes(scales, fmt)
