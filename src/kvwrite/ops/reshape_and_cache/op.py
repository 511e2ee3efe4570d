"""reshape_and_cache (the legacy paged-attention layout): the public op, its validation and its
torch.compile custom op (docs/ops/reshape_and_cache.md). Inputs, modes, quantization, scales and
slots follow reshape_and_cache_flash, whose argument checks it shares."""

from __future__ import annotations

import torch

from ... import registry
from ...dtypes import CacheDType, parse_kv_cache_dtype
from ...validation import check_like, require_tensor
from ...validation import shape_str as _shape
from ..reshape_and_cache_flash.op import (
    check_cache_dtype,
    check_key_value,
    check_slots_devices_scales,
)

__all__ = ["OP", "reshape_and_cache", "validate", "select_implementation", "logical_views",
           "create_legacy_kv_cache"]

OP = "reshape_and_cache"


def validate(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale=None,
             v_scale=None) -> CacheDType:
    """Check every argument of :func:`reshape_and_cache`; return the parsed cache dtype.

    Raises TypeError/ValueError naming the argument, what was expected and what came.
    """
    cache_dtype = parse_kv_cache_dtype(kv_cache_dtype)
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache), ("slot_mapping", slot_mapping)):
        require_tensor(name, t)
    rows = ((key_cache.shape[1], key_cache.shape[2] * key_cache.shape[4])
            if key_cache.dim() == 5 else None)
    _, num_heads, head_size = check_key_value(key, value, cache_rows=rows, cache_dtype=cache_dtype,
                                              key_cache=key_cache)

    if key_cache.dim() != 5:
        raise ValueError(f"key_cache: expected 5 dims [num_blocks, num_heads, head_size / x, "
                         f"block_size, x], got shape {_shape(key_cache)}")
    num_blocks, kh, kdx, block_size, x = key_cache.shape
    if x < 1 or head_size % x != 0:
        raise ValueError(f"key_cache: expected x = key_cache.size(4) dividing head_size "
                         f"{head_size} (key.shape[2]), got x = {x} in shape {_shape(key_cache)}")
    if kh != num_heads or kdx * x != head_size:
        raise ValueError(f"key_cache: expected [num_blocks, {num_heads}, {head_size // x}, "
                         f"block_size, {x}] to match key (num_heads {num_heads}, head_size "
                         f"{head_size}), got shape {_shape(key_cache)}")
    if value_cache.dim() != 4:
        raise ValueError(f"value_cache: expected 4 dims [num_blocks, num_heads, head_size, "
                         f"block_size], got shape {_shape(value_cache)}")
    want = (num_blocks, num_heads, head_size, block_size)
    if tuple(value_cache.shape) != want:
        raise ValueError(f"value_cache: expected [num_blocks, num_heads, head_size, block_size] = "
                         f"{want} (from key_cache {_shape(key_cache)} and key), got shape "
                         f"{_shape(value_cache)}")
    # The key cache's dtype against the inputs' first: where only it is wrong, it is named.
    check_cache_dtype(cache_dtype, key.dtype, key_cache)
    check_like("value_cache", value_cache, "key_cache", key_cache, "dtype")
    check_slots_devices_scales(key, value, key_cache, value_cache, slot_mapping, cache_dtype,
                               k_scale, v_scale)
    return cache_dtype


def logical_views(key_cache: torch.Tensor, value_cache: torch.Tensor,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as reshape_and_cache_flash's logical ``[num_blocks, block_size, H, D]``:
    ``key_cache.permute(0, 3, 1, 2, 4).reshape(nb, bs, H, D)`` (a copy where the x-split dims do
    not merge) and ``value_cache.permute(0, 3, 1, 2)`` (a view)."""
    nb, h, dx, bs, x = key_cache.shape
    return (key_cache.permute(0, 3, 1, 2, 4).reshape(nb, bs, h, dx * x),
            value_cache.permute(0, 3, 1, 2))


def create_legacy_kv_cache(num_blocks: int, block_size: int, num_heads: int, head_size: int,
                           dtype: torch.dtype, x: int | None = None,
                           device: str | torch.device = "cuda",
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed contiguous ``key_cache [num_blocks, H, D / x, block_size, x]`` and ``value_cache
    [num_blocks, H, D, block_size]`` of ``dtype`` (uint8 for fp8, as vLLM stores it); ``x``
    defaults to ``16 // element size`` (vLLM's), which must divide ``head_size``."""
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                    ("num_heads", num_heads), ("head_size", head_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}: expected a positive integer, got {v!r}")
    if x is None:
        x = 16 // torch.empty(0, dtype=dtype).element_size()
    if not isinstance(x, int) or x < 1 or head_size % x:
        raise ValueError(f"x: expected a positive divisor of head_size {head_size}, got {x!r}")
    key_cache = torch.zeros(num_blocks, num_heads, head_size // x, block_size, x, dtype=dtype,
                            device=device)
    value_cache = torch.zeros(num_blocks, num_heads, head_size, block_size, dtype=dtype,
                              device=device)
    return key_cache, value_cache


def select_implementation(key, key_cache, cache_dtype: CacheDType, k_scale=None,
                          implementation: str | None = None) -> registry.ImplInfo:
    """The named implementation, or the preferred one that can run this case; raises if none can."""
    return registry.select(OP, (key, key_cache, cache_dtype, k_scale), implementation)


@registry.custom_op(OP, mutates=("key_cache", "value_cache"))
def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_cache_dtype: str = "auto", k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None, *,
                      implementation: str | None = None) -> None:
    """Write ``key``/``value`` rows into caches of the legacy paged-attention layout; mutates
    ``key_cache`` and ``value_cache``.

    ``key_cache`` ``[num_blocks, H, D / x, block_size, x]`` and ``value_cache`` ``[num_blocks, H,
    D, block_size]``, any strides, ``x = key_cache.size(4)`` dividing D. For each token ``t < T =
    slot_mapping.numel()`` whose slot ``s`` satisfies ``0 <= s < num_blocks * block_size``, every
    head ``h < H`` and ``d < D``::

        key_cache[s // block_size, h, d // x, s % block_size, d % x] = Q_k(key[t, h, d])
        value_cache[s // block_size, h, d, s % block_size] = Q_v(value[t, h, d])

    and no other byte of either cache changes. Inputs, ``kv_cache_dtype`` ("auto", "float16",
    "bfloat16", "float32", "fp8"/"fp8_e4m3", "fp8_e5m2" with uint8 or float8 caches), the
    quantization ``Q`` (``fp8(float32(x) / scale)``, saturating), per-tensor or per-head scales
    (float32 ``[1]`` or ``[H]`` on the device, read there), padding and out-of-range slots
    (skipped) are those of :func:`kvwrite.reshape_and_cache_flash`. ``logical_views`` gives the
    caches as its logical ``[num_blocks, block_size, H, D]``. The contract:
    docs/ops/reshape_and_cache.md.
    """
    cache_dtype = validate(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                           k_scale, v_scale)
    info = select_implementation(key, key_cache, cache_dtype, k_scale, implementation)
    if slot_mapping.numel() == 0 or key_cache.numel() == 0:
        return
    if not cache_dtype.is_fp8:
        k_scale = v_scale = None
    info.run(key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale, v_scale)
