"""MXFP8/MXFP4 cache writes: validation and dispatch of ``reshape_and_cache_flash(..., "mxfp8" |
"mxfp4", k_scale_cache=..., v_scale_cache=...)`` (SPEC §10.3, SGLang's caches).

The public entry is reshape_and_cache_flash; it calls :func:`write_flash`, which validates every
argument (SPEC §10.4: errors naming the argument before anything is written) and runs the
internal op :data:`OP`, whose implementations all take the same arguments (``run_args``)::

    run(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping, mode,
        scale_rule, scale_layout)

``key_cache``/``value_cache``: uint8 views of the data caches (logical ``[num_blocks,
block_size, H, F]``, any strides with a unit last one, the same for K and V; F = D for mxfp8,
D/2 for mxfp4; a float8_e4m3fn cache is viewed as its bytes); ``k_scale_cache``/
``v_scale_cache``: uint8 views of the scale caches (logical ``[num_blocks, block_size, H, D/32]``
for "linear", ``[num_blocks, H, block_size/128, 32, 4, 4]`` for "interleaved128", any strides,
K's and V's may differ); ``mode``: the format record (:func:`kvwrite.formats.lookup`) of "mxfp8"
or "mxfp4" (``mode.element``: ``Element.FP8_E4M3`` or ``Element.E2M1``; ``mode.data_bytes(D)``:
F; the rule's constants: ``rule.LIMITS[mode.element]``); ``scale_rule``: "ceil" or "floor";
``scale_layout``: "linear" or "interleaved128".
"""

from __future__ import annotations

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
from .rule import GROUP, SCALE_LAYOUTS, SCALE_RULES

__all__ = ["OP", "SCALE_DTYPES", "mode_of", "parse_scale_rule", "parse_scale_layout",
           "scale_cache_shape", "flash_run_args", "select_implementation", "write_flash",
           "refuse_mx_arguments", "create_mx_caches"]

OP = "mx_kv_write"
# The scale caches' dtypes: E8M0 bytes as float8_e8m0fnu or as plain uint8.
SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)
# interleaved128's tile: 128 token offsets of one head, D = 128 (4 groups).
_TILE_TOKENS, _TILE_HEAD_SIZE = 128, 128


def mode_of(cache_dtype: CacheDType) -> formats.Format:
    """The format record of an MX cache dtype (what the implementations receive as ``mode``)."""
    if not cache_dtype.is_mx:
        raise ValueError(f"kv_cache_dtype: expected 'mxfp8' or 'mxfp4', got {cache_dtype.value!r}")
    return formats.lookup(cache_dtype.value)


def parse_scale_rule(rule) -> str:
    if isinstance(rule, str) and rule in SCALE_RULES:
        return rule
    raise ValueError(f"scale_rule: expected one of {list(SCALE_RULES)}, got {rule!r}")


def parse_scale_layout(layout, name: str = "scale_layout") -> str:
    if isinstance(layout, str) and layout in SCALE_LAYOUTS:
        return layout
    raise ValueError(f"{name}: expected one of {list(SCALE_LAYOUTS)}, got {layout!r}")


def scale_cache_shape(layout: str, num_blocks: int, block_size: int, num_heads: int,
                      head_size: int) -> tuple[int, ...]:
    """The logical shape of a scale cache in ``layout`` (interleaved128: block_size % 128 == 0
    and head_size == 128, checked by the caller)."""
    if layout == "linear":
        return (num_blocks, block_size, num_heads, head_size // GROUP)
    return (num_blocks, num_heads, block_size // _TILE_TOKENS, 32, 4, 4)


def refuse_mx_arguments(kv_cache_dtype, k_scale_cache, v_scale_cache, scale_rule,
                        scale_layout) -> None:
    """reshape_and_cache_flash outside the MX modes: the MX keywords must keep their defaults."""
    for name, t in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
        if t is not None:
            raise ValueError(f"{name}: only the MX modes ('mxfp8', 'mxfp4') take scale caches; "
                             f"expected None with kv_cache_dtype={kv_cache_dtype!r}, got a "
                             f"{type(t).__name__}")
    if scale_rule != "ceil":
        raise ValueError(f"scale_rule: only the MX modes take a scale rule; expected 'ceil' (the "
                         f"default) with kv_cache_dtype={kv_cache_dtype!r}, got {scale_rule!r}")
    if scale_layout != "linear":
        raise ValueError(f"scale_layout: only the MX modes lay out scale caches; expected "
                         f"'linear' (the default) with kv_cache_dtype={kv_cache_dtype!r}, got "
                         f"{scale_layout!r}")


def _check_inputs(key, value, what: str) -> tuple[int, int, int]:
    require_tensor("key", key)
    require_tensor("value", value)
    if key.dim() != 3:
        raise ValueError(f"key: expected 3 dims [num_tokens, num_heads, head_size], got shape "
                         f"{_shape(key)}")
    check_like("value", value, "key", key, "shape")
    if key.dtype not in INPUT_DTYPES:
        raise ValueError(f"key: expected dtype float16, bfloat16 or float32, got {key.dtype}")
    check_like("value", value, "key", key, "dtype")
    t_pad, num_heads, head_size = key.shape
    if head_size < GROUP or head_size % GROUP:
        raise ValueError(f"key: {what} needs head_size a positive multiple of {GROUP}, got "
                         f"{head_size}")
    if num_heads < 1:
        raise ValueError(f"key: expected num_heads >= 1, got shape {_shape(key)}")
    for name, t in (("key", key), ("value", value)):
        if t.stride(2) != 1 or num_heads > 1 and t.stride(1) != head_size:
            raise ValueError(f"{name}: expected dense heads (stride(2) == 1, stride(1) == "
                             f"head_size = {head_size}), got strides {tuple(t.stride())}")
    return t_pad, num_heads, head_size


def _check_data_caches(key_cache, value_cache, mode: formats.Format, num_heads: int,
                       head_size: int, what: str) -> None:
    f = mode.data_bytes(head_size)
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        require_tensor(name, c)
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache: expected 4 dims [num_blocks, block_size, H, F], got shape "
                         f"{_shape(key_cache)}")
    if key_cache.dtype not in mode.storage:
        names = " or ".join(str(d) for d in mode.storage)
        raise ValueError(f"key_cache: {what} expects a cache of dtype {names}, got "
                         f"{key_cache.dtype}")
    f_what = "D" if mode.element is formats.Element.FP8_E4M3 else "D/2"
    if tuple(key_cache.shape[2:]) != (num_heads, f):
        raise ValueError(f"key_cache: expected [num_blocks, block_size, {num_heads}, {f}] (H of "
                         f"key, F = {f_what} for head_size {head_size}), got shape "
                         f"{_shape(key_cache)}")
    if key_cache.shape[0] < 1 or key_cache.shape[1] < 1:
        raise ValueError(f"key_cache: expected num_blocks >= 1 and block_size >= 1, got shape "
                         f"{_shape(key_cache)}")
    check_like("value_cache", value_cache, "key_cache", key_cache, "shape", "dtype", "strides")
    if key_cache.stride(3) != 1:
        raise ValueError(f"key_cache: expected a unit-stride last dim, got strides "
                         f"{tuple(key_cache.stride())}")


def _check_scale_caches(k_scale_cache, v_scale_cache, layout: str, num_blocks: int,
                        block_size: int, num_heads: int, head_size: int, what: str) -> None:
    for name, s in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
        if s is None:
            raise ValueError(f"{name}: {what} needs a scale cache (uint8 or float8_e8m0fnu, one "
                             f"byte per {GROUP} elements), got None")
        require_tensor(name, s)
    if k_scale_cache.dtype not in SCALE_DTYPES:
        raise ValueError(f"k_scale_cache: expected dtype torch.uint8 or torch.float8_e8m0fnu, "
                         f"got {k_scale_cache.dtype}")
    if layout == "interleaved128" and (head_size != _TILE_HEAD_SIZE
                                       or block_size % _TILE_TOKENS):
        raise ValueError(f"scale_layout: 'interleaved128' needs head_size {_TILE_HEAD_SIZE} and "
                         f"block_size % {_TILE_TOKENS} == 0, got head_size {head_size} and "
                         f"block_size {block_size}")
    want = scale_cache_shape(layout, num_blocks, block_size, num_heads, head_size)
    if tuple(k_scale_cache.shape) != want:
        dims = ("[num_blocks, block_size, H, D/32]" if layout == "linear"
                else "[num_blocks, H, block_size/128, 32, 4, 4]")
        raise ValueError(f"k_scale_cache: expected {dims} = {want} (scale_layout="
                         f"{layout!r}, those of key_cache and key), got shape "
                         f"{_shape(k_scale_cache)}")
    check_like("v_scale_cache", v_scale_cache, "k_scale_cache", k_scale_cache, "shape", "dtype")


def flash_run_args(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                   k_scale_cache, v_scale_cache, scale_rule="ceil", scale_layout="linear"
                   ) -> tuple:
    """Validate ``reshape_and_cache_flash``'s arguments in the MX modes (SPEC §10.3/10.4) and
    return the internal op's ``run`` arguments; raises TypeError/ValueError naming the argument
    before anything is written."""
    mode = mode_of(parse_kv_cache_dtype(kv_cache_dtype, nvfp4=True, mx=True))
    rule = parse_scale_rule(scale_rule)
    layout = parse_scale_layout(scale_layout)
    what = f"kv_cache_dtype={mode.name!r}"
    t_pad, num_heads, head_size = _check_inputs(key, value, what)
    _check_data_caches(key_cache, value_cache, mode, num_heads, head_size, what)
    num_blocks, block_size = key_cache.shape[:2]
    _check_scale_caches(k_scale_cache, v_scale_cache, layout, num_blocks, block_size, num_heads,
                        head_size, what)
    require_tensor("slot_mapping", slot_mapping)
    check_token_indices("slot_mapping", slot_mapping, t_pad, "key.shape[0]")
    require_same_device(key.device, "key", (
        ("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
        ("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache),
        ("slot_mapping", slot_mapping)))
    check_mutation_safe(outputs=(("key_cache", key_cache), ("value_cache", value_cache),
                                 ("k_scale_cache", k_scale_cache),
                                 ("v_scale_cache", v_scale_cache)),
                        inputs=(("key", key), ("value", value), ("slot_mapping", slot_mapping)))
    return (key, value, key_cache.view(torch.uint8), value_cache.view(torch.uint8),
            k_scale_cache.view(torch.uint8), v_scale_cache.view(torch.uint8), slot_mapping, mode,
            rule, layout)


def select_implementation(run_args: tuple, implementation: str | None = None
                          ) -> registry.ImplInfo:
    """The named implementation of :data:`OP`, or the preferred one that can run these ``run``
    arguments; raises ValueError saying why where none can."""
    key, key_cache, mode, layout = run_args[0], run_args[2], run_args[7], run_args[9]
    return registry.select(OP, (key, key_cache, mode, layout), implementation)


def write_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                k_scale_cache, v_scale_cache, scale_rule="ceil", scale_layout="linear",
                implementation: str | None = None) -> None:
    """``reshape_and_cache_flash`` in the MX modes (it calls this; ``k_scale``/``v_scale`` are
    not read there)."""
    args = flash_run_args(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                          k_scale_cache, v_scale_cache, scale_rule, scale_layout)
    info = select_implementation(args, implementation)
    if slot_mapping.numel() == 0:
        return
    info.run(*args)


def create_mx_caches(num_blocks: int, block_size: int, num_heads: int, head_size: int,
                     kv_cache_dtype: str, *, scale_layout: str = "linear", inline: bool = False,
                     seed: int | None = None, device: str | torch.device = "cpu"
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache, k_scale_cache, v_scale_cache) of random uint8 bytes for the MX
    modes, sized by the format's record: NHD data caches ``[num_blocks, block_size, H, F]`` with
    K and V blocks interleaved in one allocation ``(num_blocks, 2, block_size, H, ...)``, and
    scale caches in ``scale_layout``. ``inline`` (linear only): each row is ``[F data bytes | D/32
    scale bytes]`` (SGLang's inline row) and the scale caches view the rows' tails; else the scale
    caches are one allocation ``(num_blocks, 2, ...)`` of their own."""
    mode = mode_of(parse_kv_cache_dtype(kv_cache_dtype, mx=True))
    layout = parse_scale_layout(scale_layout)
    if head_size < GROUP or head_size % GROUP:
        raise ValueError(f"head_size: the MX modes need a positive multiple of {GROUP}, got "
                         f"{head_size}")
    f, sb = mode.data_bytes(head_size), mode.scale_bytes(head_size)
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)

    def rand(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)

    nb, bs, h = num_blocks, block_size, num_heads
    if inline:
        if layout != "linear":
            raise ValueError("inline: rows with their scales hold linear scale caches; expected "
                             f"scale_layout='linear', got {scale_layout!r}")
        rows = rand(nb, 2, bs, h, mode.row_bytes(head_size))
        return (rows[:, 0, ..., :f], rows[:, 1, ..., :f], rows[:, 0, ..., f:],
                rows[:, 1, ..., f:])
    data = rand(nb, 2, bs, h, f)
    if layout == "linear":
        scales = rand(nb, 2, bs, h, sb)
    else:
        scales = rand(nb, 2, *scale_cache_shape(layout, nb, bs, h, head_size)[1:])
    return data[:, 0], data[:, 1], scales[:, 0], scales[:, 1]
