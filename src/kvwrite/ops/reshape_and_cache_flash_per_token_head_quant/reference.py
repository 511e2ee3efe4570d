"""The plain-PyTorch implementation of reshape_and_cache_flash_per_token_head_quant: the reference
oracle and the baseline a user would write.

Works on CPU and CUDA tensors and on any cache strides. Every rounding step is the contract's:
true float32 divisions by tensors (PyTorch's CUDA division by a Python scalar multiplies by its
reciprocal), and the two integer roundings done on the exact fractional part (``v - trunc(v)``
and ``v - floor(v)`` are exact in float32), never as ``floor(v + 0.5)``. Not graph-safe: masking
out padding and out-of-range slots syncs with the host.
"""

from __future__ import annotations

import torch

from ...layouts import written_slots
from .op import SCALE_FLOOR, PerTokenHeadMode

__all__ = ["available", "unsupported", "run", "quantize_rows", "rhaz", "rhu"]

_E4M3_MAX = 448.0
# Quotients are clamped to this before rounding: every larger magnitude saturates all the same.
_QCLAMP = 256.0


def available(device: torch.device) -> str | None:
    return None


def unsupported(key, value, key_cache, value_cache, mode) -> str | None:
    return None


def rhaz(v: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, exactly (float32 in, float32 integers out)."""
    n = v.trunc()
    step = torch.where(v < 0, -1.0, 1.0)
    return torch.where((v - n).abs() >= 0.5, n + step, n)


def rhu(v: torch.Tensor) -> torch.Tensor:
    """Round half up, exactly."""
    n = v.floor()
    return torch.where(v - n >= 0.5, n + 1.0, n)


def _div(a: torch.Tensor, b: float) -> torch.Tensor:
    return a / torch.full_like(a, b)


def _quotient(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """RN(x / s), a NaN quotient counted as 0, clamped to +-_QCLAMP (integer modes)."""
    q = x / s
    return torch.where(torch.isnan(q), 0.0, q).clamp(-_QCLAMP, _QCLAMP)


def quantize_rows(x: torch.Tensor, mode: PerTokenHeadMode) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale_entries)`` of rows ``x`` ``[..., D]``: codes ``[..., Dq]`` uint8 (the
    stored bytes) and the float32 scale cache entries ``[...]``."""
    xf = x.float()
    nan = torch.isnan(xf)
    floor = torch.tensor(SCALE_FLOOR, dtype=torch.float32, device=x.device)
    if mode is PerTokenHeadMode.INT4_PER_TOKEN_HEAD:
        mn = torch.where(nan, float("inf"), xf).amin(dim=-1)
        mx = torch.where(nan, -float("inf"), xf).amax(dim=-1)
        none = nan.all(dim=-1)
        mn = torch.where(none, 0.0, mn)
        mx = torch.where(none, 0.0, mx)
        s = torch.fmax(_div(mx - mn, 15.0), floor)  # fmax: a NaN range gives the floor
        zp = rhu(_quotient(-mn, s)).clamp(0, 15)
        q = (rhu(_quotient(xf, s[..., None])) + zp[..., None]).clamp(0, 15).to(torch.uint8)
        codes = q[..., 0::2] | (q[..., 1::2] << 4)
        bits = (s.view(torch.int32) & -16) | zp.to(torch.int32)
        return codes, bits.view(torch.float32)
    amax = torch.where(nan, 0.0, xf.abs()).amax(dim=-1)
    if mode is PerTokenHeadMode.INT8_PER_TOKEN_HEAD:
        s = torch.fmax(_div(amax, 127.0), floor)
        q = rhaz(_quotient(xf, s[..., None])).clamp(-128, 127).to(torch.int8)
        return q.view(torch.uint8), s
    s = torch.fmax(_div(amax, _E4M3_MAX), floor)
    # Clamp before the cast: some PyTorch versions cast overflow (and inf) to NaN.
    q = (xf / s[..., None]).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), s


def run(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
        value_cache: torch.Tensor, k_scale_cache: torch.Tensor, v_scale_cache: torch.Tensor,
        slot_mapping: torch.Tensor, mode: PerTokenHeadMode) -> None:
    num_blocks, block_size = key_cache.shape[:2]
    tokens, blocks, offsets = written_slots(slot_mapping, num_blocks, block_size)
    for src, cache, scale_cache in ((key, key_cache, k_scale_cache),
                                    (value, value_cache, v_scale_cache)):
        codes, entries = quantize_rows(src[tokens], mode)
        cache[..., :codes.shape[-1]].view(torch.uint8)[blocks, offsets] = codes
        scale_cache[blocks, offsets] = entries
