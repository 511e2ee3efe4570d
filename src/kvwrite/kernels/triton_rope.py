"""Triton parts of the RoPE ops (docs/ops/rotary_embedding.md): the rotation of a tile of rows,
shared by rotary_embedding's and fused_rope_and_reshape_cache_flash's kernels.

A tile is ``[BLOCK_T tokens, BLOCK_H heads, BLOCK_D]`` with ``BLOCK_D >= head_size``. Each element
``d < rot_dim`` is rotated with its partner (neox: ``d ± rot_dim/2``; GPT-J: ``d ^ 1``), loaded by
a second gather of the same row (an L1 hit: DRAM traffic is the row once), so that every store is
a whole, contiguous row. For the first element of a pair ``x' = RN(RN(x*c) - RN(y*s))``, for the
second ``y' = RN(RN(y*c) + RN(x*s))``: the same products and sums as docs/ops/rotary_embedding.md,
one formula. Elements ``d >= rot_dim`` keep their bits.

No fused multiply-add: the kernels that use :func:`rope_rotate` are launched with
``enable_fp_fusion=False`` (Triton otherwise lets LLVM contract ``a*b - c`` into an FMA);
tests/test_rope.py checks the PTX of the rotation's kernels for ``fma``.
"""

from __future__ import annotations

from .triton_fp8 import pdl_entry, tl, triton

__all__ = ["rope_prologue", "rope_tables", "rope_rotate", "LAUNCH_OPTIONS"]

# Keyword arguments of every launch of a kernel that rotates (see the module doc).
LAUNCH_OPTIONS = {"enable_fp_fusion": False}

if triton is not None:

    @triton.jit
    def rope_prologue(positions_ptr, cos_sin_ptr, num_rot, max_position, ROT: tl.constexpr,
                      IS_NEOX: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                      PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr):
        """The first statements of every RoPE kernel (grid (token tiles, head tiles)):
        ``pdl_entry``, then (t, tile, valid, c, s, partner, first, is_rot): the program's
        ``[BLOCK_T]`` tokens, its head tile, and :func:`rope_tables` of those tokens."""
        pdl_entry(PDL, PDL_TRIGGER)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tile = tl.program_id(1)
        valid, c, s, partner, first, is_rot = rope_tables(
            positions_ptr, cos_sin_ptr, t, num_rot, max_position, ROT, IS_NEOX, BLOCK_D)
        return t, tile, valid, c, s, partner, first, is_rot

    @triton.jit
    def rope_tables(positions_ptr, cos_sin_ptr, t, num_rot, max_position, ROT: tl.constexpr,
                    IS_NEOX: tl.constexpr, BLOCK_D: tl.constexpr):
        """For a ``[BLOCK_T]`` vector of token indices ``t`` (rotated when ``t < num_rot``):
        ``valid`` (the token is rotated and its position lies in ``[0, max_position)``), then per
        token and element (cos, sin) as float32 ``[BLOCK_T, 1, BLOCK_D]`` (1 and 0 where the
        element is not rotated or the token is not valid), and ``[1, 1, BLOCK_D]``: the partner
        element, whether the element is the first of its pair, and whether it is rotated. The
        positions are read only for ``t < num_rot``, the table only for valid tokens."""
        t_in = t < num_rot
        pos = tl.load(positions_ptr + t, mask=t_in, other=-1).to(tl.int64)
        valid = t_in & (pos >= 0) & (pos < max_position)
        HALF: tl.constexpr = ROT // 2
        d = tl.arange(0, BLOCK_D)
        is_rot = d < ROT
        if IS_NEOX:
            first = d < HALF
            pair = tl.where(first, d, d - HALF)
            partner = tl.where(first, d + HALF, d - HALF)
        else:
            first = (d % 2) == 0
            pair = d // 2
            partner = d ^ 1
        partner = tl.where(is_rot, partner, d)
        pair = tl.where(is_rot, pair, 0)
        row = tl.where(valid, pos, 0).to(tl.int64) * ROT
        m = valid[:, None] & is_rot[None, :]
        c = tl.load(cos_sin_ptr + row[:, None] + pair[None, :], mask=m, other=1.0).to(tl.float32)
        s = tl.load(cos_sin_ptr + row[:, None] + HALF + pair[None, :], mask=m,
                    other=0.0).to(tl.float32)
        return (valid, c[:, None, :], s[:, None, :], partner[None, None, :], first[None, None, :],
                is_rot[None, None, :])

    @triton.jit
    def rope_rotate(x, y, c, s, first, is_rot):
        """The rotated tile in x's dtype: ``x`` the elements, ``y`` their partners
        (``[BLOCK_T, BLOCK_H, BLOCK_D]``), ``c``/``s`` ``[BLOCK_T, 1, BLOCK_D]``, ``first`` and
        ``is_rot`` ``[1, 1, BLOCK_D]`` (from :func:`rope_tables`)."""
        p1 = x.to(tl.float32) * c
        p2 = y.to(tl.float32) * s
        r = tl.where(first, p1 - p2, p1 + p2)
        return tl.where(is_rot, r.to(x.dtype), x)
