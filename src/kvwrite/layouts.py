"""Cache layouts and allocation (docs/ops/reshape_and_cache_flash.md).

Every cache is the same *logical* tensor ``[num_blocks, block_size, H, D]``; layouts differ only in
strides, and every implementation works from strides alone.

=========  ===============================  ======================================================
layout     physical order of one cache      strides (block, slot, head) in elements
=========  ===============================  ======================================================
NHD        ``[num_blocks, block_size, H, D]``  ``(bs*H*D*k, H*D*p, D*p)``
HND        ``[num_blocks, H, block_size, D]``  ``(bs*H*D*k, D*p, bs*D*p)``
=========  ===============================  ======================================================

How K and V share memory (:class:`KVAlloc`): ``SEPARATE`` (two allocations, k=1, p=1),
``INTERLEAVED`` (one allocation ``[num_blocks, 2, ...]``, K and V blocks alternate: k=2, p=1;
this is what :func:`create_kv_caches_with_random_flash` returns) and ``PACKED`` (one allocation
whose last dim is ``2*D``; the key cache is ``[..., :D]`` and the value cache ``[..., D:]``: p=2).

PACKED is vLLM's per-layer serving cache: a ``(num_blocks, H, block_size, 2*D)`` logical tensor
whose callers pass ``kv.transpose(1, 2).split(D, -1)`` as (key_cache, value_cache), in one of its
stride orders; the two a single layer's allocation takes by default are LBNHC (the default:
physical ``[num_blocks, block_size, H, 2*D]``, NHD + PACKED, benchmark name "packed") and LBHNC
(FlashInfer's order on SM100: physical ``[num_blocks, H, block_size, 2*D]``, HND + PACKED,
benchmark name "HND-packed").
"""

from __future__ import annotations

import enum

import torch

from . import formats
from .dtypes import FP8_MAX, CacheDType, parse_kv_cache_dtype, parse_model_dtype

__all__ = [
    "written_slots",
    "Layout",
    "KVAlloc",
    "parse_layout",
    "LAYOUT_NAMES",
    "LAYOUT_ALIASES",
    "layout_alloc",
    "parse_layout_names",
    "layout_name",
    "allocate_kv_cache",
    "fill_uniform",
    "create_kv_caches_with_random_flash",
]


class Layout(enum.Enum):
    NHD = "NHD"
    HND = "HND"


class KVAlloc(enum.Enum):
    SEPARATE = "separate"
    INTERLEAVED = "interleaved"
    PACKED = "packed"


# The benchmark's layout names: NHD and HND with K and V blocks interleaved in one allocation (as
# vLLM's benchmark allocates them), and vLLM's two default per-layer serving orders, K|V packed in
# the last dim: "packed" (LBNHC) and "HND-packed" (LBHNC).
LAYOUT_NAMES = ("NHD", "HND", "packed", "HND-packed")
# Other accepted spellings -> the name results carry (vLLM's KVCacheLayout names among them).
LAYOUT_ALIASES = {"LBNHC": "packed", "NHD-packed": "packed", "LBHNC": "HND-packed"}
_ALLOCS = {"NHD": (Layout.NHD, KVAlloc.INTERLEAVED), "HND": (Layout.HND, KVAlloc.INTERLEAVED),
           "packed": (Layout.NHD, KVAlloc.PACKED), "HND-packed": (Layout.HND, KVAlloc.PACKED)}


def _expected(names) -> str:
    return (f"{', '.join(names)} (or {', '.join(a for a, n in LAYOUT_ALIASES.items() if n in names)})"
            if any(n in names for n in LAYOUT_ALIASES.values()) else ", ".join(names))


def layout_alloc(name: str) -> tuple[Layout, KVAlloc]:
    """The cache layout and allocation of a benchmark layout name (one of ``LAYOUT_NAMES`` or
    ``LAYOUT_ALIASES``)."""
    found = _ALLOCS.get(LAYOUT_ALIASES.get(name, name))
    if found is None:
        raise ValueError(f"layout: expected one of {_expected(LAYOUT_NAMES)}, got {name!r}")
    return found


def layout_name(layout: Layout, alloc: KVAlloc) -> str:
    """The benchmark name of (layout, allocation), or ``"<layout>-<allocation>"`` for the others."""
    if alloc is KVAlloc.PACKED and layout is Layout.NHD:
        return "packed"
    if alloc is KVAlloc.INTERLEAVED:
        return layout.value
    return f"{layout.value}-{alloc.value}"


def parse_layout_names(text: str, flag: str, allowed=LAYOUT_NAMES, why: str = "") -> list[str]:
    """A ``--layouts`` comma list: each item one of ``allowed`` (a subset of ``LAYOUT_NAMES``) or
    an alias of one, or ``all`` (every allowed name); returns the names results carry, in the
    order given, duplicates dropped. A layout the op cannot write (or an unknown name) raises
    ValueError naming ``flag``, the names ``allowed`` and ``why`` (what the op writes instead)."""
    raw = [x.strip() for x in str(text).split(",")]
    if not all(raw):
        raise ValueError(f"{flag}: expected a comma list without empty items, got {text!r}")
    out: list[str] = []
    for item in raw:
        names = list(allowed) if item == "all" else [LAYOUT_ALIASES.get(item, item)]
        for name in names:
            if name not in allowed:
                known = "" if name in LAYOUT_NAMES else "unknown "
                raise ValueError(f"{flag}: expected a comma list of {_expected(allowed)} or all"
                                 f"{why}, got {known}{item!r}")
            if name not in out:
                out.append(name)
    return out


def parse_layout(layout: str | Layout) -> Layout:
    if isinstance(layout, Layout):
        return layout
    try:
        return Layout(str(layout).upper())
    except ValueError:
        raise ValueError(f"cache_layout: expected 'NHD' or 'HND', got {layout!r}") from None


def allocate_kv_cache(num_blocks: int, block_size: int, num_heads: int, head_size: int,
                      dtype: torch.dtype, layout: Layout = Layout.NHD,
                      alloc: KVAlloc = KVAlloc.SEPARATE, device: str | torch.device = "cuda",
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized (key_cache, value_cache), each a logical ``[num_blocks, block_size, H, D]`` view."""
    nb, bs, h, d = num_blocks, block_size, num_heads, head_size
    # Physical shapes list dims in memory order; `perm` maps them back to the logical order.
    if alloc is KVAlloc.SEPARATE:
        shape = (nb, bs, h, d) if layout is Layout.NHD else (nb, h, bs, d)
        perm = (0, 1, 2, 3) if layout is Layout.NHD else (0, 2, 1, 3)
        k = torch.empty(shape, dtype=dtype, device=device).permute(*perm)
        v = torch.empty(shape, dtype=dtype, device=device).permute(*perm)
        return k, v
    if alloc is KVAlloc.INTERLEAVED:
        shape = (nb, 2, bs, h, d) if layout is Layout.NHD else (nb, 2, h, bs, d)
        perm = (0, 1, 2, 3, 4) if layout is Layout.NHD else (0, 1, 3, 2, 4)
        kv = torch.empty(shape, dtype=dtype, device=device).permute(*perm)
        return kv[:, 0], kv[:, 1]
    shape = (nb, bs, h, 2 * d) if layout is Layout.NHD else (nb, h, bs, 2 * d)
    perm = (0, 1, 2, 3) if layout is Layout.NHD else (0, 2, 1, 3)
    kv = torch.empty(shape, dtype=dtype, device=device).permute(*perm)
    return kv[..., :d], kv[..., d:]


def fill_uniform(cache: torch.Tensor, cache_dtype: CacheDType, lo: float, hi: float,
                 generator: torch.Generator | None) -> None:
    """Uniform values in [lo, hi); fp8 caches get valid fp8 bits (never a NaN pattern)."""
    if not cache_dtype.is_fp8:
        cache.uniform_(lo, hi, generator=generator)
        return
    fp8 = cache_dtype.fp8_dtype
    # A block range at a time: float32 temporaries of the whole cache would need 4x its size.
    per_block = max(1, cache[:1].numel())
    step = max(1, (64 << 20) // per_block)
    for start in range(0, cache.shape[0], step):
        part = cache[start:start + step]
        vals = torch.empty(part.shape, dtype=torch.float32, device=cache.device)
        vals.uniform_(lo, hi, generator=generator)
        bits = vals.clamp_(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)
        part.copy_(bits.view(torch.uint8) if cache.dtype == torch.uint8 else bits)


def _cache_torch_dtype(cache_dtype: CacheDType, model_dtype) -> torch.dtype:
    if cache_dtype is not CacheDType.AUTO:
        return formats.lookup(cache_dtype.value).storage[0]  # vLLM's: uint8 for fp8
    if model_dtype is None:
        raise ValueError("model_dtype: required when cache_dtype is 'auto', got None")
    return parse_model_dtype(model_dtype, "model_dtype")


def create_kv_caches_with_random_flash(num_blocks: int, block_size: int, num_layers: int,
                                       num_heads: int, head_size: int, cache_dtype: str,
                                       model_dtype=None, seed: int | None = None,
                                       device: str | torch.device = "cuda",
                                       cache_layout: str = "NHD",
                                       ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random key and value caches for ``num_layers`` layers, as vLLM's function of this name.

    Each layer is one allocation ``(num_blocks, 2, block_size, H, D)`` (NHD) or
    ``(num_blocks, 2, H, block_size, D)`` (HND), so K and V blocks interleave; the returned caches
    are its logical ``[num_blocks, block_size, H, D]`` halves. ``cache_dtype`` "auto" takes
    ``model_dtype``; fp8 caches are ``torch.uint8`` holding valid fp8 values; values are uniform in
    ``[-head_size**-0.5, head_size**-0.5)``. A ``seed`` makes the result reproducible.

    ``cache_dtype`` "nvfp4" / "nvfp4_4over6" (``head_size % 16 == 0``): vLLM's NVFP4 page layout,
    uint8 ``(num_blocks, 2, block_size, H, F)`` (NHD) or ``(num_blocks, 2, H, block_size, F)``
    (HND) with ``F = D/2 + D/16``, random bytes; the caches are its logical
    ``[num_blocks, block_size, H, F]`` halves, so the V side of a block follows its K side
    (docs/ops/nvfp4.md). ``model_dtype`` is not used there.
    """
    cdt = parse_kv_cache_dtype(cache_dtype, nvfp4=True)
    layout = parse_layout(cache_layout)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    if cdt.is_nvfp4:
        return _nvfp4_caches(num_blocks, block_size, num_layers, num_heads, head_size, layout,
                             generator, device)
    dtype = _cache_torch_dtype(cdt, model_dtype)
    scale = head_size**-0.5
    key_caches, value_caches = [], []
    for _ in range(num_layers):
        k, v = allocate_kv_cache(num_blocks, block_size, num_heads, head_size, dtype, layout,
                                 KVAlloc.INTERLEAVED, device)
        fill_uniform(k, cdt, -scale, scale, generator)
        fill_uniform(v, cdt, -scale, scale, generator)
        key_caches.append(k)
        value_caches.append(v)
    return key_caches, value_caches


def _nvfp4_caches(num_blocks: int, block_size: int, num_layers: int, num_heads: int,
                  head_size: int, layout: Layout, generator: torch.Generator | None,
                  device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """create_kv_caches_with_random_flash's NVFP4 caches: random bytes in vLLM's page layout."""
    if head_size < 16 or head_size % 16:
        raise ValueError(f"head_size: the NVFP4 cache dtypes need a positive multiple of 16, got "
                         f"{head_size}")
    f = formats.lookup("nvfp4").row_bytes(head_size)  # D/2 + D/16, both NVFP4 modes
    nb, bs, h = num_blocks, block_size, num_heads
    shape = (nb, 2, bs, h, f) if layout is Layout.NHD else (nb, 2, h, bs, f)
    perm = (0, 1, 2, 3, 4) if layout is Layout.NHD else (0, 1, 3, 2, 4)
    key_caches, value_caches = [], []
    for _ in range(num_layers):
        kv = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=generator)
        kv = kv.permute(*perm)
        key_caches.append(kv[:, 0])
        value_caches.append(kv[:, 1])
    return key_caches, value_caches


def written_slots(slot_mapping: torch.Tensor, num_blocks: int, block_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The write ops' slot rule, for the torch references: (tokens, blocks, offsets) of the
    tokens whose slot is in ``[0, num_blocks * block_size)`` (padding, slot < 0, and
    out-of-range slots are not written), their cache block ``slot // block_size`` and offset in
    it ``slot % block_size`` (int64). Syncs with the host (the count of written tokens)."""
    slots = slot_mapping.long()
    keep = (slots >= 0) & (slots < num_blocks * block_size)
    tokens = torch.arange(slots.numel(), device=slots.device)[keep]
    slots = slots[keep]
    return tokens, slots // block_size, slots % block_size
