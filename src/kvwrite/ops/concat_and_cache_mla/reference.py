"""The plain-PyTorch implementation of concat_and_cache_mla: the reference oracle and the baseline
a user would write.

Works on CPU and CUDA tensors and on any cache strides (entries are indexed by block and offset).
Not graph-safe: masking out padding and out-of-range slots syncs with the host.
"""

from __future__ import annotations

import torch

from ...dtypes import FP8_MAX, SCALE_FLOOR_1E4_BITS, ue8m0_round_up
from ...layouts import written_slots
from .op import DEFAULT_DS_MLA_SCALE, DS_MLA_L, DS_MLA_P, DS_MLA_TILE, DsMlaScale, MlaMode

__all__ = ["available", "unsupported", "run", "ds_mla_rows", "ds_mla_scales", "FLT_MIN"]

FLT_MIN = 2.0**-126
_E4M3_MAX = FP8_MAX[torch.float8_e4m3fn]


def available(device: torch.device) -> str | None:
    return None


def unsupported(kv_c, kv_cache, mode) -> str | None:
    return None


def _fp8(x: torch.Tensor, fp8: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """The fp8 rule as uint8 codes: a true float32 division, then a saturating cast."""
    y = x.float() / scale
    # Clamp before the cast: some PyTorch versions cast overflow (and inf) to NaN.
    return y.clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8).view(torch.uint8)


def ds_mla_scales(amax: torch.Tensor, ds_scale: DsMlaScale = DEFAULT_DS_MLA_SCALE) -> torch.Tensor:
    """The float32 tile scales of tile amaxes (>= 0, never NaN) under ``ds_scale``."""
    # A true float32 division: a tensor divisor, since PyTorch's CUDA division by a Python
    # scalar multiplies by its reciprocal (the GPU check found scales that differ with it).
    r = amax / torch.full_like(amax, 448.0)
    if ds_scale is DsMlaScale.AMAX:
        return torch.clamp_min(r, FLT_MIN)
    floor = torch.tensor(SCALE_FLOOR_1E4_BITS, dtype=torch.int32, device=amax.device)
    return ue8m0_round_up(torch.maximum(r, floor.view(torch.float32)))


def ds_mla_rows(kv_c: torch.Tensor, k_pe: torch.Tensor,
                ds_scale: DsMlaScale = DEFAULT_DS_MLA_SCALE) -> torch.Tensor:
    """The 656-byte fp8_ds_mla entries ``[n, 656]`` uint8 of ``n`` rows of kv_c ``[n, 512]`` and
    k_pe ``[n, 64]`` or ``[n, 0]`` (NoPE: the rotary bytes are zeros), 16-bit, under the tile
    scale rule ``ds_scale``."""
    n = kv_c.shape[0]
    x = kv_c.float().reshape(n, DS_MLA_L // DS_MLA_TILE, DS_MLA_TILE)
    # amax ignoring NaN (as fmaxf does), from 0: an all-NaN tile has amax 0.
    amax = torch.where(torch.isnan(x), 0.0, x.abs()).amax(dim=2)
    s = ds_mla_scales(amax, ds_scale)
    codes = _fp8(x, torch.float8_e4m3fn, s[:, :, None])
    if k_pe.shape[1] == 0:
        pe = torch.zeros(n, 2 * DS_MLA_P, dtype=torch.uint8, device=kv_c.device)
    else:
        pe = k_pe.contiguous().view(torch.uint8)
    return torch.cat([codes.reshape(n, DS_MLA_L), s.contiguous().view(torch.uint8), pe], dim=1)


def run(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
        mode: MlaMode, scale: torch.Tensor | None, *,
        ds_scale: DsMlaScale = DEFAULT_DS_MLA_SCALE) -> None:
    num_blocks, block_size = kv_cache.shape[:2]
    tokens, blocks, offsets = written_slots(slot_mapping, num_blocks, block_size)
    c, pe = kv_c[tokens], k_pe[tokens]
    if mode is MlaMode.AUTO:
        rows = torch.cat([c, pe], dim=1)
    elif mode is MlaMode.FP8_DS_MLA:
        rows = ds_mla_rows(c, pe, ds_scale)
    else:
        rows = _fp8(torch.cat([c, pe], dim=1), mode.fp8_dtype, scale)
        if kv_cache.dtype != torch.uint8:
            rows = rows.view(kv_cache.dtype)
    kv_cache[blocks, offsets] = rows
