"""What both MX write kernels (kvwrite.ops.mx_kv_write's Triton and CUDA implementations) take
from their arguments: the format, rule and layout flags and the views' strides in the kernels'
form.

The scale byte of group g, token offset o, head h, block b sits at b*sb + h*sh + (o // 128)*s128
+ (o % 32)*s32 + ((o % 128) // 32)*s4 + g*sg: the "interleaved128" layout's six strides as they
are, the "linear" layout's derived from its four (:func:`scale_strides`), so one kernel path
serves both.
"""

from __future__ import annotations

import torch

__all__ = ["GROUP", "is_fp4", "is_floor", "is_interleaved", "data_strides", "scale_strides"]

GROUP = 32  # elements a scale byte covers (SPEC §10.3)


def _text(x) -> str:
    """An argument's spelling: a string, or an enum's value."""
    return str(getattr(x, "value", x))


def is_fp4(mode) -> bool:
    """Whether ``mode`` (a format record whose ``name`` is "mxfp8" or "mxfp4") stores E2M1
    codes."""
    return mode.name == "mxfp4"


def is_floor(scale_rule) -> bool:
    """Whether ``scale_rule`` ("ceil" or "floor") is "floor"."""
    return _text(scale_rule) == "floor"


def is_interleaved(scale_layout) -> bool:
    """Whether ``scale_layout`` ("linear" or "interleaved128") is "interleaved128"."""
    return _text(scale_layout) == "interleaved128"


def _z(stride: int, size: int) -> int:
    """A stride along a dim of size 1 never multiplies a nonzero index: 0 there, so that it does
    not compile another variant."""
    return stride if size > 1 else 0


def data_strides(view: torch.Tensor) -> tuple[int, int, int, int]:
    """(block, slot, head, byte) strides of a data byte view [num_blocks, block_size, H, F];
    the byte stride stays as it is (F >= 16)."""
    sb, ss, sh, se = view.stride()
    nb, bs, h, _ = view.shape
    return _z(sb, nb), _z(ss, bs), _z(sh, h), se


def scale_strides(view: torch.Tensor, interleaved: bool) -> tuple[int, ...]:
    """The kernels' six scale strides (block, head, offset // 128, offset % 32, (offset % 128)
    // 32, group) of a scale byte view: an interleaved128 view [num_blocks, H, block_size/128,
    32, 4, 4] as they are; a linear one [num_blocks, block_size, H, D/32] with slot stride ss as
    (sb, sh, 128 ss, ss, 32 ss, sg), the same address (offset = 128 (offset // 128) +
    32 ((offset % 128) // 32) + offset % 32)."""
    st = tuple(_z(s, n) for s, n in zip(view.stride(), view.shape, strict=True))
    if interleaved:
        return st
    sb, ss, sh, sg = st
    return (sb, sh, 128 * ss, ss, 32 * ss, sg)
