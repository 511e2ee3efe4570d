"""An independent, obviously-correct oracle: one token and one head at a time, with the fp8 rule
done by table lookup in NumPy rather than by PyTorch's cast."""

from __future__ import annotations

import numpy as np
import torch

from kvwrite.dtypes import CacheDType


def _fp8_table(fp8: torch.dtype) -> tuple[np.ndarray, int]:
    """Every finite non-negative fp8 value in code order (which is value order), and the NaN code."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8).float().numpy().astype(np.float64)
    finite = [c for c in range(128) if np.isfinite(codes[c])]
    assert finite == list(range(len(finite)))  # codes 0.. are the finite values, increasing
    return codes[: len(finite)], 0x7F


def fp8_round(q: np.ndarray, fp8: torch.dtype) -> np.ndarray:
    """Round float32 values to fp8 codes: nearest, ties to even, saturating, sign kept."""
    table, nan_code = _fp8_table(fp8)
    a = np.abs(q.astype(np.float64))
    hi = np.clip(np.searchsorted(table, a, side="left"), 0, len(table) - 1)
    lo = np.clip(hi - 1, 0, None)
    d_lo, d_hi = a - table[lo], table[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    pick = np.where(a >= table[-1], len(table) - 1, pick)  # saturate, ±inf included
    pick = np.where(a <= table[0], 0, pick)
    code = pick.astype(np.uint8) | np.where(np.signbit(q), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(q), nan_code, code).astype(np.uint8)


def _convert_row(row: torch.Tensor, cache_dtype: CacheDType, scale: float | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    if cache_dtype is CacheDType.AUTO:
        return row.clone()
    if not cache_dtype.is_fp8:
        return row.to(cache_dtype.element_dtype(row.dtype))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        q = row.float().numpy().astype(np.float32) / np.float32(scale)  # IEEE float32 division
    codes = torch.from_numpy(fp8_round(q, cache_dtype.fp8_dtype))
    return codes if out_dtype == torch.uint8 else codes.view(cache_dtype.fp8_dtype)


def cache_slots(slot_mapping, num_blocks: int, block_size: int):
    """(token, block, offset) of each token whose slot is in the cache, in token order; padding
    (negative) and out-of-range slots write nothing."""
    for t in range(slot_mapping.numel()):
        slot = int(slot_mapping[t])
        if 0 <= slot < num_blocks * block_size:
            yield t, *divmod(slot, block_size)


def oracle(key, value, key_cache, value_cache, slot_mapping, cache_dtype: CacheDType,
           k_scale, v_scale) -> None:
    """Writes into CPU caches, one token and head at a time."""
    num_blocks, block_size, num_heads, _ = key_cache.shape
    for t, b, o in cache_slots(slot_mapping, num_blocks, block_size):
        for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
            for h in range(num_heads):
                s = None
                if cache_dtype.is_fp8:
                    s = float(scale[h] if scale.numel() > 1 else scale[0])
                cache[b, o, h] = _convert_row(src[t, h], cache_dtype, s, cache.dtype)


def oracle_valid_tokens(key, value, inp, valid, cache_dtype: CacheDType) -> None:
    """:func:`oracle` into ``inp``'s caches (its slots and scales) for the tokens ``t`` with
    ``valid[t]``; the others (a position out of range) write nothing, as a padding slot."""
    slots = inp.slot_mapping.clone()
    for t in range(slots.numel()):
        if not valid[t]:
            slots[t] = -1
    oracle(key, value, inp.key_cache, inp.value_cache, slots, cache_dtype, inp.k_scale,
           inp.v_scale)
