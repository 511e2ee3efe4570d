"""Reading MXFP8/MXFP4 caches back (SPEC §10.3, "Reader"): plain PyTorch that runs on any device
and is exact. Element ``RN(value(code) * 2^(B - 127))`` in float32 (the product is exact but for
overflow to +-inf; scale byte 0 is 2^-127, 255 is NaN), then rounded to nearest even to the
output dtype. Zeros keep their sign."""

from __future__ import annotations

import torch

from ...dtypes import parse_kv_cache_dtype
from ...validation import check_in_range, check_reader_slots, require_tensor
from ...validation import shape_str as _shape
from .op import SCALE_DTYPES, mode_of, parse_scale_layout, scale_cache_shape
from .rule import GROUP, decode_groups, scale_positions

__all__ = ["mx_gather_cache"]

_OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def mx_gather_cache(cache: torch.Tensor, scale_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    kv_cache_dtype: str, *, scale_layout: str = "linear",
                    output_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One side of an MX cache (``key_cache`` and ``k_scale_cache``, or the V pair, as
    ``reshape_and_cache_flash(..., "mxfp8" | "mxfp4")`` wrote them) read back at
    ``slot_mapping`` [N] as ``[N, H, D]`` of ``output_dtype``. ``cache``: logical ``[num_blocks,
    block_size, H, F]`` (F = D for mxfp8, uint8 or float8_e4m3fn; D/2 for mxfp4, uint8), any
    strides; ``scale_cache``: uint8 or float8_e8m0fnu in ``scale_layout`` ("linear": ``[num_blocks,
    block_size, H, D/32]``; "interleaved128": ``[num_blocks, H, block_size/128, 32, 4, 4]``), any
    strides. Every slot must be in ``[0, num_blocks * block_size)`` (ValueError naming
    ``slot_mapping``; the check reads the slots on the host)."""
    mode = mode_of(parse_kv_cache_dtype(kv_cache_dtype, nvfp4=True, mx=True))
    layout = parse_scale_layout(scale_layout)
    require_tensor("cache", cache)
    require_tensor("scale_cache", scale_cache)
    if cache.dim() != 4:
        raise ValueError(f"cache: expected 4 dims [num_blocks, block_size, H, F], got shape "
                         f"{_shape(cache)}")
    if cache.dtype not in mode.storage:
        names = " or ".join(str(d) for d in mode.storage)
        raise ValueError(f"cache: kv_cache_dtype={mode.name!r} expects dtype {names}, got "
                         f"{cache.dtype}")
    nb, bs, h, f = cache.shape
    # A row is F data bytes and D/32 scale bytes (the format's record).
    d = f * 8 // mode.element_bits()
    head_size = mode.head_size_of(f + mode.scale_bytes(d)) if d >= GROUP else None
    if head_size is None or mode.data_bytes(head_size) != f:
        f_what = "D" if mode.element_bits() == 8 else "D/2"
        raise ValueError(f"cache: expected a last dim F = {f_what} for a head_size D that is a "
                         f"positive multiple of {GROUP}, got shape {_shape(cache)}")
    if scale_cache.dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_cache: expected dtype torch.uint8 or torch.float8_e8m0fnu, got "
                         f"{scale_cache.dtype}")
    if layout == "interleaved128" and (head_size != 128 or bs % 128):
        raise ValueError(f"scale_layout: 'interleaved128' needs head_size 128 and block_size % "
                         f"128 == 0, got head_size {head_size} and block_size {bs}")
    want = scale_cache_shape(layout, nb, bs, h, head_size)
    if tuple(scale_cache.shape) != want:
        raise ValueError(f"scale_cache: expected shape {want} (scale_layout={layout!r}, "
                         f"that of cache), got {_shape(scale_cache)}")
    if scale_cache.device != cache.device:
        raise ValueError(f"scale_cache: expected device {cache.device} (that of cache), got "
                         f"{scale_cache.device}")
    check_reader_slots("slot_mapping", slot_mapping, cache.device, "cache")
    if output_dtype not in _OUTPUT_DTYPES:
        raise ValueError(f"output_dtype: expected torch.float32, torch.bfloat16 or "
                         f"torch.float16, got {output_dtype!r}")
    slots = slot_mapping.long()
    check_in_range("slot_mapping", slot_mapping, (slots < 0) | (slots >= nb * bs),
                   f"expected slots in [0, num_blocks * block_size = {nb * bs})")
    groups = head_size // GROUP
    blocks, offsets = slots // bs, slots % bs
    codes = cache.view(torch.uint8)[blocks, offsets].reshape(-1, h, groups, f // groups)
    sc = scale_cache.view(torch.uint8)
    if layout == "linear":
        scales = sc[blocks, offsets]
    else:
        scales = sc[(blocks[:, None, None], *scale_positions(offsets, h, groups))]
    out = decode_groups(codes, scales, mode.element).reshape(-1, h, head_size)
    return out.to(output_dtype)
