"""Triton parts of the QK-norm ops (docs/ops/fused_qk_norm_rope.md): the normalization and
rotation of a tile of head rows, shared by fused_qk_norm_rope's and
fused_qk_norm_rope_and_reshape_cache_flash's kernels.

A tile is ``[BLOCK_T tokens, BLOCK_H heads, BLOCK_D]`` with ``BLOCK_D`` the smallest power of two
``>= head_size``; elements past head_size load as +0. The squares are summed in the contract's
tree by reshaping the last axis to ``[..., BLOCK_D / 2, 2]`` and adding the two halves of each
pair, level by level (neighbours, never ``i`` with ``i + BLOCK_D / 2``). Then ``m =
div_rn(ss, D)``, ``sigma = sqrt_rn(m + eps)``, ``r = div_rn(1, sigma)`` (true division and the
correctly rounded root), ``n = (x * r) * g``, and the RoPE of
:func:`kvwrite.kernels.triton_rope.rope_rotate` on the float32 ``n``. Each element's rotation
partner is loaded by a second gather of the same row (an L1 hit) and normalized the same way.

No fused multiply-add: the kernels are launched with ``enable_fp_fusion=False``
(``triton_rope.LAUNCH_OPTIONS``).
"""

from __future__ import annotations

from .triton_fp8 import tl, triton

__all__ = ["pair_sum", "tree_sum", "inv_rms", "norm_rope_tile", "f32_from_bits",
           "qk_norm_prologue"]

if triton is not None:
    from .triton_rope import rope_prologue, rope_rotate

    @triton.jit
    def pair_sum(x, N: tl.constexpr):
        """``[BT, BH, N] -> [BT, BH, N / 2]``: element i is ``x[2i] + x[2i + 1]``."""
        a, b = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], N // 2, 2]))
        return a + b

    @triton.jit
    def tree_sum(sq, BLOCK_D: tl.constexpr):
        """The contract's pairwise tree over the last axis of ``sq`` (``[BT, BH, BLOCK_D]``, a
        power of two up to 512): ``[BT, BH]``."""
        # Widths 512, 256, ..., 2 (unrolled at compile time): each level halves the axis.
        for i in tl.static_range(9):
            if (512 >> i) <= BLOCK_D:
                sq = pair_sum(sq, 512 >> i)
        return tl.reshape(sq, [sq.shape[0], sq.shape[1]])

    @triton.jit
    def f32_from_bits(bits):
        """A float32 from its bits (a 32-bit int argument)."""
        return bits.to(tl.int32).to(tl.float32, bitcast=True)

    @triton.jit
    def inv_rms(ss, eps, HEAD_SIZE: tl.constexpr):
        """``RN(1 / RN(sqrt(RN(RN(ss / D) + eps))))`` per element of ``ss``."""
        m = tl.math.div_rn(ss, tl.full(ss.shape, HEAD_SIZE, tl.float32))
        a = m + eps
        return tl.math.div_rn(tl.full(ss.shape, 1.0, tl.float32), tl.sqrt_rn(a))

    @triton.jit
    def norm_rope_tile(ptr, row, d, partner, mask, w_ptr, eps, offset, c, s, first, is_rot,
                       HEAD_SIZE: tl.constexpr, HAS_W: tl.constexpr, ADD_OFFSET: tl.constexpr,
                       BLOCK_D: tl.constexpr):
        """The head rows at ``ptr + row`` (``row``: ``[BT, BH, 1]`` element offsets; ``d``,
        ``partner``: ``[1, 1, BLOCK_D]`` from rope_tables; ``mask``: ``[BT, BH, BLOCK_D]``, false
        past head_size and for tokens left alone) normalized with the weight at ``w_ptr``
        (``HAS_W``; plus ``offset`` where ``ADD_OFFSET``) and rotated: float32 ``[BT, BH,
        BLOCK_D]``."""
        x = tl.load(ptr + row + d, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(ptr + row + partner, mask=mask, other=0.0).to(tl.float32)
        r = inv_rms(tree_sum(x * x, BLOCK_D), eps, HEAD_SIZE)[:, :, None]
        n = x * r
        ny = y * r
        if HAS_W:
            in_row = d < HEAD_SIZE
            w = tl.load(w_ptr + d, mask=in_row, other=0.0).to(tl.float32)
            wy = tl.load(w_ptr + partner, mask=in_row, other=0.0).to(tl.float32)
            if ADD_OFFSET:
                w = w + offset
                wy = wy + offset
            n = n * w
            ny = ny * wy
        return rope_rotate(n, ny, c, s, first, is_rot)

    @triton.jit
    def qk_norm_prologue(positions_ptr, cos_sin_ptr, num_rot, max_position, eps_bits, offset_bits,
                         ROT: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_D: tl.constexpr, PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr):
        """The first statements of both QK-norm kernels: ``rope_prologue``'s (t, tile, valid, c,
        s, partner, first, is_rot), then eps and weight_offset from their bits, the elements
        ``d`` (``[1, 1, BLOCK_D]``) and ``t`` as int64."""
        t, tile, valid, c, s, partner, first, is_rot = rope_prologue(
            positions_ptr, cos_sin_ptr, num_rot, max_position, ROT, IS_NEOX, BLOCK_T, BLOCK_D,
            PDL, PDL_TRIGGER)
        eps = f32_from_bits(eps_bits)
        offset = f32_from_bits(offset_bits)
        d = tl.arange(0, BLOCK_D)[None, None, :]
        t64 = t.to(tl.int64)
        return t, tile, valid, c, s, partner, first, is_rot, eps, offset, d, t64
