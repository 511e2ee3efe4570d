"""The plain-PyTorch implementation of reshape_and_cache_turboquant: the reference oracle
(SPEC §10.2).

Every float32 step is its own tensor op (eager PyTorch never fuses them), so each is one IEEE
operation rounded to nearest even: sums in §7.1's tree (:func:`tree_sum`), the square root
taken in float64 and rounded once (correctly rounded: float64 has more than twice float32's
precision), divisions by tensors (PyTorch's CUDA division by a Python scalar multiplies by its
reciprocal), round half up on the exact fractional part (the per-token-head op's ``rhu``). Works
on CPU and CUDA tensors and any cache strides. Not graph-safe: masking out padding and
out-of-range slots syncs with the host.
"""

from __future__ import annotations

import torch

from ...formats import TurboQuantSlot
from ...kernels.triton_support import next_pow2
from ...layouts import written_slots
from ..reshape_and_cache_flash_per_token_head_quant.reference import rhu

__all__ = ["available", "unsupported", "run", "tree_sum", "correctly_rounded_sqrt", "pack_codes",
           "unpack_codes", "encode_slots", "key_codes", "value_codes", "EPS", "SCALE_FLOOR",
           "E4M3_MAX"]

# ε of the key normalization and the value scale's floor: float32(1e-8), bits 0x322BCC77.
EPS = 1e-8
SCALE_FLOOR = 1e-8
E4M3_MAX = 448.0
# Rows of the rotation's product tensor [rows, D, D] per chunk (bounds its memory).
_CHUNK_ELEMENTS = 1 << 24


def available(device: torch.device) -> str | None:
    return None


def unsupported(key, kv_cache, preset) -> str | None:
    return None


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32 ``[..., n]``) summed over the last dim in §7.1's tree: +0 leaves up to the
    next power of two, neighbours added level by level."""
    n = x.shape[-1]
    pad = next_pow2(n) - n
    if pad:
        x = torch.cat([x, x.new_zeros((*x.shape[:-1], pad))], dim=-1)
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def correctly_rounded_sqrt(x: torch.Tensor) -> torch.Tensor:
    """RN(sqrt(x)) of float32 ``x`` (PyTorch's float32 CPU root is not correctly rounded)."""
    return x.double().sqrt().float()


def _f32(like: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full_like(like, value, dtype=torch.float32)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (integers ``[..., n]``, each below ``2^bits``) as a field of ``ceil(n*bits/8)``
    bytes: code i in bits ``[bits*i, bits*i + bits)`` of the field read as one little-endian
    integer."""
    c = codes.to(torch.int32)
    shifts = torch.arange(bits, device=c.device, dtype=torch.int32)
    bitstream = ((c[..., None] >> shifts) & 1).flatten(-2)
    pad = -bitstream.shape[-1] % 8
    if pad:
        bitstream = torch.cat([bitstream, bitstream.new_zeros((*bitstream.shape[:-1], pad))], -1)
    bitstream = bitstream.unflatten(-1, (-1, 8))
    weights = 1 << torch.arange(8, device=c.device, dtype=torch.int32)
    return (bitstream * weights).sum(-1).to(torch.uint8)


def unpack_codes(field: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The ``n`` codes (int64) of a field packed by :func:`pack_codes`."""
    shifts = torch.arange(8, device=field.device, dtype=torch.int32)
    bitstream = ((field.to(torch.int32)[..., None] >> shifts) & 1).flatten(-2)[..., :n * bits]
    weights = 1 << torch.arange(bits, device=field.device, dtype=torch.int32)
    return (bitstream.unflatten(-1, (n, bits)) * weights).sum(-1).long()


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 ``[...]`` to its IEEE fp16 (nearest even, overflow to inf, subnormals kept) as
    2 little-endian bytes ``[..., 2]``."""
    return x.to(torch.float16)[..., None].view(torch.uint8)


def _rotate(u: torch.Tensor, PiT: torch.Tensor) -> torch.Tensor:
    """``y_j = Σᵗ over i of RN(u_i · PiT[i, j])`` for rows ``u`` ``[N, D]``."""
    d = u.shape[-1]
    out = torch.empty_like(u)
    step = max(1, _CHUNK_ELEMENTS // (d * d))
    pit_t = PiT.t()  # [j, i]
    for i in range(0, u.shape[0], step):
        rows = u[i:i + step]
        out[i:i + step] = tree_sum(rows[:, None, :] * pit_t[None])
    return out


def key_codes(x: torch.Tensor, slot: TurboQuantSlot, PiT: torch.Tensor | None,
              midpoints: torch.Tensor | None) -> torch.Tensor:
    """The key part (``key_packed_size`` bytes) of rows ``x`` ``[N, D]``."""
    x = x.float()
    if not slot.mse:
        # e4m3fn with no scale: clamp first (some PyTorch versions cast overflow to NaN; the
        # clamp keeps NaN and the sign of zero).
        return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    ss = tree_sum(x * x)
    n = correctly_rounded_sqrt(ss)
    den = n + _f32(n, EPS)
    u = x / den[:, None]
    y = _rotate(u, PiT.float())
    idx = (y[..., None] >= midpoints[None, None, :]).sum(-1)  # a NaN y_j counts 0
    return torch.cat([pack_codes(idx, slot.key_bits), _fp16_bytes(n)], dim=-1)


def value_codes(v: torch.Tensor, slot: TurboQuantSlot) -> torch.Tensor:
    """The value part (codes, fp16 scale, fp16 zero: ``value_data_bytes + 4`` bytes) of rows
    ``v`` ``[N, D]``."""
    v = v.float()
    nan = torch.isnan(v)
    none = nan.all(dim=-1)
    mn = torch.where(nan, float("inf"), v).amin(dim=-1)
    mx = torch.where(nan, -float("inf"), v).amax(dim=-1)
    mn = torch.where(none | (mn == 0), 0.0, mn)  # a zero mn is +0
    mx = torch.where(none, 0.0, mx)
    levels = slot.value_levels
    s = (mx - mn) / _f32(mx, levels)
    floor = _f32(s, SCALE_FLOOR)
    s = torch.where(s > floor, s, floor)  # a NaN s becomes the floor
    q = (v - mn[:, None]) / s[:, None]
    q = torch.where(torch.isnan(q), 0.0, q)
    q = rhu(q).clamp(0, levels).to(torch.uint8)
    return torch.cat([pack_codes(q, slot.value_bits), _fp16_bytes(s), _fp16_bytes(mn)], dim=-1)


def encode_slots(key: torch.Tensor, value: torch.Tensor, slot: TurboQuantSlot,
                 PiT: torch.Tensor | None, midpoints: torch.Tensor | None) -> torch.Tensor:
    """The slots (uint8 ``[..., slot_size]``) of rows ``key``, ``value`` ``[..., D]``."""
    lead = key.shape[:-1]
    d = key.shape[-1]
    k = key_codes(key.reshape(-1, d), slot, PiT, midpoints)
    v = value_codes(value.reshape(-1, d), slot)
    return torch.cat([k, v], dim=-1).reshape(*lead, slot.slot_size)


def run(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor, preset: TurboQuantSlot, PiT: torch.Tensor | None,
        midpoints: torch.Tensor | None) -> None:
    num_blocks, block_size = kv_cache.shape[:2]
    tokens, blocks, offsets = written_slots(slot_mapping, num_blocks, block_size)
    slots = encode_slots(key[tokens], value[tokens], preset, PiT, midpoints)
    kv_cache[..., :preset.slot_size][blocks, offsets] = slots
