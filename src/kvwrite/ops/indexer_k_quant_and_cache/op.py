"""indexer_k_quant_and_cache: the public op, its validation, its torch.compile custom op, the
scale-format enum and the cache allocation helper (docs/ops/indexer_k_quant_and_cache.md)."""

from __future__ import annotations

import enum
import operator

import torch

from ... import formats, registry
from ...dtypes import INPUT_DTYPES, SCALE_FLOOR_1E4_BITS
from ...validation import (
    check_mutation_safe,
    check_token_indices,
    require_same_device,
    require_tensor,
)
from ...validation import shape_str as _shape

__all__ = ["OP", "ScaleFormat", "parse_scale_fmt", "indexer_k_quant_and_cache", "validate",
           "create_indexer_k_cache", "entry_size", "E4M3_MAX", "SCALE_FLOOR_BITS", "SCALE_FLOOR",
           "MXFP8_GROUP", "check_group_size", "select_implementation"]

OP = "indexer_k_quant_and_cache"

# The group scale s = max(amax, float32(1e-4)) / 448 (a true float32 division).
E4M3_MAX = 448.0
SCALE_FLOOR_BITS = SCALE_FLOOR_1E4_BITS  # float32(1e-4)
SCALE_FLOOR = 1e-4  # rounds to SCALE_FLOOR_BITS as float32


class ScaleFormat(enum.Enum):
    """How a group's scale is stored: ``UE8M0`` rounds it up to a power of two and stores its
    float32 bits (``scale_fmt`` "ue8m0"); ``MXFP8`` rounds it the same way and stores its biased
    exponent (float32 bits >> 23, 0xFF for +inf) in each of the group's 4 scale bytes ("mxfp8",
    vLLM 0.33; groups of 128 only); ``FLOAT32`` keeps the float32 quotient (any other string)."""

    UE8M0 = "ue8m0"
    MXFP8 = "mxfp8"
    FLOAT32 = "float32"

    @property
    def power_of_two(self) -> bool:
        """Whether the scale is rounded up to a power of two (the codes follow it)."""
        return self is not ScaleFormat.FLOAT32

    @property
    def format(self) -> formats.Format:
        """The scale format's cache format (kvwrite.formats): row bytes, scales, reader."""
        return formats.lookup(self.value, formats.Family.INDEXER)

    @property
    def exponent_bytes(self) -> bool:
        """Whether the 4 scale bytes hold the scale's UE8M0 exponent byte 4 times."""
        return self is ScaleFormat.MXFP8


# "mxfp8" stores one UE8M0 byte per 32 elements of a group, 4 per slot: only groups of 128.
MXFP8_GROUP = formats.INDEXER_MXFP8_GROUP


def parse_scale_fmt(scale_fmt: str | ScaleFormat) -> ScaleFormat:
    """"ue8m0" -> UE8M0, "mxfp8" -> MXFP8, any other string -> FLOAT32 (vLLM's rule); None or a
    non-string raises."""
    if isinstance(scale_fmt, ScaleFormat):
        return scale_fmt
    if scale_fmt is None:
        raise ValueError("scale_fmt: expected a string ('ue8m0' for power-of-two scales, 'mxfp8' "
                         "for UE8M0 exponent bytes, any other for float32 scales), got None")
    if not isinstance(scale_fmt, str):
        raise TypeError(f"scale_fmt: expected a string, got {type(scale_fmt).__name__}")
    if scale_fmt == "mxfp8":
        return ScaleFormat.MXFP8
    return ScaleFormat.UE8M0 if scale_fmt == "ue8m0" else ScaleFormat.FLOAT32


def check_group_size(fmt: ScaleFormat, quant_block_size: int) -> None:
    """Raise ValueError naming quant_block_size unless the scale format takes groups of this size
    ("mxfp8": only MXFP8_GROUP)."""
    if fmt.exponent_bytes and quant_block_size != MXFP8_GROUP:
        raise ValueError(f"quant_block_size: expected {MXFP8_GROUP} with scale_fmt 'mxfp8' (4 "
                         f"UE8M0 bytes a group, one per 32 elements), got {quant_block_size}")


def _check_quant_block_size(quant_block_size, head_dim: int) -> int:
    if isinstance(quant_block_size, bool):
        raise TypeError("quant_block_size: expected a positive int dividing the head dim, got bool")
    try:
        q = operator.index(quant_block_size)
    except TypeError:
        raise TypeError(f"quant_block_size: expected a positive int dividing the head dim, got "
                        f"{type(quant_block_size).__name__}") from None
    if q < 1 or head_dim % q != 0:
        raise ValueError(f"quant_block_size: expected a positive divisor of the head dim "
                         f"k.shape[1] = {head_dim}, got {q}")
    return q


def entry_size(head_dim: int, quant_block_size: int) -> int:
    """The cache's last dim: ``D`` code bytes and ``4 * G`` scale bytes per token slot (every
    scale_fmt's row: kvwrite.formats)."""
    return formats.lookup("float32", formats.Family.INDEXER).row_bytes(head_dim,
                                                                       group=quant_block_size)


def create_indexer_k_cache(num_blocks: int, block_size: int, head_dim: int = 128,
                           quant_block_size: int = 128,
                           device: str | torch.device = "cuda") -> torch.Tensor:
    """A zeroed contiguous ``[num_blocks, block_size, D + 4 * (D / quant_block_size)]`` uint8
    cache (vLLM's allocation)."""
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                    ("head_dim", head_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}: expected a positive integer, got {v!r}")
    q = _check_quant_block_size(quant_block_size, head_dim)
    return torch.zeros(num_blocks, block_size, entry_size(head_dim, q), dtype=torch.uint8,
                       device=device)


def validate(k, kv_cache, slot_mapping, quant_block_size, scale_fmt) -> tuple[int, ScaleFormat]:
    """Check every argument of :func:`indexer_k_quant_and_cache`; return ``(quant_block_size,
    scale format)``.

    Raises TypeError/ValueError naming the argument, what was expected and what came.
    """
    for name, t in (("k", k), ("kv_cache", kv_cache), ("slot_mapping", slot_mapping)):
        require_tensor(name, t)
    fmt = parse_scale_fmt(scale_fmt)
    if k.dim() != 2:
        raise ValueError(f"k: expected 2 dims [num_tokens, head_dim], got shape {_shape(k)}")
    if k.dtype not in INPUT_DTYPES:
        raise ValueError(f"k: expected dtype float16, bfloat16 or float32, got {k.dtype}")
    t_pad, head_dim = k.shape
    if head_dim < 1:
        raise ValueError(f"k: expected a head dim >= 1, got shape {_shape(k)}")
    if head_dim > 1 and k.stride(1) != 1:
        raise ValueError(f"k: expected a unit-stride last dim, got strides {tuple(k.stride())}")
    q = _check_quant_block_size(quant_block_size, head_dim)
    check_group_size(fmt, q)
    groups = head_dim // q

    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache: expected 3 dims [num_blocks, block_size, head_dim + "
                         f"4 * head_dim / quant_block_size], got shape {_shape(kv_cache)}")
    if kv_cache.dtype != torch.uint8:
        raise ValueError(f"kv_cache: expected dtype torch.uint8, got {kv_cache.dtype}")
    entry = entry_size(head_dim, q)
    if kv_cache.shape[2] != entry:
        raise ValueError(f"kv_cache: expected a last dim of head_dim + 4 * head_dim / "
                         f"quant_block_size = {head_dim} + 4 * {groups} = {entry} (k.shape[1] = "
                         f"{head_dim}, quant_block_size = {q}), got shape {_shape(kv_cache)}")
    block_size = kv_cache.shape[1]
    if kv_cache.stride(2) != 1 or (block_size > 1 and kv_cache.stride(1) != entry):
        raise ValueError(f"kv_cache: expected dense pages (stride(2) == 1, stride(1) == {entry}), "
                         f"got strides {tuple(kv_cache.stride())}")

    check_token_indices("slot_mapping", slot_mapping, t_pad, "k.shape[0]")
    require_same_device(k.device, "k", (("kv_cache", kv_cache), ("slot_mapping", slot_mapping)))
    check_mutation_safe(outputs=(("kv_cache", kv_cache),),
                        inputs=(("k", k), ("slot_mapping", slot_mapping)))
    return q, fmt


def select_implementation(k, kv_cache, fmt: ScaleFormat, implementation: str | None = None,
                          ) -> registry.ImplInfo:
    """The named implementation, or the preferred one that can run this case; raises if none can."""
    return registry.select(OP, (k, kv_cache, fmt), implementation)


@registry.custom_op(OP, mutates=("kv_cache",))
def indexer_k_quant_and_cache(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              quant_block_size: int, scale_fmt: str | None, *,
                              implementation: str | None = None) -> None:
    """Quantize one indexer key row per token into e4m3 codes and per-group scales, into the
    token's slot of a paged cache; mutates ``kv_cache``.

    ``k`` ``[T_pad, D]`` (float16/bfloat16/float32, unit last stride, any token stride);
    ``kv_cache`` ``[num_blocks, block_size, D + 4G]`` uint8, ``G = D / quant_block_size``, with
    dense pages (``stride(2) == 1``, ``stride(1) == D + 4G``; ``stride(0)`` free);
    ``slot_mapping`` ``[T]`` int64 or int32. Block ``b``'s page is the ``block_size * (D + 4G)``
    bytes from ``kv_cache[b, 0, 0]``: first every slot's ``D`` code bytes (slot ``o`` at
    ``[o*D, o*D + D)``), then every slot's ``G`` 4-byte scales (group ``g`` of slot ``o`` at
    ``[block_size*D + 4*(o*G + g), +4)``, a little-endian float32 or "mxfp8"'s bytes).

    For each token ``t < T = slot_mapping.numel()`` with ``0 <= slot < num_blocks *
    block_size`` and each group ``g`` (elements ``[g*q, g*q + q)``, ``q = quant_block_size``):
    ``a`` = the largest ``|x|`` of the group in float32, NaN ignored (0 if none); ``s =
    max(a, float32(1e-4)) / 448`` (a true float32 division); with ``scale_fmt`` "ue8m0" or
    "mxfp8" s becomes the smallest power of two ``>= s`` (+inf stays +inf); any other string
    keeps s. "mxfp8" (``quant_block_size`` 128 only) stores s's biased exponent (float32 bits
    >> 23: ``s = 2^(byte - 127)``, 0xFF for +inf) in each of the group's 4 scale bytes instead
    of its float32 bits. The codes are ``e4m3(x / s)`` (true division, round to nearest even, saturating at ±448, NaN
    stays NaN), so an infinite element makes its group's codes ±0 and NaN. ``scale_fmt`` None
    raises. No other byte of the cache changes: negative and out-of-range slots are skipped, rows
    of ``k`` past T are never read, T == 0 is a no-op, which of two tokens with one slot wins is
    undefined. The contract: docs/ops/indexer_k_quant_and_cache.md.
    """
    _, fmt = validate(k, kv_cache, slot_mapping, quant_block_size, scale_fmt)
    info = select_implementation(k, kv_cache, fmt, implementation)
    if slot_mapping.numel() == 0 or kv_cache.shape[0] * kv_cache.shape[1] == 0:
        return
    info.run(k, kv_cache, slot_mapping, operator.index(quant_block_size), fmt)
