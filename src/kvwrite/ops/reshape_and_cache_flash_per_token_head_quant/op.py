"""reshape_and_cache_flash_per_token_head_quant: the public op, the mode enum, its validation and
its torch.compile custom op (the contract: docs/ops/reshape_and_cache_flash_per_token_head_quant.md)."""

from __future__ import annotations

import enum

import torch

from ... import formats, registry
from ...dtypes import INPUT_DTYPES
from ...validation import (
    check_like,
    check_mutation_safe,
    check_token_indices,
    require_same_device,
    require_tensor,
)
from ...validation import shape_str as _shape

__all__ = ["OP", "PerTokenHeadMode", "parse_kv_quant_mode", "validate", "select_implementation",
           "reshape_and_cache_flash_per_token_head_quant", "SCALE_FLOOR", "SCALE_FLOOR_BITS",
           "quantized_size"]

OP = "reshape_and_cache_flash_per_token_head_quant"

# The scale floor: float32(1e-6), bits 0x358637BD.
SCALE_FLOOR = 1e-6
SCALE_FLOOR_BITS = 0x358637BD


class PerTokenHeadMode(enum.Enum):
    """The three formats. Each member's lowercased name is its ``kv_quant_mode`` string (vLLM's
    ``kv_cache_dtype``), so vLLM's own enum members of these names parse to them too."""

    INT8_PER_TOKEN_HEAD = "int8_per_token_head"
    FP8_PER_TOKEN_HEAD = "fp8_per_token_head"
    INT4_PER_TOKEN_HEAD = "int4_per_token_head"

    @property
    def short(self) -> str:
        """"int8", "fp8" or "int4"."""
        return self.value.split("_", 1)[0]

    @property
    def is_int4(self) -> bool:
        return self is PerTokenHeadMode.INT4_PER_TOKEN_HEAD

    @property
    def format(self) -> formats.Format:
        """The mode's format (kvwrite.formats): codes, storage, the scale cache, row bytes."""
        return _FORMATS[self]

    def quantized_size(self, head_size: int) -> int:
        """Bytes of codes per row: ``D`` (int8, fp8) or ``D / 2`` (int4)."""
        return _FORMATS[self].data_bytes(head_size)

    @property
    def cache_dtypes(self) -> tuple[torch.dtype, ...]:
        """The data cache dtypes accepted (the first is the one the allocator makes)."""
        return _FORMATS[self].storage

    @property
    def storage_dtype(self) -> torch.dtype:
        """The data caches' dtype in vLLM's storage (what the allocator makes)."""
        return _FORMATS[self].storage[0]


_FORMATS = {m: formats.lookup(m.value, formats.Family.PER_TOKEN_HEAD) for m in PerTokenHeadMode}
_BY_VALUE = {m.value: m for m in PerTokenHeadMode}
_INFERRED = {torch.int8: PerTokenHeadMode.INT8_PER_TOKEN_HEAD,
             torch.float8_e4m3fn: PerTokenHeadMode.FP8_PER_TOKEN_HEAD}


def quantized_size(mode: PerTokenHeadMode, head_size: int) -> int:
    return mode.quantized_size(head_size)


def parse_kv_quant_mode(kv_quant_mode, cache_dtype: torch.dtype | None = None,
                        cache_name: str = "key_cache") -> PerTokenHeadMode:
    """The mode of a ``kv_quant_mode`` string, of an enum member whose lowercased ``.name`` is one
    of them, or (None) of the data cache's dtype: int8 -> int8, float8_e4m3fn -> fp8. Raises
    ValueError naming ``kv_quant_mode`` otherwise (int4 must be named)."""
    if isinstance(kv_quant_mode, PerTokenHeadMode):
        return kv_quant_mode
    if isinstance(kv_quant_mode, str) and kv_quant_mode in _BY_VALUE:
        return _BY_VALUE[kv_quant_mode]
    if isinstance(kv_quant_mode, enum.Enum) and isinstance(kv_quant_mode.name, str):
        mode = _BY_VALUE.get(kv_quant_mode.name.lower())
        if mode is not None:
            return mode
    if kv_quant_mode is None:
        if cache_dtype in _INFERRED:
            return _INFERRED[cache_dtype]
        raise ValueError(
            f"kv_quant_mode: None infers the mode from {cache_name}.dtype (torch.int8 -> "
            f"'int8_per_token_head', torch.float8_e4m3fn -> 'fp8_per_token_head'), got "
            f"{cache_name} of dtype {cache_dtype}: name the mode (int4 always needs its name)")
    raise ValueError(f"kv_quant_mode: expected one of {sorted(_BY_VALUE)}, an enum member of one "
                     f"of these names, or None, got {kv_quant_mode!r}")


def _check_input(name: str, t: torch.Tensor, mode: PerTokenHeadMode) -> None:
    if t.dim() != 3:
        raise ValueError(f"{name}: expected 3 dims [num_tokens, num_heads, head_size], got shape "
                         f"{_shape(t)}")
    if t.dtype not in INPUT_DTYPES:
        raise ValueError(f"{name}: expected dtype float16, bfloat16 or float32, got {t.dtype}")
    d = t.shape[2]
    if d < 1 or t.shape[1] < 1:
        raise ValueError(f"{name}: expected num_heads >= 1 and head_size >= 1, got shape {_shape(t)}")
    if d > 1 and t.stride(2) != 1:
        raise ValueError(f"{name}: expected a unit-stride last dim, got strides {tuple(t.stride())}")
    if mode.is_int4 and d % 2:
        raise ValueError(f"{name}: kv_quant_mode={mode.value!r} packs two elements per byte and "
                         f"needs an even head size, got shape {_shape(t)}")


def _check_cache(name: str, c: torch.Tensor, mode: PerTokenHeadMode, src: str, d: int) -> None:
    if c.dim() != 4:
        raise ValueError(f"{name}: expected 4 dims [num_blocks, block_size, num_heads, E], got "
                         f"shape {_shape(c)}")
    dq = mode.quantized_size(d)
    if c.shape[3] < dq:
        what = f"{d} / 2 bytes (int4)" if mode.is_int4 else f"{d} bytes (one per element)"
        raise ValueError(f"{name}: expected a last dim E >= Dq = {dq}, the codes of {src}'s head "
                         f"size {d}: {what}, got shape {_shape(c)}")
    if c.shape[3] > 1 and c.stride(3) != 1:
        raise ValueError(f"{name}: expected a unit-stride last dim, got strides {tuple(c.stride())}")
    if c.dtype not in mode.cache_dtypes:
        names = " or ".join(str(x) for x in mode.cache_dtypes)
        raise ValueError(f"{name}: kv_quant_mode={mode.value!r} expects a cache of dtype {names}, "
                         f"got {c.dtype}")


def validate(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping,
             kv_quant_mode=None) -> PerTokenHeadMode:
    """Check every argument of :func:`reshape_and_cache_flash_per_token_head_quant`; return the
    parsed mode.

    Raises TypeError/ValueError naming the argument, what was expected and what came, before
    anything is written.
    """
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache), ("k_scale_cache", k_scale_cache),
                    ("v_scale_cache", v_scale_cache), ("slot_mapping", slot_mapping)):
        require_tensor(name, t)
    mode = parse_kv_quant_mode(kv_quant_mode, key_cache.dtype)

    _check_input("key", key, mode)
    _check_input("value", value, mode)
    check_like("value", value, "key", key, "dtype")
    num_heads = key.shape[1]
    if value.shape[1] != num_heads:
        raise ValueError(f"value: expected {num_heads} heads (those of key) in dim 1, got shape "
                         f"{_shape(value)}")
    dk, dv = key.shape[2], value.shape[2]

    _check_cache("key_cache", key_cache, mode, "key", dk)
    _check_cache("value_cache", value_cache, mode, "value", dv)
    if key_cache.shape[2] != num_heads:
        raise ValueError(f"key_cache: expected {num_heads} heads (those of key) in dim 2, got "
                         f"shape {_shape(key_cache)}")
    geometry = tuple(key_cache.shape[:3])
    if tuple(value_cache.shape[:3]) != geometry:
        raise ValueError(f"value_cache: expected [num_blocks, block_size, num_heads] = "
                         f"{list(geometry)} (those of key_cache), got shape {_shape(value_cache)}")
    check_like("value_cache", value_cache, "key_cache", key_cache, "dtype")
    for name, s in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
        if s.dtype != torch.float32:
            raise ValueError(f"{name}: expected dtype float32, got {s.dtype}")
        if tuple(s.shape) != geometry:
            raise ValueError(f"{name}: expected shape [num_blocks, block_size, num_heads] = "
                             f"{list(geometry)} (that of key_cache), got {_shape(s)}")

    check_token_indices("slot_mapping", slot_mapping)
    for name, t in (("key", key), ("value", value)):
        if slot_mapping.numel() > t.shape[0]:
            raise ValueError(f"slot_mapping: expected at most {name}.shape[0] = {t.shape[0]} "
                             f"entries (rows of {name}), got {slot_mapping.numel()}")
    require_same_device(key.device, "key", (("value", value), ("key_cache", key_cache),
                                            ("value_cache", value_cache),
                                            ("k_scale_cache", k_scale_cache),
                                            ("v_scale_cache", v_scale_cache),
                                            ("slot_mapping", slot_mapping)))
    # Only [..., :Dq] of the data caches is written: the bytes after it may be the scales.
    check_mutation_safe(
        outputs=(("key_cache", key_cache[..., :mode.quantized_size(dk)]),
                 ("value_cache", value_cache[..., :mode.quantized_size(dv)]),
                 ("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)),
        inputs=(("key", key), ("value", value), ("slot_mapping", slot_mapping)))
    return mode


def select_implementation(key, value, key_cache, value_cache, mode: PerTokenHeadMode,
                          implementation: str | None = None) -> registry.ImplInfo:
    """The named implementation, or the preferred one that can run this case; raises if none can."""
    return registry.select(OP, (key, value, key_cache, value_cache, mode), implementation)


# torch.compile: the four caches reach the custom op as uint8 views (the scales as
# [num_blocks, block_size, H, 4] bytes). Functionalization loses writes through mutated arguments
# that are views of one allocation with different dtypes (the packed caches' codes and float32
# scales), so the op's arguments share one dtype; the op views them back.
_DTYPE_NAMES = {torch.int8: "int8", torch.uint8: "uint8", torch.float8_e4m3fn: "float8_e4m3fn"}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


def _byte_views(key_cache, value_cache, k_scale_cache, v_scale_cache):
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache),
                    ("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
        require_tensor(name, t)
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if c.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{name}: expected dtype int8, uint8 or float8_e4m3fn, got {c.dtype}")
        if c.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims [num_blocks, block_size, num_heads, E], "
                             f"got shape {_shape(c)}")
    check_like("value_cache", value_cache, "key_cache", key_cache, "dtype")
    for name, s in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
        if s.dtype != torch.float32:
            raise ValueError(f"{name}: expected dtype float32, got {s.dtype}")
    return (key_cache.view(torch.uint8), value_cache.view(torch.uint8),
            k_scale_cache.unsqueeze(-1).view(torch.uint8),
            v_scale_cache.unsqueeze(-1).view(torch.uint8))


def _lower(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping,
           kv_quant_mode, implementation) -> tuple:
    """A call's arguments as the custom op takes them: byte views, the parsed mode's name and
    the caches' dtype name."""
    mode = parse_kv_quant_mode(kv_quant_mode, key_cache.dtype)
    return (key, value, *_byte_views(key_cache, value_cache, k_scale_cache, v_scale_cache),
            slot_mapping, mode.value, _DTYPE_NAMES[key_cache.dtype], implementation or "")


def _entry(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
           value_cache: torch.Tensor, k_scale_cache: torch.Tensor, v_scale_cache: torch.Tensor,
           slot_mapping: torch.Tensor, kv_quant_mode: str, cache_dtype: str,
           implementation: str) -> None:
    """The op as torch.compile sees it: an opaque call that mutates the four caches, given as
    uint8 views (see _byte_views)."""
    dt = _DTYPES[cache_dtype]
    reshape_and_cache_flash_per_token_head_quant(
        key, value, key_cache.view(dt), value_cache.view(dt),
        k_scale_cache.view(torch.float32)[..., 0], v_scale_cache.view(torch.float32)[..., 0],
        slot_mapping, kv_quant_mode, implementation=implementation or None)


@registry.custom_op(OP, mutates=("key_cache", "value_cache", "k_scale_cache", "v_scale_cache"),
                    lower=_lower, entry=_entry)
def reshape_and_cache_flash_per_token_head_quant(
        key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
        value_cache: torch.Tensor, k_scale_cache: torch.Tensor, v_scale_cache: torch.Tensor,
        slot_mapping: torch.Tensor, kv_quant_mode=None, implementation: str | None = None) -> None:
    """Quantize each (token, KV head) row of ``key`` and ``value`` with its own scale, computed
    here, and write the codes and the scale into a paged cache; mutates the four cache tensors.

    For each token ``t < T = slot_mapping.numel()`` whose slot ``s`` is in
    ``[0, num_blocks * block_size)``, each head ``h``, and K and V separately:
    ``key_cache[s // bs, s % bs, h, :Dq]`` gets the codes of ``key[t, h]`` and
    ``k_scale_cache[s // bs, s % bs, h]`` its scale (the same for value). ``kv_quant_mode``:

    - "int8_per_token_head": ``s = max(RN(amax / 127), 1e-6)``, codes ``rhaz(RN(x / s))``
      clamped to int8 (round half away from zero, exactly);
    - "fp8_per_token_head": ``s = max(RN(amax / 448), 1e-6)``, codes e4m3fn of ``RN(x / s)``
      (nearest even, saturating, NaN kept);
    - "int4_per_token_head": ``s = max(RN(RN(max - min) / 15), 1e-6)``, zero point
      ``zp = clamp(rhu(RN(-min / s)), 0, 15)``, codes ``clamp(rhu(RN(x / s)) + zp, 0, 15)`` two
      per byte (even element in the low nibble), scale entry the float32 of bits
      ``bits(s) & ~0xF | zp`` (round half up, exactly);

    with amax, min and max over the row's non-NaN values (0 if none) and a NaN quotient counted as
    0 in the integer modes. ``None`` infers int8 or fp8 from ``key_cache.dtype``; an enum member
    whose lowercased name is one of the strings is accepted. Only ``[..., :Dq]`` of each data
    cache (``Dq = D``, or ``D / 2`` for int4) and the two scale caches change: vLLM's rows of
    ``Dq + 4`` bytes whose last 4 are the scale work as they are. Negative and out-of-range slots
    are skipped; rows past T are never read; ``T == 0`` is a no-op.

    Shapes: ``key`` ``[T_pad, H, Dk]``, ``value`` ``[T_pad', H, Dv]`` (float16/bfloat16/float32,
    unit last stride, other strides free); data caches ``[num_blocks, block_size, H, E]`` with
    ``E >= Dq`` (int8: int8; fp8: uint8 or float8_e4m3fn; int4: uint8 or int8), unit last
    stride; scale caches float32 ``[num_blocks, block_size, H]``, any strides; ``slot_mapping``
    ``[T]`` int64 or int32. The contract, with every special case:
    docs/ops/reshape_and_cache_flash_per_token_head_quant.md.
    """
    mode = validate(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache,
                    slot_mapping, kv_quant_mode)
    info = select_implementation(key, value, key_cache, value_cache, mode, implementation)
    if slot_mapping.numel() == 0:
        return
    info.run(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping, mode)
