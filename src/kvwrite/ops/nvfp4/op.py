"""NVFP4 cache writes: validation and dispatch of ``reshape_and_cache_flash(..., "nvfp4" |
"nvfp4_4over6")`` (vLLM's page layout) and of
:func:`nvfp4_quantize_append_paged_kv_cache_with_slot_mapping` (FlashInfer's separate data and
scale tensors), and the torch.compile custom op of the latter (docs/ops/nvfp4.md).

Both entry points become one internal op, :data:`OP`, whose implementations all take the same
arguments (``run_args``): the inputs, four byte views of the cache (K data, K scales, V data, V
scales, each a logical ``[num_blocks, block_size, H, n]`` uint8 view with a unit last stride),
the slots, the rule, the two scales and the V scales' layout. vLLM's page layout is four such
views of its two caches; FlashInfer's tensors are them already.
"""

from __future__ import annotations

import enum
import functools
import math
import numbers

import torch

from ... import formats, registry
from ...dtypes import INPUT_DTYPES, CacheDType, parse_kv_cache_dtype
from ...validation import (
    check_like,
    check_mutation_safe,
    check_token_indices,
    require_same_device,
    require_tensor,
)
from ...validation import shape_str as _shape
from .rule import GROUP

__all__ = ["OP", "ScaleLayout", "parse_scale_layout", "default_v_scale_layout", "page_bytes",
           "region_bytes",
           "flash_run_args", "append_run_args", "write_flash",
           "nvfp4_quantize_append_paged_kv_cache_with_slot_mapping", "select_implementation",
           "float32_scale"]

OP = "nvfp4_kv_write"


class ScaleLayout(enum.Enum):
    """Where a side's scale bytes go in its scale region (docs/ops/nvfp4.md): ``LINEAR`` (token
    row, then group) or ``SWIZZLED`` (V only: the 4-token swizzle of SM100's trtllm-gen)."""

    LINEAR = "linear"
    SWIZZLED = "swizzled"


def parse_scale_layout(layout, name: str = "v_scale_layout") -> ScaleLayout:
    if isinstance(layout, ScaleLayout):
        return layout
    if isinstance(layout, str):
        try:
            return ScaleLayout(layout)
        except ValueError:
            pass
    raise ValueError(f"{name}: expected None, 'linear' or 'swizzled', got {layout!r}")


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def default_v_scale_layout(device: torch.device | str) -> ScaleLayout:
    """vLLM's rule for the device: linear V scales on a CUDA device of compute capability major
    12 or more, the 4-token swizzle everywhere else (CPU, sm80, sm90, sm100)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if _capability_major(index) >= 12:
            return ScaleLayout.LINEAR
    return ScaleLayout.SWIZZLED


# Both NVFP4 modes share one page geometry: the "nvfp4" format's (kvwrite.formats).
_FORMAT = formats.lookup("nvfp4")


def page_bytes(head_size: int) -> int:
    """F = D/2 + D/16: the bytes of one (token, head) in vLLM's NVFP4 page layout."""
    return _FORMAT.row_bytes(head_size)


def region_bytes(head_size: int) -> tuple[int, int]:
    """(D/2, D/16): the bytes one (token, head) takes in a block side's data region and in its
    scale region."""
    return _FORMAT.data_bytes(head_size), _FORMAT.scale_bytes(head_size)


def float32_scale(name: str, k) -> float | torch.Tensor:
    """A Python number rounded to float32 (ValueError unless positive and finite, before and
    after the rounding), or a one-element float32 tensor (returned as it is)."""
    if isinstance(k, torch.Tensor):
        return k
    if isinstance(k, bool) or not isinstance(k, numbers.Real):
        raise TypeError(f"{name}: expected a Python number or a one-element float32 tensor, got "
                        f"{type(k).__name__}")
    v = float(k)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name}: expected a positive finite number, got {k!r}")
    r = torch.tensor(v, dtype=torch.float32).item()  # nearest even
    if not (math.isfinite(r) and r > 0):
        raise ValueError(f"{name}: expected a number whose float32 rounding is positive and "
                         f"finite, got {k!r} (float32: {r!r})")
    return r


# --- the inputs (both entry points) ----------------------------------------------------------------

def _check_inputs(key, value, names: tuple[str, str], head_what: str) -> tuple[int, int, int]:
    """``key``/``value`` as both NVFP4 writers take them (docs/ops/nvfp4.md); returns
    (T_pad, H, D)."""
    kn, vn = names
    require_tensor(kn, key)
    require_tensor(vn, value)
    if key.dim() != 3:
        raise ValueError(f"{kn}: expected 3 dims [num_tokens, num_heads, head_size], got shape "
                         f"{_shape(key)}")
    check_like(vn, value, kn, key, "shape")
    if key.dtype not in INPUT_DTYPES:
        raise ValueError(f"{kn}: expected dtype float16, bfloat16 or float32, got {key.dtype}")
    check_like(vn, value, kn, key, "dtype")
    t_pad, num_heads, head_size = key.shape
    if head_size < GROUP or head_size % GROUP:
        raise ValueError(f"{kn}: {head_what} needs head_size a positive multiple of {GROUP}, got "
                         f"{head_size}")
    if num_heads < 1:
        raise ValueError(f"{kn}: expected num_heads >= 1, got shape {_shape(key)}")
    for name, t in ((kn, key), (vn, value)):
        if t.stride(2) != 1 or num_heads > 1 and t.stride(1) != head_size:
            raise ValueError(f"{name}: expected dense heads (stride(2) == 1, stride(1) == "
                             f"head_size = {head_size}), got strides {tuple(t.stride())}")
    return t_pad, num_heads, head_size


def _check_slots(slot_mapping, t_pad: int, kn: str) -> None:
    require_tensor("slot_mapping", slot_mapping)
    check_token_indices("slot_mapping", slot_mapping, t_pad, f"{kn}.shape[0]")


def _check_scale_tensor(name: str, s, device: torch.device, what: str) -> None:
    if s.dtype != torch.float32:
        raise ValueError(f"{name}: expected dtype float32, got {s.dtype}")
    if s.numel() != 1 or s.dim() > 1:
        raise ValueError(f"{name}: expected exactly one element (shape [] or [1]; {what}), got "
                         f"shape {_shape(s)}")
    if s.device != device:
        raise ValueError(f"{name}: expected device {device} (that of the caches), got {s.device}")


# --- reshape_and_cache_flash in the NVFP4 modes: vLLM's page layout --------------------------------

def _page_layout(cache: torch.Tensor, name: str) -> bool:
    """Whether the inner dims of a logical [nb, bs, H, F] uint8 cache are dense NHD (True) or
    HND (False); ValueError naming ``name`` otherwise. Dims of size 1 take any stride; where
    H == 1 or bs == 1 the two orders are the same bytes."""
    nb, bs, h, f = cache.shape
    st = cache.stride()

    def fits(block_size_stride, head_stride) -> bool:
        return ((f == 1 or st[3] == 1) and (bs == 1 or st[1] == block_size_stride)
                and (h == 1 or st[2] == head_stride))

    if fits(h * f, f):
        nhd = True
    elif fits(f, bs * f):
        nhd = False
    else:
        raise ValueError(
            f"{name}: expected a logical [num_blocks, block_size, H, F] view whose inner dims are "
            f"dense NHD (strides (s0, {h * f}, {f}, 1)) or HND (strides (s0, {f}, {bs * f}, 1)), "
            f"got strides {tuple(st)} for shape {_shape(cache)} (physically shaped HND caches "
            f"must be permuted to the logical order)")
    if nb > 1 and st[0] < bs * h * f:
        raise ValueError(f"{name}: expected a block stride s0 >= block_size * H * F = "
                         f"{bs * h * f} bytes, got strides {tuple(st)}")
    return nhd


def _region_view(cache: torch.Tensor, nhd: bool, per_head: int, region_offset: int) -> torch.Tensor:
    """The logical [nb, bs, H, per_head] byte view of one region of each block side."""
    nb, bs, h, _ = cache.shape
    stride = (cache.stride(0), h * per_head if nhd else per_head,
              per_head if nhd else bs * per_head, 1)
    return cache.as_strided((nb, bs, h, per_head), stride, cache.storage_offset() + region_offset)


def flash_run_args(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                   v_scale, v_scale_layout=None) -> tuple:
    """Validate ``reshape_and_cache_flash``'s arguments in the NVFP4 modes (docs/ops/nvfp4.md)
    and return the internal op's ``run`` arguments; raises TypeError/ValueError naming the
    argument before anything is written."""
    cache_dtype = parse_kv_cache_dtype(kv_cache_dtype, nvfp4=True)
    if not cache_dtype.is_nvfp4:
        raise ValueError(f"kv_cache_dtype: expected 'nvfp4' or 'nvfp4_4over6', got "
                         f"{cache_dtype.value!r}")
    mode = f"kv_cache_dtype={cache_dtype.value!r}"
    t_pad, num_heads, head_size = _check_inputs(key, value, ("key", "value"), mode)
    f = page_bytes(head_size)
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        require_tensor(name, c)
        if c.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims [num_blocks, block_size, H, F], got shape "
                             f"{_shape(c)}")
        if c.dtype != torch.uint8:
            raise ValueError(f"{name}: {mode} expects a cache of dtype torch.uint8, got {c.dtype}")
    if key_cache.shape[2:] != (num_heads, f):
        raise ValueError(f"key_cache: expected [num_blocks, block_size, {num_heads}, {f}] "
                         f"(H of key, F = D/2 + D/16 for head_size {head_size}), got shape "
                         f"{_shape(key_cache)}")
    if key_cache.shape[0] < 1 or key_cache.shape[1] < 1:
        raise ValueError(f"key_cache: expected num_blocks >= 1 and block_size >= 1, got shape "
                         f"{_shape(key_cache)}")
    check_like("value_cache", value_cache, "key_cache", key_cache, "shape", "strides")
    nhd = _page_layout(key_cache, "key_cache")
    _check_slots(slot_mapping, t_pad, "key")
    device = key.device
    require_same_device(device, "key", (("value", value), ("key_cache", key_cache),
                                        ("value_cache", value_cache),
                                        ("slot_mapping", slot_mapping)))
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"{name}: {mode} needs a one-element float32 tensor, got None")
        require_tensor(name, s)
        _check_scale_tensor(name, s, device, "one per-tensor scale: no reader applies per-head "
                                             "scales")
    if v_scale_layout is None:
        layout, why = default_v_scale_layout(device), f"the default on {device}"
    else:
        layout, why = parse_scale_layout(v_scale_layout), "asked for"
    block_size = key_cache.shape[1]
    if layout is ScaleLayout.SWIZZLED and (block_size % 4 or head_size % 64):
        raise ValueError(f"v_scale_layout: 'swizzled' ({why}) needs block_size % 4 == 0 and "
                         f"head_size % 64 == 0, got block_size {block_size} and head_size "
                         f"{head_size}; pass v_scale_layout='linear'")
    check_mutation_safe(outputs=(("key_cache", key_cache), ("value_cache", value_cache)),
                        inputs=(("key", key), ("value", value), ("slot_mapping", slot_mapping),
                                ("k_scale", k_scale), ("v_scale", v_scale)))
    row_data, row_scales = region_bytes(head_size)
    data_bytes = block_size * num_heads * row_data
    views = []
    for c in (key_cache, value_cache):
        views += [_region_view(c, nhd, row_data, 0),
                  _region_view(c, nhd, row_scales, data_bytes)]
    return (key, value, *views, slot_mapping, cache_dtype, k_scale, v_scale, layout)


def select_implementation(run_args: tuple, implementation: str | None = None
                          ) -> registry.ImplInfo:
    """The named implementation of :data:`OP`, or the preferred one that can run these ``run``
    arguments; raises ValueError saying why where none can."""
    key, k_data, cache_dtype, layout = run_args[0], run_args[2], run_args[7], run_args[10]
    return registry.select(OP, (key, k_data, cache_dtype, layout), implementation)


def write_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                v_scale, v_scale_layout=None, implementation: str | None = None) -> None:
    """``reshape_and_cache_flash`` in the NVFP4 modes (it calls this; docs/ops/nvfp4.md)."""
    args = flash_run_args(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                          k_scale, v_scale, v_scale_layout)
    info = select_implementation(args, implementation)
    if slot_mapping.numel() == 0:
        return
    info.run(*args)


# --- FlashInfer's separate tensors ---------------------------------------------------------------

def _split_kv(t, name: str, per_head: int, dtype: torch.dtype, nhd: bool, want: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) logical [P, page, H, per_head] views of a (k, v) pair or of one 5-D tensor with K/V
    on dim 1, checked: dtype, dims, last dim ``per_head`` and contiguous."""
    if isinstance(t, (tuple, list)):
        if len(t) != 2:
            raise ValueError(f"{name}: expected a tuple (k, v) or one 5-D tensor, got a "
                             f"{type(t).__name__} of {len(t)} items")
        k, v = t
        require_tensor(f"{name}[0]", k)
        require_tensor(f"{name}[1]", v)
        parts = ((f"{name}[0]", k), (f"{name}[1]", v))
        for n, x in parts:
            if x.dim() != 4:
                raise ValueError(f"{n}: expected 4 dims {want}, got shape {_shape(x)}")
        check_like(f"{name}[1]", v, f"{name}[0]", k, "shape")
    else:
        require_tensor(name, t)
        if t.dim() != 5 or t.shape[1] != 2:
            raise ValueError(f"{name}: expected a tuple (k, v) or one 5-D tensor with K/V on dim "
                             f"1 ({want.replace('[P, ', '[P, 2, ')}), got shape {_shape(t)}")
        k, v = t[:, 0], t[:, 1]
        parts = ((name, k), (name, v))
    for n, x in parts:
        if x.dtype != dtype:
            raise ValueError(f"{n}: expected dtype {dtype}, got {x.dtype}")
        if x.shape[3] != per_head:
            raise ValueError(f"{n}: expected a last dim of {per_head}, got shape {_shape(x)}")
        if per_head > 1 and x.stride(3) != 1:
            raise ValueError(f"{n}: expected a contiguous last dim, got strides "
                             f"{tuple(x.stride())}")
    if not nhd:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    if dtype != torch.uint8:
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    return k, v


def append_run_args(append_key, append_value, slot_mapping, paged_kv_cache, kv_cache_sf,
                    k_scale, v_scale, kv_layout="NHD") -> tuple:
    """Validate :func:`nvfp4_quantize_append_paged_kv_cache_with_slot_mapping`'s arguments and
    return the internal op's ``run`` arguments; raises TypeError/ValueError naming the argument
    before anything is written."""
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout: expected 'NHD' or 'HND', got {kv_layout!r}")
    nhd = kv_layout == "NHD"
    t_pad, num_heads, head_size = _check_inputs(append_key, append_value,
                                                ("append_key", "append_value"), "NVFP4")
    order = "[P, page, H, {}]" if nhd else "[P, H, page, {}]"
    row_data, row_scales = region_bytes(head_size)  # D/2 code bytes, D/16 scale bytes
    k_data, v_data = _split_kv(paged_kv_cache, "paged_kv_cache", row_data, torch.uint8,
                               nhd, order.format(row_data))
    k_sf, v_sf = _split_kv(kv_cache_sf, "kv_cache_sf", row_scales, torch.float8_e4m3fn,
                           nhd, order.format(row_scales))
    pages, page_size, heads = k_data.shape[:3]
    if heads != num_heads:
        raise ValueError(f"paged_kv_cache: expected {num_heads} heads (those of append_key), got "
                         f"{heads} in shape {_shape(k_data)} (logical [P, page, H, D/2])")
    if pages < 1 or page_size < 1:
        raise ValueError(f"paged_kv_cache: expected at least one page of at least one entry, got "
                         f"logical shape {_shape(k_data)}")
    if k_sf.shape[:3] != k_data.shape[:3]:
        raise ValueError(f"kv_cache_sf: expected [P, page, H] = {tuple(k_data.shape[:3])} as "
                         f"paged_kv_cache (logical order), got {tuple(k_sf.shape[:3])}")
    _check_slots(slot_mapping, t_pad, "append_key")
    device = append_key.device
    require_same_device(device, "append_key", (
        ("append_value", append_value), ("slot_mapping", slot_mapping),
        ("paged_kv_cache", k_data), ("paged_kv_cache", v_data), ("kv_cache_sf", k_sf),
        ("kv_cache_sf", v_sf)))
    k_scale = float32_scale("k_scale", k_scale)
    v_scale = float32_scale("v_scale", v_scale)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(s, torch.Tensor):
            _check_scale_tensor(name, s, device, "one per-tensor scale")
    check_mutation_safe(
        outputs=(("paged_kv_cache (K data)", k_data), ("paged_kv_cache (V data)", v_data),
                 ("kv_cache_sf (K scales)", k_sf), ("kv_cache_sf (V scales)", v_sf)),
        inputs=(("append_key", append_key), ("append_value", append_value),
                ("slot_mapping", slot_mapping),
                ("k_scale", k_scale if isinstance(k_scale, torch.Tensor) else None),
                ("v_scale", v_scale if isinstance(v_scale, torch.Tensor) else None)))
    return (append_key, append_value, k_data, k_sf, v_data, v_sf, slot_mapping, CacheDType.NVFP4,
            k_scale, v_scale, ScaleLayout.LINEAR)


def _pair(t):
    """(k, v) of a pair, or (the 5-D tensor, None)."""
    if isinstance(t, (tuple, list)) and len(t) == 2:
        return t[0], t[1]
    return t, None


def _scale_parts(s):
    return (s, 0.0) if isinstance(s, torch.Tensor) else (None, float(s))


def _append_lower(append_key, append_value, slot_mapping, paged_kv_cache, kv_cache_sf, k_scale,
                  v_scale, kv_layout, implementation) -> tuple:
    """A call's arguments as the FlashInfer form's custom op takes them: each pair split (a 5-D
    tensor and None where it is not a pair), each scale as a tensor or a number."""
    k_data, v_data = _pair(paged_kv_cache)
    k_sf, v_sf = _pair(kv_cache_sf)
    kt, kf = _scale_parts(k_scale)
    vt, vf = _scale_parts(v_scale)
    return (append_key, append_value, slot_mapping, k_data, v_data, k_sf, v_sf,
            isinstance(paged_kv_cache, (tuple, list)), isinstance(kv_cache_sf, (tuple, list)),
            kt, kf, vt, vf, str(kv_layout), implementation or "")


def _append_entry(append_key: torch.Tensor, append_value: torch.Tensor,
                  slot_mapping: torch.Tensor, k_data: torch.Tensor, v_data: torch.Tensor | None,
                  k_sf: torch.Tensor, v_sf: torch.Tensor | None, data_pair: bool, sf_pair: bool,
                  k_scale: torch.Tensor | None, k_scale_value: float,
                  v_scale: torch.Tensor | None, v_scale_value: float, kv_layout: str,
                  implementation: str) -> None:
    """The FlashInfer form as torch.compile sees it: an opaque call that mutates the caches."""
    nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(
        append_key, append_value, slot_mapping, (k_data, v_data) if data_pair else k_data,
        (k_sf, v_sf) if sf_pair else k_sf, k_scale if k_scale is not None else k_scale_value,
        v_scale if v_scale is not None else v_scale_value, kv_layout,
        implementation=implementation or None)


@registry.custom_op("nvfp4_quantize_append_paged_kv_cache_with_slot_mapping",
                    mutates=("k_data", "v_data", "k_sf", "v_sf"), lower=_append_lower,
                    entry=_append_entry)
def nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(
        append_key: torch.Tensor, append_value: torch.Tensor, slot_mapping: torch.Tensor,
        paged_kv_cache, kv_cache_sf, k_scale, v_scale, kv_layout: str = "NHD", *,
        implementation: str | None = None) -> None:
    """Quantize ``append_key``/``append_value`` to NVFP4 and write them into FlashInfer's separate
    data and scale tensors; mutates ``paged_kv_cache`` and ``kv_cache_sf`` (docs/ops/nvfp4.md).

    ``paged_kv_cache``: a tuple ``(k, v)`` of uint8 ``[P, page, H, D/2]`` (``kv_layout="NHD"``) or
    ``[P, H, page, D/2]`` (``"HND"``), or one 5-D tensor with K/V on dim 1; ``kv_cache_sf``: the
    same with ``D/16`` and ``torch.float8_e4m3fn``. Last dims contiguous, other strides free.
    ``append_key``/``append_value``: ``[T_pad, H, D]`` float16/bfloat16/float32, dense heads, any
    token stride, ``D % 16 == 0``. ``slot_mapping`` ``[T]`` int64/int32: slot ``s`` writes entry
    ``s % page`` of page ``s // page``; negative slots and slots past the cache are skipped, rows
    past T never read. ``k_scale``/``v_scale``: a positive finite Python number (rounded to
    float32) or a one-element float32 tensor on the device (read there, so a CUDA-graph replay
    sees new values). Data byte j holds codes 2j (low nibble) and 2j+1 (high); scale byte g holds
    group g's E4M3 scale; the rule is "nvfp4". No other byte changes; T == 0 is a no-op.
    """
    args = append_run_args(append_key, append_value, slot_mapping, paged_kv_cache, kv_cache_sf,
                           k_scale, v_scale, kv_layout)
    info = select_implementation(args, implementation)
    if slot_mapping.numel() == 0:
        return
    info.run(*args)
