"""The allocator and the reader of per-token-head quantized caches: vLLM's three layouts
(packed, interleaved, separate) in NHD or HND order, and the dequantization the attention
kernel applies when it reads a row back."""

from __future__ import annotations

import torch

from ...layouts import KVAlloc, Layout, parse_layout
from ...validation import check_slot_dtype, require_tensor
from ...validation import shape_str as _shape
from .op import PerTokenHeadMode, parse_kv_quant_mode

__all__ = ["create_per_token_head_caches", "dequantize_per_token_head", "parse_kv_alloc"]

_INT4_SCALE_MASK = -16  # 0xFFFFFFF0 as an int32


def parse_kv_alloc(kv_alloc) -> KVAlloc:
    if isinstance(kv_alloc, KVAlloc):
        return kv_alloc
    try:
        return KVAlloc(str(kv_alloc).lower())
    except ValueError:
        raise ValueError(f"kv_alloc: expected 'packed', 'interleaved' or 'separate', got "
                         f"{kv_alloc!r}") from None


def _positive(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}: expected a positive integer, got {v!r}")
    return v


def create_per_token_head_caches(num_blocks: int, block_size: int, num_heads: int,
                                 head_size: int, kv_quant_mode, *, cache_layout="NHD",
                                 kv_alloc="packed", device: str | torch.device = "cuda",
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(key_cache, value_cache, k_scale_cache, v_scale_cache)`` for
    :func:`reshape_and_cache_flash_per_token_head_quant`, data bytes 0 and scales 1.0.

    Data caches are logical ``[num_blocks, block_size, H, Dq]`` (``Dq = head_size``, or
    ``head_size / 2`` for int4) of int8 (int8 mode) or uint8 (fp8, int4), scale caches float32
    ``[num_blocks, block_size, H]``. ``cache_layout`` "NHD" or "HND" orders (slot, head) in
    memory; ``kv_alloc``:

    - "packed": one allocation of bytes ``[nb, bs, H, 2 (Dq + 4)]`` (HND ``[nb, H, bs, ...]``),
      each row K codes, K scale, V codes, V scale;
    - "interleaved": one allocation ``[nb, 2, bs, H, Dq + 4]`` (HND ``[nb, 2, H, bs, Dq + 4]``),
      K and V blocks alternating, each row codes then scale;
    - "separate": four allocations, data ``[nb, bs, H, Dq]`` and scales ``[nb, bs, H]`` (HND:
      permuted from ``[nb, H, bs, ...]``).

    The inline layouts need ``Dq % 4 == 0`` (the scales are aligned float32 values).
    """
    mode = parse_kv_quant_mode(kv_quant_mode) if kv_quant_mode is not None else None
    if mode is None:
        raise ValueError("kv_quant_mode: expected one of ['fp8_per_token_head', "
                         "'int4_per_token_head', 'int8_per_token_head'], got None")
    nb = _positive("num_blocks", num_blocks)
    bs = _positive("block_size", block_size)
    h = _positive("num_heads", num_heads)
    d = _positive("head_size", head_size)
    layout = parse_layout(cache_layout)
    alloc = parse_kv_alloc(kv_alloc)
    if mode.is_int4 and d % 2:
        raise ValueError(f"head_size: kv_quant_mode={mode.value!r} packs two elements per byte "
                         f"and needs an even head size, got {d}")
    fmt = mode.format  # the row: Dq code bytes, then (inline layouts) the float32 scale
    dq = fmt.data_bytes(d)
    dtype = fmt.storage[0]
    hnd = layout is Layout.HND
    if alloc is KVAlloc.SEPARATE:
        def data():
            shape = (nb, h, bs, dq) if hnd else (nb, bs, h, dq)
            t = torch.zeros(shape, dtype=dtype, device=device)
            return t.permute(0, 2, 1, 3) if hnd else t

        def scales():
            shape = (nb, h, bs) if hnd else (nb, bs, h)
            t = torch.ones(shape, dtype=torch.float32, device=device)
            return t.permute(0, 2, 1) if hnd else t

        return data(), data(), scales(), scales()
    if dq % 4:
        raise ValueError(f"head_size: kv_alloc={alloc.value!r} stores each float32 scale right "
                         f"after its row's {dq} code bytes and needs them to be a multiple of 4 "
                         f"(int4: head_size a multiple of 8), got head_size {d}")
    row = fmt.row_bytes(d)
    if alloc is KVAlloc.PACKED:
        shape = (nb, h, bs, 2 * row) if hnd else (nb, bs, h, 2 * row)
        raw = torch.zeros(shape, dtype=torch.uint8, device=device)
        if hnd:
            raw = raw.permute(0, 2, 1, 3)
        f32 = raw.view(torch.float32)  # [nb, bs, H, 2 row / 4]
        k_scale, v_scale = f32[..., dq // 4], f32[..., (row + dq) // 4]
        k_data, v_data = raw[..., :dq], raw[..., row:row + dq]
    else:
        shape = (nb, 2, h, bs, row) if hnd else (nb, 2, bs, h, row)
        raw = torch.zeros(shape, dtype=torch.uint8, device=device)
        if hnd:
            raw = raw.permute(0, 1, 3, 2, 4)
        f32 = raw.view(torch.float32)
        k_scale, v_scale = f32[:, 0, ..., dq // 4], f32[:, 1, ..., dq // 4]
        k_data, v_data = raw[:, 0, ..., :dq], raw[:, 1, ..., :dq]
    k_scale.fill_(1.0)
    v_scale.fill_(1.0)
    return k_data.view(dtype), v_data.view(dtype), k_scale, v_scale


def dequantize_per_token_head(cache: torch.Tensor, scale_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, kv_quant_mode,
                              head_size: int | None = None) -> torch.Tensor:
    """The rows at ``slot_mapping``'s slots read back as float32 ``[N, H, D]``, as the attention
    kernel reads them: int8 ``RN(q * s)``; fp8 ``RN(e4m3(code) * s)``; int4
    ``RN((q - zp) * s')`` with ``zp`` the scale entry's low 4 bits and ``s'`` the entry with them
    cleared (even element in a byte's low nibble).

    ``cache`` ``[num_blocks, block_size, H, E]`` and ``scale_cache`` ``[num_blocks, block_size, H]``
    float32 as the op writes them; ``slot_mapping`` ``[N]`` int64 or int32, every slot in range
    (checked here, with a host sync); ``head_size`` defaults to ``E`` (int8, fp8) or ``2 E``
    (int4); ``kv_quant_mode`` as the op's (None infers int8 or fp8 from ``cache.dtype``).
    """
    for name, t in (("cache", cache), ("scale_cache", scale_cache),
                    ("slot_mapping", slot_mapping)):
        require_tensor(name, t)
    mode = parse_kv_quant_mode(kv_quant_mode, cache.dtype, "cache")
    if cache.dim() != 4:
        raise ValueError(f"cache: expected 4 dims [num_blocks, block_size, num_heads, E], got "
                         f"shape {_shape(cache)}")
    if cache.dtype not in mode.cache_dtypes:
        names = " or ".join(str(x) for x in mode.cache_dtypes)
        raise ValueError(f"cache: kv_quant_mode={mode.value!r} expects a cache of dtype {names}, "
                         f"got {cache.dtype}")
    nb, bs, h, e = cache.shape
    if scale_cache.dtype != torch.float32:
        raise ValueError(f"scale_cache: expected dtype float32, got {scale_cache.dtype}")
    if tuple(scale_cache.shape) != (nb, bs, h):
        raise ValueError(f"scale_cache: expected shape [num_blocks, block_size, num_heads] = "
                         f"{[nb, bs, h]} (that of cache), got {_shape(scale_cache)}")
    if head_size is None:
        head_size = int(e / mode.format.element_bytes())  # E code bytes: E or 2 E elements
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size < 1:
        raise ValueError(f"head_size: expected a positive integer or None, got {head_size!r}")
    if mode.is_int4 and head_size % 2:
        raise ValueError(f"head_size: kv_quant_mode={mode.value!r} needs an even head size, got "
                         f"{head_size}")
    dq = mode.quantized_size(head_size)
    if dq > e:
        raise ValueError(f"head_size: {head_size} needs {dq} code bytes per row, but cache rows "
                         f"hold {e} (shape {_shape(cache)})")
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping: expected 1 dim [N], got shape {_shape(slot_mapping)}")
    check_slot_dtype("slot_mapping", slot_mapping)
    for name, t in (("scale_cache", scale_cache), ("slot_mapping", slot_mapping)):
        if t.device != cache.device:
            raise ValueError(f"{name}: expected device {cache.device} (that of cache), got {t.device}")
    slots = slot_mapping.long()
    bad = (slots < 0) | (slots >= nb * bs)
    if bool(bad.any()):
        pos = torch.nonzero(bad).flatten()[:8].tolist()
        raise ValueError(f"slot_mapping: expected every slot in [0, {nb * bs}) (num_blocks * "
                         f"block_size), got {int(bad.sum())} outside it, at positions {pos} "
                         f"(slots {slots[pos].tolist()})")
    blocks, offsets = slots // bs, slots % bs
    codes = cache[..., :dq].view(torch.uint8)[blocks, offsets]  # [N, H, Dq]
    entry = scale_cache[blocks, offsets]  # [N, H]
    if mode is PerTokenHeadMode.INT8_PER_TOKEN_HEAD:
        return codes.view(torch.int8).float() * entry[..., None]
    if mode is PerTokenHeadMode.FP8_PER_TOKEN_HEAD:
        return codes.view(torch.float8_e4m3fn).float() * entry[..., None]
    bits = entry.view(torch.int32)
    zp = (bits & 15).float()
    s = (bits & _INT4_SCALE_MASK).view(torch.float32)
    q = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(*codes.shape[:-1], 2 * dq)
    return (q.float() - zp[..., None]) * s[..., None]
