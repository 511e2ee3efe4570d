"""What the five gathers share (docs/ops/gather.md): the checks of their index tensors, the row
rule and the fp8 read rule in PyTorch (the references use them), and the bit views of a copy.

The row rule: request ``r < B`` owns the output rows ``[a_r, e_r)`` and reads positions
``p = s_r + (t - a_r)`` of its sequence; ``a_r = starts[r]``, ``e_r = starts[r + 1]`` for
``cu_seq_lens`` (B + 1 entries), or for ``workspace_starts`` (B entries) ``e_{B-1} = T_out``;
``s_r = seq_starts[r]`` or 0. Position ``p`` is slot ``p mod bs`` of block
``block_table[r, p div bs]``. Row ``t`` is written iff ``0 <= t < T_out``, ``p >= 0``,
``p div bs < block_table.size(1)`` and the block id lies in ``[0, num_blocks)``; every other row
keeps its bytes. Which of two requests owning one row wins is undefined.

The fp8 read rule ``D(c, s)``: decode the code exactly to float32, multiply by the float32 scale
once, round to nearest even to the output dtype (overflow gives ±inf).
"""

from __future__ import annotations

import torch

from .dtypes import FLOAT8_FORMAT
from .validation import check_slot_dtype, require_tensor
from .validation import shape_str as _shape

__all__ = ["INDEX_DTYPES", "check_index", "check_requests", "request_rows",
           "fp8_dequant", "bits_view", "FP8_CODE_DTYPES", "check_scale", "entry_dims"]

INDEX_DTYPES = (torch.int32, torch.int64)
# The dtype of a cache that holds fp8 codes, for each float8 format: uint8 (vLLM's storage) or the
# float8 dtype itself.
FP8_CODE_DTYPES = {f: (torch.uint8, f) for f in FLOAT8_FORMAT}


def check_index(name: str, t, dims: int, min_len: int, what: str, device: torch.device,
                device_of: str) -> None:
    """An int32/int64 index tensor of ``dims`` dims with at least ``min_len`` entries along dim 0
    (``what`` says why), on ``device`` (that of ``device_of``); any strides."""
    require_tensor(name, t)
    if t.dim() != dims:
        shape = "[n]" if dims == 1 else "[n, max_blocks]"
        raise ValueError(f"{name}: expected {dims} dim{'s' if dims > 1 else ''} {shape}, got shape "
                         f"{_shape(t)}")
    check_slot_dtype(name, t)
    if t.shape[0] < min_len:
        raise ValueError(f"{name}: expected at least {min_len} entries along dim 0 ({what}), got "
                         f"shape {_shape(t)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (that of {device_of}), got {t.device}")


def check_requests(*, block_table, starts, starts_name: str, num_req: int, seq_starts,
                   device: torch.device, device_of: str, workspace: bool = False) -> None:
    """The row rule's index tensors: ``starts`` (cu_seq_lens with at least B + 1 entries, or
    workspace_starts with at least B), ``seq_starts`` (None or at least B), ``block_table``
    (2 dims, at least B rows)."""
    n = num_req if workspace else num_req + 1
    check_index(starts_name, starts, 1, n, f"{'B' if workspace else 'B + 1'} = {n}", device,
                device_of)
    if seq_starts is not None:
        check_index("seq_starts", seq_starts, 1, num_req, f"one per request, B = {num_req}",
                    device, device_of)
    check_index("block_table", block_table, 2, num_req, f"one row per request, B = {num_req}",
                device, device_of)


def check_scale(name: str, scale, mode_value: str, device: torch.device, device_of: str,
                counts: tuple[int, ...] = (1,)) -> None:
    """An fp8 mode's scale: a float32 tensor on ``device`` with one of ``counts`` elements."""
    if scale is None:
        raise ValueError(f"{name}: kv_cache_dtype={mode_value!r} needs a float32 tensor of "
                         f"{' or '.join(map(str, counts))} element{'s' if counts != (1,) else ''}, "
                         f"got None")
    require_tensor(name, scale)
    if scale.dtype != torch.float32:
        raise ValueError(f"{name}: expected dtype float32, got {scale.dtype}")
    if scale.numel() not in counts:
        what = "1 element (one per-tensor scale)" if counts == (1,) else \
            f"1 (per tensor) or {counts[1]} (per head) elements"
        raise ValueError(f"{name}: expected {what}, got {scale.numel()}")
    if scale.device != device:
        raise ValueError(f"{name}: expected device {device} (that of {device_of}), got "
                         f"{scale.device}")
    if scale.numel() > 1 and not scale.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(scale.stride())}")


def request_rows(starts: torch.Tensor, seq_starts: torch.Tensor | None, block_table: torch.Tensor,
                 num_req: int, t_out: int, block_size: int, num_blocks: int,
                 workspace: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows the rule writes: ``(t, block, offset)``, int64 tensors on the block table's
    device, one entry per written row (a row owned twice may appear twice). Syncs with the host
    (the row count), so it is for the references, not for graphs."""
    dev = block_table.device
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    if num_req == 0 or t_out == 0:
        return empty, empty, empty
    a = starts[:num_req].long()
    if workspace:
        e = torch.cat([starts[1:num_req].long(),
                       torch.full((1,), t_out, dtype=torch.int64, device=dev)])
    else:
        e = starts[1:num_req + 1].long()
    lo, hi = a.clamp(0, t_out), e.clamp(0, t_out)
    n = (hi - lo).clamp_min(0)
    r = torch.repeat_interleave(torch.arange(num_req, device=dev), n)
    first = torch.cumsum(n, 0) - n
    t = lo[r] + torch.arange(r.numel(), device=dev) - first[r]
    s = seq_starts[:num_req].long()[r] if seq_starts is not None else torch.zeros_like(t)
    p = s + (t - a[r])
    bi = torch.div(p, block_size, rounding_mode="floor")
    max_blocks = block_table.shape[1]
    ok = (p >= 0) & (bi < max_blocks)
    if max_blocks == 0:
        return empty, empty, empty
    blk = block_table[r, bi.clamp(0, max_blocks - 1)].long()
    ok &= (blk >= 0) & (blk < num_blocks)
    return t[ok], blk[ok], (p - bi * block_size)[ok]


def fp8_dequant(codes: torch.Tensor, fp8_dtype: torch.dtype, scale: torch.Tensor | float,
                out_dtype: torch.dtype) -> torch.Tensor:
    """``D(c, s)`` element by element: ``codes`` (uint8 or the float8 dtype) decoded as
    ``fp8_dtype``, times ``scale`` (a float32 tensor broadcast against them) in float32, rounded to
    ``out_dtype``."""
    x = codes.view(fp8_dtype) if codes.dtype == torch.uint8 else codes
    return (x.float() * scale).to(out_dtype)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size (1, 2, 4 or 8 bytes; other sizes unchanged), so
    a copy moves bits (NaN payloads included), whatever the strides."""
    dt = _BITS.get(t.element_size())
    return t if dt is None or t.dtype == dt else t.view(dt)


def entry_dims(shape, src_strides, dst_strides) -> tuple[int, list[tuple[int, int, int]]]:
    """An entry's dims coalesced: ``(run, outer)``, where ``run`` elements are contiguous in both
    the cache and the output (1 when the innermost dim is not), and ``outer`` lists the other dims
    as ``(size, src_stride, dst_stride)`` in elements, innermost first. Dims of size 1 are dropped;
    neighbours whose strides chain in both tensors merge."""
    merged: list[tuple[int, int, int]] = []
    for n, s, d in reversed([x for x in zip(shape, src_strides, dst_strides, strict=True)
                             if x[0] != 1]):
        if merged and s == merged[-1][1] * merged[-1][0] and d == merged[-1][2] * merged[-1][0]:
            merged[-1] = (merged[-1][0] * n, merged[-1][1], merged[-1][2])
        else:
            merged.append((n, s, d))
    if merged and merged[0][1] == 1 and merged[0][2] == 1:
        return merged[0][0], merged[1:]
    return 1, merged
