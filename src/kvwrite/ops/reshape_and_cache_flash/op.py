"""reshape_and_cache_flash: the public op, its validation, its torch.compile custom op, and the
host-side slot check (docs/ops/reshape_and_cache_flash.md)."""

from __future__ import annotations

import torch

from ... import registry
from ...dtypes import INPUT_DTYPES, CacheDType, allowed_cache_dtypes, parse_kv_cache_dtype
from ...validation import (
    check_count,
    check_in_range,
    check_like,
    check_mutation_safe,
    check_slot_dtype,
    check_token_indices,
    require_same_device,
    require_tensor,
)
from ...validation import shape_str as _shape
from ..mx_kv_write import op as mx_op
from ..nvfp4 import op as nvfp4_op

__all__ = ["OP", "reshape_and_cache_flash", "validate", "check_slot_mapping",
           "select_implementation", "check_key_value", "check_cache_dtype", "check_slots",
           "check_scales", "check_slots_devices_scales"]

OP = "reshape_and_cache_flash"


def validate(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale=None,
             v_scale=None, *, free_head_stride: bool = False) -> CacheDType:
    """Check every argument of :func:`reshape_and_cache_flash`; return the parsed cache dtype.
    ``free_head_stride``: key and value may have any head stride (a fused op's views of heads
    its own validation accepts); their last dim stays unit-stride.

    Raises TypeError/ValueError naming the argument, what was expected and what came.
    """
    cache_dtype = parse_kv_cache_dtype(kv_cache_dtype)
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache), ("slot_mapping", slot_mapping)):
        require_tensor(name, t)

    rows = tuple(key_cache.shape[2:]) if key_cache.dim() == 4 else None
    _, num_heads, head_size = check_key_value(key, value, free_head_stride, cache_rows=rows,
                                              cache_dtype=cache_dtype, key_cache=key_cache)

    if key_cache.dim() != 4:
        raise ValueError(
            f"key_cache: expected 4 dims [num_blocks, block_size, num_heads, head_size], got shape {_shape(key_cache)}"
        )
    if key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"key_cache: expected [num_blocks, block_size, {num_heads}, {head_size}] to match key, got shape {_shape(key_cache)}"
        )
    check_like("value_cache", value_cache, "key_cache", key_cache, "shape")
    # The key cache's dtype against the inputs' first: where only it is wrong, it is named.
    check_cache_dtype(cache_dtype, key.dtype, key_cache)
    check_like("value_cache", value_cache, "key_cache", key_cache, "dtype", "strides")
    if head_size > 1 and key_cache.stride(3) != 1:
        raise ValueError(f"key_cache: expected a unit-stride last dim, got strides {tuple(key_cache.stride())}")

    check_slots_devices_scales(key, value, key_cache, value_cache, slot_mapping, cache_dtype,
                               k_scale, v_scale)
    return cache_dtype


def check_slots_devices_scales(key, value, key_cache, value_cache, slot_mapping,
                               cache_dtype: CacheDType, k_scale, v_scale) -> None:
    """The checks of a write after the caches' own, the same in every cache layout: the slots
    against ``key``, every tensor on ``key``'s device, the scales against the cache dtype and
    ``key``'s heads, and no written cache overlapping another argument."""
    check_slots(slot_mapping, key)
    device = key.device
    require_same_device(device, "key", (("value", value), ("key_cache", key_cache),
                                        ("value_cache", value_cache),
                                        ("slot_mapping", slot_mapping)))
    scales = check_scales(cache_dtype, k_scale, v_scale, key.shape[1], device)
    check_mutation_safe(outputs=(("key_cache", key_cache), ("value_cache", value_cache)),
                        inputs=(("key", key), ("value", value), ("slot_mapping", slot_mapping),
                                *scales))


def select_implementation(key, value, key_cache, value_cache, slot_mapping, cache_dtype: CacheDType,
                          k_scale=None, v_scale=None, implementation: str | None = None,
                          ) -> registry.ImplInfo:
    """The named implementation, or the preferred one that can run this case; raises if none can."""
    return registry.select(OP, (key, key_cache, cache_dtype, k_scale, v_scale), implementation)


@registry.custom_op(OP, mutates=("key_cache", "value_cache", "k_scale_cache", "v_scale_cache"),
                    args={"v_scale_layout": registry.NONE_AS_EMPTY})
def reshape_and_cache_flash(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            kv_cache_dtype: str = "auto", k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, *,
                            v_scale_layout: str | None = None,
                            k_scale_cache: torch.Tensor | None = None,
                            v_scale_cache: torch.Tensor | None = None,
                            scale_rule: str = "ceil", scale_layout: str = "linear",
                            implementation: str | None = None) -> None:
    """Write ``key``/``value`` rows into the paged caches; mutates ``key_cache`` and ``value_cache``.

    For each token ``t < T = slot_mapping.numel()`` whose slot ``s`` satisfies
    ``0 <= s < num_blocks * block_size``::

        key_cache[s // block_size, s % block_size, h, d] = Q(key[t, h, d])   # same for value

    and no other byte of either cache changes. Negative slots (padding) and slots past the cache
    are skipped; rows of key/value past T are never read; T == 0 is a no-op. Which of two tokens
    with the same slot wins is undefined.

    Shapes: ``key``, ``value`` ``[T_pad, H, D]`` (float16/bfloat16/float32, dense heads, any token
    stride); caches logically ``[num_blocks, block_size, H, D]`` with any strides whose last dim is
    unit-stride (NHD, HND, interleaved, packed), equal for K and V; ``slot_mapping`` ``[T]`` int64 or
    int32. ``Q`` is a copy ("auto"), a round-to-nearest-even cast ("float16", "bfloat16",
    "float32"), or for "fp8"/"fp8_e4m3"/"fp8_e5m2" ``fp8(float32(x) / scale)`` with saturation, where
    ``k_scale``/``v_scale`` are float32 tensors of 1 or H elements on the device, read there (no host
    sync), so a captured CUDA graph sees new values.

    The op is not differentiable and writes in place (:func:`kvwrite.validation.check_mutation_safe`):
    the caches must not require grad, be meta tensors, or be inference tensors outside
    ``torch.inference_mode()``; no two elements of the caches may share memory (K and V may
    interleave in one allocation), and no input may share memory with a cache; inputs that
    require grad are refused while grad mode is on (call it under ``torch.no_grad()``).

    ``kv_cache_dtype`` "nvfp4" and "nvfp4_4over6" write vLLM's NVFP4 page layout into uint8
    caches of logical shape ``[num_blocks, block_size, H, D/2 + D/16]`` with one-element
    ``k_scale``/``v_scale``; ``v_scale_layout`` (None, "linear" or "swizzled") places the V scales
    (None: vLLM's rule for the device). The contract of those modes is docs/ops/nvfp4.md; their
    implementations are those of ``kvwrite.implementations(op="nvfp4_kv_write")``.

    ``kv_cache_dtype`` "mxfp8" and "mxfp4" (SPEC §10.3, SGLang's caches) write E4M3 or E2M1
    codes into the data caches (logical ``[num_blocks, block_size, H, F]``, F = D or D/2) and one
    E8M0 byte per 32 elements into ``k_scale_cache``/``v_scale_cache`` (required there, uint8 or
    float8_e8m0fnu, laid out by ``scale_layout``: "linear" or "interleaved128"); ``scale_rule``
    ("ceil" or "floor") picks the exponent; ``k_scale``/``v_scale`` are not read. Other modes
    refuse scale caches and non-default rules and layouts. Their implementations are those of
    ``kvwrite.implementations(op="mx_kv_write")``.

    ``implementation`` names one of :func:`kvwrite.implementations`; None picks the preferred one
    that can run this call.
    """
    cache_dtype = parse_kv_cache_dtype(kv_cache_dtype, nvfp4=True, mx=True)
    if cache_dtype.is_mx:
        if v_scale_layout is not None:
            raise ValueError(f"v_scale_layout: only the NVFP4 modes lay out V scales; expected "
                             f"None with kv_cache_dtype={kv_cache_dtype!r}, got "
                             f"{v_scale_layout!r}")
        mx_op.write_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                          k_scale_cache, v_scale_cache, scale_rule, scale_layout, implementation)
        return
    mx_op.refuse_mx_arguments(kv_cache_dtype, k_scale_cache, v_scale_cache, scale_rule,
                              scale_layout)
    if cache_dtype.is_nvfp4:
        nvfp4_op.write_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                             k_scale, v_scale, v_scale_layout, implementation)
        return
    if v_scale_layout is not None:
        raise ValueError(f"v_scale_layout: only the NVFP4 modes lay out V scales; expected None "
                         f"with kv_cache_dtype={kv_cache_dtype!r}, got {v_scale_layout!r}")
    cache_dtype = validate(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                           k_scale, v_scale)
    info = select_implementation(key, value, key_cache, value_cache, slot_mapping, cache_dtype,
                                 k_scale, v_scale, implementation)
    if slot_mapping.numel() == 0:
        return
    if not cache_dtype.is_fp8:
        k_scale = v_scale = None
    info.run(key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale, v_scale)


def check_slot_mapping(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Raise ValueError naming every position whose slot is ``>= num_slots``.

    Negative slots are padding and allowed. This reads the tensor on the host (a sync): it is for
    debugging and tests, not for the hot path, where such slots are skipped silently.
    """
    require_tensor("slot_mapping", slot_mapping)
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping: expected 1 dim, got shape {_shape(slot_mapping)}")
    check_slot_dtype("slot_mapping", slot_mapping)
    num_slots = check_count("num_slots", num_slots)
    check_in_range("slot_mapping", slot_mapping, slot_mapping >= num_slots,
                   f"expected slots < num_slots = {num_slots} (or negative for padding)")


# --- the checks shared with reshape_and_cache (the legacy layout) ----------------------------------

def check_key_value(key, value, free_head_stride: bool = False, *,
                    cache_rows: tuple[int, int] | None = None,
                    cache_dtype: CacheDType | None = None, key_cache=None) -> tuple[int, int, int]:
    """``key``/``value`` ``[T_pad, H, D]`` of one input dtype with dense heads (with
    ``free_head_stride``: any head stride, unit-stride last dim); returns ``(T_pad, H, D)``.

    Where one argument disagrees with the others, the error names that one: the key is checked
    against the cache first (its ``cache_rows`` ``(H, D)``, and ``key_cache``'s dtype under
    ``cache_dtype``), and blamed there when the value agrees with the cache; then the value is
    checked against the key. Where the key and the value agree and the cache does not, the caller's
    cache checks name the cache."""
    if key.dim() != 3:
        raise ValueError(f"key: expected 3 dims [num_tokens, num_heads, head_size], got shape {_shape(key)}")
    if key.dtype not in INPUT_DTYPES:
        raise ValueError(f"key: expected dtype float16, bfloat16 or float32, got {key.dtype}")
    if (cache_rows is not None and tuple(key.shape[1:]) != cache_rows and value.dim() == 3
            and tuple(value.shape[1:]) == cache_rows):
        raise ValueError(
            f"key: expected [num_tokens, {cache_rows[0]}, {cache_rows[1]}] (num_heads and head_size "
            f"of key_cache and value), got shape {_shape(key)}"
        )
    if cache_dtype is not None and key_cache is not None and value.dtype != key.dtype:
        key_fits = key_cache.dtype in allowed_cache_dtypes(cache_dtype, key.dtype)
        value_fits = (value.dtype in INPUT_DTYPES
                      and key_cache.dtype in allowed_cache_dtypes(cache_dtype, value.dtype))
        if value_fits and not key_fits:
            raise ValueError(
                f"key: expected dtype {value.dtype} (that of value, and what "
                f"kv_cache_dtype={cache_dtype.value!r} with a {key_cache.dtype} key_cache takes), "
                f"got {key.dtype}"
            )
    check_like("value", value, "key", key, "shape", "dtype")
    t_pad, num_heads, head_size = key.shape
    for name, t in (("key", key), ("value", value)):
        if head_size > 1 and t.stride(2) != 1 or (
                num_heads > 1 and not free_head_stride and t.stride(1) != head_size):
            raise ValueError(
                f"{name}: expected dense heads (stride(2) == 1, stride(1) == head_size = {head_size}), "
                f"got strides {tuple(t.stride())}"
            )
    return t_pad, num_heads, head_size


def check_cache_dtype(cache_dtype: CacheDType, input_dtype: torch.dtype, key_cache) -> None:
    """The key cache's dtype fits ``kv_cache_dtype`` for inputs of ``input_dtype``."""
    allowed = allowed_cache_dtypes(cache_dtype, input_dtype)
    if key_cache.dtype not in allowed:
        names = " or ".join(str(d) for d in allowed)
        raise ValueError(
            f"key_cache: kv_cache_dtype={cache_dtype.value!r} with {input_dtype} input expects a cache of dtype "
            f"{names}, got {key_cache.dtype}"
        )


def check_slots(slot_mapping, key) -> None:
    """``slot_mapping`` ``[T]`` int64/int32, contiguous, ``T <= key.shape[0]``."""
    check_token_indices("slot_mapping", slot_mapping, key.shape[0], "key.shape[0]")


def check_scales(cache_dtype: CacheDType, k_scale, v_scale, num_heads: int,
                 device: torch.device) -> tuple:
    """fp8 modes: float32 ``[1]`` or ``[H]`` scales on ``device``. Returns the ``(name, scale)``
    pairs the op reads (none outside the fp8 modes), for ``check_mutation_safe``."""
    if not cache_dtype.is_fp8:
        return ()
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"{name}: kv_cache_dtype={cache_dtype.value!r} needs a float32 scale tensor, got None")
        require_tensor(name, s)
        if s.dtype != torch.float32:
            raise ValueError(f"{name}: expected dtype float32, got {s.dtype}")
        if s.numel() not in (1, num_heads):
            raise ValueError(
                f"{name}: expected 1 (per tensor) or {num_heads} (per head) elements, got {s.numel()}"
            )
        if s.device != device:
            raise ValueError(f"{name}: expected device {device} (that of the caches), got {s.device}")
        if s.numel() > 1 and not s.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(s.stride())}")
    return (("k_scale", k_scale), ("v_scale", v_scale))
