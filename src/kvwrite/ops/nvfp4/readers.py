"""Reading NVFP4 back, and quantizing plain matrices (docs/ops/nvfp4.md, "Readers"): plain
PyTorch that runs on any device and is exact.

A reader computes ``RN(value(c) * float(S) * k)``: ``value(c) * float(S)`` is exact (at most 2
and 4 significant bits), so the one rounding is the product with ``k``; then the cast to the
output dtype (nearest even). Zeros keep their sign (code 0x8 is -0.0).
"""

from __future__ import annotations

import torch

from ... import formats
from ...dtypes import INPUT_DTYPES
from ...validation import check_reader_slots, require_tensor
from ...validation import shape_str as _shape
from .op import (
    ScaleLayout,
    _check_scale_tensor,
    _page_layout,
    _region_view,
    float32_scale,
    parse_scale_layout,
    region_bytes,
)
from .reference import swizzled_positions
from .rule import GROUP, e2m1_values, e4m3_value, pack_codes, quantize_groups, scale_tensor
from .rule import unpack_codes as _unpack

__all__ = ["nvfp4_gather_cache", "nvfp4_kv_quantize", "nvfp4_kv_dequantize", "dequantize_groups"]

_FORMAT = formats.lookup("nvfp4")  # the page geometry of both NVFP4 modes
_OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _output_dtype(dtype) -> torch.dtype:
    if dtype not in _OUTPUT_DTYPES:
        raise ValueError(f"output_dtype: expected torch.float32, torch.bfloat16 or torch.float16, "
                         f"got {dtype!r}")
    return dtype


def _scale(name: str, k, device: torch.device) -> torch.Tensor:
    k = float32_scale(name, k)
    if isinstance(k, torch.Tensor):
        _check_scale_tensor(name, k, device, "one per-tensor scale")
    return scale_tensor(k, device)


def dequantize_groups(codes: torch.Tensor, s: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """float32 ``RN(value(c) * float(S) * k)`` of codes [..., G, 16] and scale bytes [..., G]."""
    prod = e2m1_values(codes) * e4m3_value(s)[..., None]  # exact
    return prod * k.expand(prod.shape)


def nvfp4_gather_cache(cache: torch.Tensor, slot_mapping: torch.Tensor, scale, *,
                       scale_layout: str = "linear",
                       output_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One side of an NVFP4 cache in vLLM's page layout (``key_cache`` or ``value_cache`` as
    ``reshape_and_cache_flash`` takes them: uint8, logical ``[num_blocks, block_size, H, F]``,
    ``F = D/2 + D/16``) read back at ``slot_mapping`` [T] as ``[T, H, D]`` of ``output_dtype``:
    ``RN(value(c) * float(S) * scale)``, then cast. Rows of negative slots and slots past the
    cache are 0. ``scale``: a one-element float32 tensor on the cache's device or a positive
    number (rounded to float32); ``scale_layout``: the layout the side's scales were written in
    ("linear", or "swizzled" for a V side written swizzled)."""
    require_tensor("cache", cache)
    if cache.dim() != 4:
        raise ValueError(f"cache: expected 4 dims [num_blocks, block_size, H, F], got shape "
                         f"{_shape(cache)}")
    if cache.dtype != torch.uint8:
        raise ValueError(f"cache: expected dtype torch.uint8, got {cache.dtype}")
    nb, bs, h, f = cache.shape
    head_size = _FORMAT.head_size_of(f)
    if head_size is None:
        raise ValueError(f"cache: expected a last dim F = D/2 + D/16 for a head_size D that is a "
                         f"multiple of 16 (F = 9, 18, 27, ...), got shape {_shape(cache)}")
    nhd = _page_layout(cache, "cache")
    layout = parse_scale_layout(scale_layout, "scale_layout")
    if layout is ScaleLayout.SWIZZLED and (bs % 4 or head_size % 64):
        raise ValueError(f"scale_layout: 'swizzled' needs block_size % 4 == 0 and head_size % 64 "
                         f"== 0, got block_size {bs} and head_size {head_size}")
    check_reader_slots("slot_mapping", slot_mapping, cache.device, "cache")
    output_dtype = _output_dtype(output_dtype)
    k = _scale("scale", scale, cache.device)
    groups = head_size // GROUP
    row_data, row_scales = region_bytes(head_size)
    data = _region_view(cache, nhd, row_data, 0)
    sf = _region_view(cache, nhd, row_scales, bs * h * row_data)
    slots = slot_mapping.long()
    keep = (slots >= 0) & (slots < nb * bs)
    s = torch.where(keep, slots, torch.zeros_like(slots))
    blocks, offsets = s // bs, s % bs
    codes = _unpack(data[blocks, offsets]).reshape(-1, h, groups, GROUP)
    if layout is ScaleLayout.SWIZZLED:
        tp, gp = swizzled_positions(offsets, groups)
        hh = torch.arange(h, device=cache.device)
        scales = sf[blocks[:, None, None], tp[:, None, :], hh[None, :, None], gp[:, None, :]]
    else:
        scales = sf[blocks, offsets]
    out = dequantize_groups(codes, scales, k).reshape(-1, h, head_size)
    out = torch.where(keep[:, None, None], out, torch.zeros_like(out))
    return out.to(output_dtype)


def _matrix(name: str, x: torch.Tensor, dtypes, cols_name: str) -> None:
    require_tensor(name, x)
    if x.dim() != 2:
        raise ValueError(f"{name}: expected 2 dims [M, {cols_name}], got shape {_shape(x)}")
    if x.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got "
                         f"{x.dtype}")


def nvfp4_kv_quantize(input: torch.Tensor, global_scale, *, four_over_six: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The group rule on each row of ``input`` [M, K] (float16/bfloat16/float32, K % 16 == 0)
    with the per-tensor scale ``global_scale`` (= k: a one-element float32 tensor on the input's
    device, or a positive number rounded to float32); returns (uint8 [M, K/2] codes, element 2j
    in the low nibble, uint8 [M, K/16] E4M3 scale bytes, linear). ``four_over_six``: the
    "nvfp4_4over6" rule."""
    _matrix("input", input, INPUT_DTYPES, "K")
    m, kk = input.shape
    if kk < GROUP or kk % GROUP:
        raise ValueError(f"input: expected K a positive multiple of {GROUP}, got shape "
                         f"{_shape(input)}")
    k = _scale("global_scale", global_scale, input.device)
    codes, s = quantize_groups(input.reshape(m * (kk // GROUP), GROUP), k, bool(four_over_six))
    return pack_codes(codes).reshape(m, kk // 2), s.reshape(m, kk // GROUP)


def nvfp4_kv_dequantize(fp4_data: torch.Tensor, block_scales: torch.Tensor, global_scale,
                        output_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The inverse of :func:`nvfp4_kv_quantize`: ``[M, K]`` of ``output_dtype``, each element
    ``RN(value(c) * float(S) * global_scale)`` then cast (nearest even)."""
    _matrix("fp4_data", fp4_data, (torch.uint8,), "K/2")
    _matrix("block_scales", block_scales, (torch.uint8, torch.float8_e4m3fn), "K/16")
    m, half = fp4_data.shape
    if half % (GROUP // 2) or half == 0:
        raise ValueError(f"fp4_data: expected [M, K/2] with K a positive multiple of {GROUP}, got "
                         f"shape {_shape(fp4_data)}")
    groups = half // (GROUP // 2)
    if block_scales.shape != (m, groups):
        raise ValueError(f"block_scales: expected shape {(m, groups)} (K/16 per row of fp4_data), "
                         f"got {_shape(block_scales)}")
    if block_scales.device != fp4_data.device:
        raise ValueError(f"block_scales: expected device {fp4_data.device} (that of fp4_data), "
                         f"got {block_scales.device}")
    output_dtype = _output_dtype(output_dtype)
    k = _scale("global_scale", global_scale, fp4_data.device)
    codes = _unpack(fp4_data).reshape(m, groups, GROUP)
    out = dequantize_groups(codes, block_scales.view(torch.uint8), k)
    return out.reshape(m, groups * GROUP).to(output_dtype)
