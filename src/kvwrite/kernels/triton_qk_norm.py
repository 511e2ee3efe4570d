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
           "qk_norm_prologue", "row_tree", "row_weights", "load_row_pairs", "store_row_pairs",
           "norm_rope_pairs", "pair_tables", "store_pairs_quantized"]

if triton is not None:
    from .triton_fp8 import store_quantized_uniform
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


# --- Whole-row tiles (the large-call kernels) ----------------------------------------------------
#
# The tile above gathers each element's rotation partner and sums the squares with reshapes of a
# [BT, BH, BLOCK_D] tile whose layout the compiler picks for the gather: for D = 128 in bfloat16
# it held every element of the tile in every lane (2064 float adds and 512 shared-memory loads per
# thread, scalar 2-byte loads and stores). The functions below keep a head row's elements where
# the 16-byte loads put them: the row is loaded as its two halves (neox: the pairs are (j,
# j + D/2)) or as [.., D/2, 2] pairs split in the thread (GPT-J), so no element moves between
# lanes except in the reduction's last levels; the cos/sin entries are loaded once per token and
# broadcast over its heads. They need rot_dim == head_size == a power of two (the tree's top
# level then adds the halves' sums: tree(x) = tree(lo) + tree(hi)).

if triton is not None:

    @triton.jit
    def row_tree(sq, N: tl.constexpr):
        """The contract's pairwise tree over the last axis of ``sq`` (``[BT, BH, N]``, N a power
        of two up to 512): ``[BT, BH]``, neighbours added level by level. Each level is a
        ``tl.sum`` over an axis of 2 (one addition, the same bits in either order): the compiler
        adds in the thread while a pair is there and with one shuffle once it spans two lanes,
        where :func:`pair_sum`'s split made it move the tile between layouts."""
        for i in tl.static_range(9):
            if (512 >> i) <= N:
                sq = tl.sum(tl.reshape(sq, [sq.shape[0], sq.shape[1], (512 >> i) // 2, 2]), 3)
        return tl.reshape(sq, [sq.shape[0], sq.shape[1]])

    @triton.jit
    def row_weights(w_ptr, HALF: tl.constexpr, IS_NEOX: tl.constexpr, HAS_W: tl.constexpr,
                    ADD_OFFSET: tl.constexpr, offset):
        """The weights of the two members of each pair (``[1, 1, HALF]`` float32 each), plus
        ``offset`` where ``ADD_OFFSET``; ones without ``HAS_W`` (not applied)."""
        if HAS_W:
            if IS_NEOX:
                j = tl.arange(0, HALF)
                wa = tl.load(w_ptr + j).to(tl.float32)
                wb = tl.load(w_ptr + HALF + j).to(tl.float32)
            else:
                w = tl.load(w_ptr + tl.arange(0, 2 * HALF)).to(tl.float32)
                wa, wb = tl.split(tl.reshape(w, [HALF, 2]))
            if ADD_OFFSET:
                wa = wa + offset
                wb = wb + offset
            return wa[None, None, :], wb[None, None, :]
        else:
            # Tensors of the weighted shape (never applied): a call's q and k tiles take either
            # branch of one runtime `if`, and Triton's compiler requires one type for wa and wb
            # after it (scalars here failed to compile with q weights but no k weights).
            one = tl.full([1, 1, HALF], 1.0, tl.float32)
            return one, one

    @triton.jit
    def load_row_pairs(ptr, row, j, mask, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
        """A tile of head rows at ``ptr + row`` (``row``: ``[BT, BH, 1]`` element offsets) as the
        two members of each rotation pair, in the rows' dtype (``[BT, BH, HALF]`` each); ``mask``
        ``[BT, BH, 1]``; masked rows load as +0."""
        if IS_NEOX:
            a = tl.load(ptr + row + j, mask=mask, other=0.0)
            b = tl.load(ptr + row + HALF + j, mask=mask, other=0.0)
        else:
            d = tl.arange(0, 2 * HALF)[None, None, :]
            x = tl.load(ptr + row + d, mask=mask, other=0.0)
            a, b = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], HALF, 2]))
        return a, b

    @triton.jit
    def store_row_pairs(ptr, row, j, mask, a, b, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
        """Stores the pairs (``a``, ``b``) of :func:`load_row_pairs` back as whole rows."""
        if IS_NEOX:
            tl.store(ptr + row + j, a, mask=mask)
            tl.store(ptr + row + HALF + j, b, mask=mask)
        else:
            d = tl.arange(0, 2 * HALF)[None, None, :]
            x = tl.reshape(tl.join(a, b), [a.shape[0], a.shape[1], 2 * HALF])
            tl.store(ptr + row + d, x, mask=mask)

    @triton.jit
    def norm_rope_pairs(a, b, wa, wb, eps, c, s, HALF: tl.constexpr, IS_NEOX: tl.constexpr,
                        HAS_W: tl.constexpr):
        """7.1 on the pairs of :func:`load_row_pairs` (any float dtype; ``c``, ``s``: float32
        ``[BT, 1, HALF]``): the rotated float32 pairs. The tree: neox, the halves' trees then
        their sum (the top level); GPT-J, the pairs' sums (the first level), then their tree."""
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        if IS_NEOX:
            ss = row_tree(a * a, HALF) + row_tree(b * b, HALF)
        else:
            ss = row_tree(a * a + b * b, HALF)
        r = inv_rms(ss, eps, 2 * HALF)[:, :, None]
        na = a * r
        nb = b * r
        if HAS_W:
            na = na * wa
            nb = nb * wb
        # rope_rotate's formula: first RN(RN(x*c) - RN(y*s)), second RN(RN(y*c) + RN(x*s))
        return na * c - nb * s, nb * c + na * s

    @triton.jit
    def pair_tables(positions_ptr, cos_sin_ptr, t, num_rot, max_position, HALF: tl.constexpr):
        """For a ``[BT]`` vector of token indices: ``valid`` (rotated, position in the table) and
        the float32 cos and sin of each pair, ``[BT, 1, HALF]`` (1 and 0 for tokens not valid),
        read once per token. The positions are read only for ``t < num_rot``, the table only for
        valid tokens."""
        t_in = t < num_rot
        pos = tl.load(positions_ptr + t, mask=t_in, other=-1).to(tl.int64)
        valid = t_in & (pos >= 0) & (pos < max_position)
        j = tl.arange(0, HALF)[None, None, :]
        base = (tl.where(valid, pos, 0) * (2 * HALF))[:, None, None]
        m = valid[:, None, None]
        c = tl.load(cos_sin_ptr + base + j, mask=m, other=1.0).to(tl.float32)
        s = tl.load(cos_sin_ptr + base + HALF + j, mask=m, other=0.0).to(tl.float32)
        return valid, c, s

    @triton.jit
    def store_pairs_quantized(ptr, row, mask, a, b, m, s2, y, QUANT: tl.constexpr,
                              STEPS: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr,
                              NATIVE: tl.constexpr, UNIFORM: tl.constexpr):
        """:func:`store_row_pairs` through triton_fp8's ``store_quantized_uniform`` (a cache row
        or an fp8 query row at ``ptr + row``, unit element stride; ``m, s2, y`` its scale's
        constants; ``NATIVE``, ``UNIFORM``: store_quantized_uniform's)."""
        j = tl.arange(0, HALF)[None, None, :]
        if IS_NEOX:
            store_quantized_uniform(ptr, row + j, mask, a, m, s2, y, QUANT, STEPS, NATIVE,
                                    UNIFORM)
            store_quantized_uniform(ptr, row + HALF + j, mask, b, m, s2, y, QUANT, STEPS,
                                    NATIVE, UNIFORM)
        else:
            d = tl.arange(0, 2 * HALF)[None, None, :]
            x = tl.reshape(tl.join(a, b), [a.shape[0], a.shape[1], 2 * HALF])
            store_quantized_uniform(ptr, row + d, mask, x, m, s2, y, QUANT, STEPS, NATIVE,
                                    UNIFORM)
