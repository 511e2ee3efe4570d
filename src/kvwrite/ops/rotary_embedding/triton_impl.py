"""The Triton implementation of rotary_embedding: one kernel, neox and GPT-J, partial rotary.

Grid (token tiles, query head tiles + key head tiles): a program rotates ``[BLOCK_T, BLOCK_H,
BLOCK_D]`` of query or of key (kvwrite.kernels.triton_rope) and stores whole rows back in place,
only for tokens whose position is in the table. Each tensor's head stride is its own (padded
heads: docs/ops/rotary_embedding.md). Graph-safe: nothing is read on the host per call.

On CPU it runs under Triton's interpreter, whose float32->bfloat16 cast truncates and whose
bfloat16->float32 cast mangles subnormals: :func:`unsupported` refuses bfloat16 rows and
tables there.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ...kernels import triton_support
from ...kernels.triton_fp8 import IMPORT_ERROR as _IMPORT_ERROR
from ...kernels.triton_fp8 import tl, triton
from ...kernels.triton_rope import LAUNCH_OPTIONS, rope_prologue, rope_rotate
from ...kernels.triton_support import PdlTuning, next_pow2
from .op import head_stride

__all__ = ["RopeTuning", "TUNING", "available", "unsupported", "run", "tiling"]


def available(device: torch.device) -> str | None:
    return triton_support.available(device, triton, lambda: _rope_kernel, _IMPORT_ERROR)


def interpreter_reason(*dtypes: torch.dtype) -> str | None:
    """Why Triton's interpreter cannot run rows or tables of these dtypes exactly (or None)."""
    if torch.bfloat16 in dtypes:
        return ("Triton's interpreter (TRITON_INTERPRET=1) rounds float32->bfloat16 casts and "
                "converts bfloat16 subnormals differently from the GPU; run on a CUDA device")
    return None


def unsupported(query, key, cos_sin_cache, is_neox) -> str | None:
    if query.device.type == "cuda":
        return None
    return interpreter_reason(query.dtype, cos_sin_cache.dtype)


# eq=False: hashed by identity (a key of the tiling cache).
@dataclasses.dataclass(frozen=True, eq=False)
class RopeTuning(PdlTuning):
    """Launch shapes of the RoPE kernels (this op's and the fused op's)."""

    # Input bytes of one tensor per program (one tile of query, or of key (and value)).
    tile_bytes: int = 4096
    # Input bytes per warp: 16 B per thread.
    bytes_per_warp: int = 512
    max_warps: int = 8
    # Programs below this count get 1 KiB tiles: few programs make each one's latency the call's.
    small_grid: int = 128
    tile_bytes_small_grid: int = 1024
    # Calls with at least large_call_bytes of query and key rows (and not a small grid) take
    # tiles of large_tile_bytes with large_bytes_per_warp per warp: one warp per 2 KiB tile, 64
    # bytes per thread. H200, bfloat16, NHD, rotated L2 (docs/tuning-log.md change 42), default
    # -> large tiles, us: rotary GQA(32,8,128) T=16384 112.0 -> 87.3, T=4096 29.1 -> 23.8, T=1024
    # 9.04 -> 8.05; fused GQA auto T=16384 133.3 -> 115.9, fp8 158.5 -> 114.9; MHA(32,32,128)
    # fused auto 293.9 -> 246.9, fp8 255.3 -> 224.8. At T=256 GQA (2.6 MB of rows) the fused
    # call would lose (4.86 -> 5.31), and small grids keep their tiles.
    large_call_bytes: int = 4 << 20
    large_tile_bytes: int = 2048
    large_bytes_per_warp: int = 2048
    # The trigger bound of rotary_embedding's and the fused ops' launches (PdlTuning). Measured,
    # H200, bfloat16, rotated L2 (tuning-log change 44), off / with the trigger /
    # without it, us: rotary GQA(32,8,128) T=16 (160 programs) 2.89 / 2.21 / 2.75, T=256 (768)
    # 3.73 / 3.57 / 3.14, T=4096 23.69 / 25.17 / 23.05, T=16384 86.9 / 99.0 / 86.3; MHA(32,32,128)
    # T=16384 138.2 / 158.1 / 137.6; fused GQA auto T=16 3.30 / 2.59 / 3.13, T=256 4.59 / 4.36 /
    # 3.98, T=16384 115.1 / 123.3 / 114.5.
    pdl_trigger_max_programs: int = 256
    # The fused op's key programs store the value into its cache before they rotate the key in
    # launches of at most fused_value_first_max_programs programs (fp8 caches:
    # fused_value_first_max_programs_fp8), after it in larger ones. A small call's latency is
    # its key programs': value first, with the fp8 scales loaded before any store, the value's
    # conversion and store and the scales' constants fill the table's round trip instead of
    # following it. H200, bfloat16, NHD, rotated L2 unless hot (tuning-log change 46), us.
    # Against the order of larger calls: fp8 GQA(32,8,128) hot T=1 1.90 -> 1.39, T=16 2.02 ->
    # 1.49, T=64 3.31 -> 2.63; MHA(32,32,128) hot T=1 1.95 -> 1.43. The bounds (change 50, the
    # rope benchmark's L2 rotation corrected), value after -> first: fp8 GQA T=128 (384
    # programs) 3.80 -> 3.32 (hot 2.44 -> 2.27), T=192 (576) 4.30 -> 4.55; fp8 MHA T=128 (512)
    # 3.78 -> 3.51, T=192 (768) 4.75 -> 4.91; copies win up to T=2048 (GQA 10240 programs 15.6
    # -> 15.2, T=512 5.68 -> 4.82; MHA 16384 programs 32.5 -> 32.2), tie at T=4096 and lose at
    # T=16384 (GQA 114.4 -> 117.0).
    fused_value_first_max_programs: int = 16384
    fused_value_first_max_programs_fp8: int = 512


TUNING = RopeTuning()


@functools.lru_cache(maxsize=512)
def tiling(num_tokens: int, num_q_heads: int, num_heads: int, head_size: int, in_bytes: int,
           tuning: RopeTuning = TUNING) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_T, BLOCK_H, BLOCK_D, num_warps, query head tiles, key head tiles)."""
    block_d = next_pow2(head_size)
    most = max(num_q_heads, num_heads)

    def tiles(tile_bytes: int):
        elems = max(1, tile_bytes // in_bytes)
        block_h = min(next_pow2(most), max(1, elems // block_d))
        block_t = 1
        if block_h >= most:
            block_t = min(next_pow2(max(1, num_tokens)), max(1, elems // (block_h * block_d)))
        nq, nk = -(-num_q_heads // block_h), -(-num_heads // block_h)
        return block_t, block_h, nq, nk, -(-num_tokens // block_t) * (nq + nk)

    per_warp = tuning.bytes_per_warp
    block_t, block_h, nq, nk, programs = tiles(tuning.tile_bytes)
    if programs < tuning.small_grid:
        block_t, block_h, nq, nk, programs = tiles(tuning.tile_bytes_small_grid)
    elif num_tokens * (num_q_heads + num_heads) * head_size * in_bytes >= tuning.large_call_bytes:
        block_t, block_h, nq, nk, programs = tiles(tuning.large_tile_bytes)
        per_warp = tuning.large_bytes_per_warp
    tile = block_t * block_h * block_d * in_bytes
    warps = min(tuning.max_warps, max(1, tile // per_warp))
    return block_t, block_h, block_d, warps, nq, nk


if triton is not None:

    @triton.jit(do_not_specialize=["num_rot"])
    def _rope_kernel(
        positions_ptr,  # [T_rot] int64 or int32
        query_ptr,  # [T_pad, Hq, D], token stride q_stride, head stride Q_HEAD_STRIDE
        key_ptr,  # [T_pad, H, D], k_stride, K_HEAD_STRIDE (query when there is no key)
        cos_sin_ptr,  # [max_position, ROT]: cos | sin
        num_rot,  # T_rot
        q_stride, k_stride,  # token strides in elements
        max_position,
        NUM_Q_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
        ROT: tl.constexpr, IS_NEOX: tl.constexpr,
        # Compiled in, as HEAD_SIZE (op.head_stride: HEAD_SIZE for dense heads, whose kernel is
        # then the one without head strides); the model fixes them.
        Q_HEAD_STRIDE: tl.constexpr, K_HEAD_STRIDE: tl.constexpr,
        Q_TILES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr, PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,
    ):
        t, tile, valid, c, s, partner, first, is_rot = rope_prologue(
            positions_ptr, cos_sin_ptr, num_rot, max_position, ROT, IS_NEOX, BLOCK_T, BLOCK_D,
            PDL, PDL_TRIGGER)
        if tile < Q_TILES:
            _rotate_tile(query_ptr, q_stride, t, valid, tile * BLOCK_H, c, s, partner, first,
                         is_rot, NUM_Q_HEADS, HEAD_SIZE, Q_HEAD_STRIDE, BLOCK_H, BLOCK_D)
        else:
            _rotate_tile(key_ptr, k_stride, t, valid, (tile - Q_TILES) * BLOCK_H, c, s, partner,
                         first, is_rot, NUM_HEADS, HEAD_SIZE, K_HEAD_STRIDE, BLOCK_H, BLOCK_D)

    @triton.jit
    def _rotate_tile(ptr, stride, t, valid, h0, c, s, partner, first, is_rot,
                     NH: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_STRIDE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """Rotates heads [h0, h0 + BLOCK_H) of tokens t in place (valid tokens only)."""
        d = tl.arange(0, BLOCK_D)[None, None, :]
        h = h0 + tl.arange(0, BLOCK_H)[None, :, None]
        mask = valid[:, None, None] & (h < NH) & (d < HEAD_SIZE)
        row = (t.to(tl.int64) * stride)[:, None, None] + h * HEAD_STRIDE
        x = tl.load(ptr + row + d, mask=mask)
        y = tl.load(ptr + row + partner, mask=mask)
        tl.store(ptr + row + d, rope_rotate(x, y, c, s, first, is_rot), mask=mask)


def run(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
        cos_sin_cache: torch.Tensor, is_neox: bool, *, tuning: RopeTuning = TUNING) -> None:
    """Launch on PyTorch's current stream; arguments as validated by the public op."""
    num_rot = positions.numel()
    if num_rot == 0:
        return
    _, hq, d = query.shape
    h = 0 if key is None else key.shape[1]
    block_t, block_h, block_d, warps, nq, nk = tiling(num_rot, hq, h, d, query.element_size(),
                                                      tuning)
    grid = (triton.cdiv(num_rot, block_t), nq + (nk if key is not None else 0))
    pdl, trigger = triton_support.pdl_launch(query.device, grid[0] * grid[1],
                                             tuning.pdl_max_programs,
                                             tuning.pdl_trigger_max_programs)
    _rope_kernel[grid](
        positions, query, query if key is None else key, cos_sin_cache, num_rot, query.stride(0),
        0 if key is None else key.stride(0), cos_sin_cache.shape[0],
        NUM_Q_HEADS=hq, NUM_HEADS=max(h, 1), HEAD_SIZE=d, ROT=cos_sin_cache.shape[1],
        IS_NEOX=is_neox, Q_HEAD_STRIDE=head_stride(query),
        K_HEAD_STRIDE=d if key is None else head_stride(key), Q_TILES=nq, BLOCK_T=block_t, BLOCK_H=block_h,
        BLOCK_D=block_d, num_warps=warps, PDL=pdl, PDL_TRIGGER=trigger, launch_pdl=pdl,
        **LAUNCH_OPTIONS,
    )
