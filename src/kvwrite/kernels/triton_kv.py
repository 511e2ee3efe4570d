"""Triton parts of the K/V cache writes (reshape_and_cache_flash's, reshape_and_cache's and the
fused RoPE writers'): the tiling of a ``[T, H, D]`` write, the tile every K/V write kernel loads,
and the flash layout's cache addressing.

- :class:`TritonTuning`, :func:`tiling`: the launch shapes of reshape_and_cache_flash's and
  reshape_and_cache's kernels (the same loads and conversions per program; only the stores'
  addresses differ).
- :func:`load_kv_tile`: a program's ``[BLOCK_T, BLOCK_H, BLOCK_D]`` tile of K and of V, its
  slots and scales' constants, and which of its elements are stored.
- :func:`kv_write_kernel`, :func:`write_kv`: the kernel of reshape_and_cache_flash and
  reshape_and_cache (one tile of K and of V a program, stored through either layout's strides)
  and its launch.
- :func:`token_prologue`: the first statements of a kernel with one program per ``BLOCK_T``
  tokens (concat_and_cache_mla's, the indexer's).
- :func:`cache_offsets`: the store mask and the element offsets into a ``[num_blocks,
  block_size, H, D]`` cache of the fused RoPE writers (strides as arguments).
- :func:`interpreter_reason`: why Triton's interpreter cannot write a call's bytes exactly.

``triton`` is optional at import time, as in :mod:`kvwrite.kernels.triton_fp8`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..dtypes import CacheDType, scale_is_per_head
from . import triton_support
from .triton_fp8 import (
    COPY,
    code_view,
    fp8_scale_pair,
    pdl_entry,
    quant_code,
    store_quantized,
    tl,
    triton,
)
from .triton_support import PdlTuning, inexact_cast_reason, next_pow2, pdl_launch

__all__ = ["TritonTuning", "TUNING", "tiling", "interpreter_reason", "load_kv_tile",
           "kv_write_kernel", "write_kv", "token_prologue", "cache_offsets"]


def interpreter_reason(key: torch.Tensor, cache_dtype: CacheDType) -> str | None:
    """Why Triton's interpreter cannot write this call's bytes exactly (None on CUDA devices, or
    where it can): reshape_and_cache_flash's and reshape_and_cache's launchers ask it."""
    if key.device.type == "cuda":
        return None
    return inexact_cast_reason(key.dtype, cache_dtype.element_dtype(key.dtype))


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class TritonTuning(PdlTuning):
    """The only place launch shapes are chosen. ``TUNING`` is what every call uses unless a caller
    passes another one to :func:`run`. The bandwidth targets want 16 B vectors and enough bytes in
    flight per SM, the small-T target few programs and no wasted lanes. Figures: H200, 20-call
    CUDA graphs, hot L2, bfloat16 input, unless said otherwise; history in docs/tuning-log.md.
    Programmatic dependent launch: :class:`~kvwrite.kernels.triton_support.PdlTuning`."""

    # The trigger in every launch. Measured, H=128, bfloat16, rotated L2 (tuning-log change 44),
    # PDL off -> on: NHD T=2 1.66 -> 1.31 us, HND 1.99 -> 1.32, fp8 HND T=16 2.96 -> 2.04,
    # T=1024 2-3% less, T=65536 equal; without the trigger fp8 HND T=2 1.64 (1.49 with it),
    # T=1024 29.95 (29.73).
    pdl_trigger_max_programs: int = 1 << 30

    # Input bytes of K per program (as many of V). 4 KiB, "auto", T=65536: H=128 2192 us (92.5%
    # of copy bandwidth) vs 2268 us (89.4%) at 8 KiB and 2291 us (88.5%) at 16 KiB; H=8 139 vs
    # 144 us.
    tile_bytes: int = 4096
    # Input bytes of K per warp, i.e. 16 B of K and of V per thread for copies and casts, 32 B
    # for fp8. T=65536: copies at 512 vs 2048: H=8 139 vs 144 us, T=2 1.46 vs 1.69 us; fp8 at 1024
    # vs 512 vs 2048: H=128 NHD 1674 vs 1875 vs 1717 us, H=8 NHD 106 vs 123 vs 109 us.
    bytes_per_warp_copy: int = 512
    bytes_per_warp_fp8: int = 1024
    max_warps: int = 8
    # Calls whose grid would have fewer programs than small_grid use smaller tiles and more
    # threads per byte: with few programs, the latency of each thread's chain of work is the
    # call's time. 1 KiB tiles at 128 B per warp vs the large-T tiling: fp8 T=2 H=128 NHD 1.55 vs
    # 1.91 us, HND 1.92 vs 2.06 us, H=8 NHD 1.72 vs 1.96 us; copies T=2 H=8 NHD 1.45 vs 1.59 us,
    # H=128 HND 1.60 vs 1.74 us (small-T figures move by about 0.1 us between runs). 0: never.
    small_grid_copy: int = 128
    small_grid_fp8: int = 128
    tile_bytes_small_grid: int = 1024
    bytes_per_warp_small_grid: int = 128
    # The data loads of calls whose K and V inputs together are at most evict_first_max_bytes
    # (about the L2's size) carry the evict-first hint (the inputs are read once); larger calls
    # load without a hint. No hint vs evict-first: every point from H=128 T=4096 and H=8 T=32768
    # up 1.7-7.4% faster (H=128 T=65536 copies 2145 vs 2190 us, fp8 NHD 1558 vs 1612 us, HND 1683
    # vs 1768 us); small calls mostly slower (H=8 T=2 HND fp8 1.46 vs 1.39 us, H=128 T=2 HND fp8
    # 1.57 vs 1.50 us); at H=128 T=1024 (64 MiB of input) fp8 slower (29.6 vs 28.8 us) and copies
    # faster (35.8 vs 36.6 us). -1: never.
    evict_first_max_bytes: int = 64 << 20

    def bytes_per_warp(self, fp8: bool) -> int:
        return self.bytes_per_warp_fp8 if fp8 else self.bytes_per_warp_copy

    def small_grid(self, fp8: bool) -> int:
        return self.small_grid_fp8 if fp8 else self.small_grid_copy


TUNING = TritonTuning()


@functools.lru_cache(maxsize=512)
def tiling(num_tokens: int, num_heads: int, head_size: int, in_bytes: int, fp8: bool = False,
           tuning: TritonTuning = TUNING) -> tuple[int, int, int, int, tuple[int, int], str]:
    """(BLOCK_T, BLOCK_H, BLOCK_D, num_warps, grid, load eviction policy) for one shape; the grid
    is ``(cdiv(T, BLOCK_T), cdiv(H, BLOCK_H))`` programs (token tiles, head tiles).

    Large rows (H*D) are split into chunks of heads, one token per program; small rows take
    several tokens per program. BLOCK_T never exceeds T rounded up to a power of two, so small
    calls do not launch idle lanes.
    """
    block_d = next_pow2(head_size)

    def tiles(tile_bytes: int) -> tuple[int, int, tuple[int, int]]:
        tile_elems = max(1, tile_bytes // in_bytes)
        block_h = min(next_pow2(num_heads), max(1, tile_elems // block_d))
        block_t = 1
        if block_h >= num_heads:
            block_t = min(next_pow2(num_tokens), max(1, tile_elems // (block_h * block_d)))
        return block_t, block_h, (triton.cdiv(num_tokens, block_t), triton.cdiv(num_heads, block_h))

    block_t, block_h, grid = tiles(tuning.tile_bytes)
    per_warp = tuning.bytes_per_warp(fp8)
    if grid[0] * grid[1] < tuning.small_grid(fp8):
        # Few programs: the latency of each thread's chain of work is the call's time, so
        # spread the work over more programs and threads.
        block_t, block_h, grid = tiles(tuning.tile_bytes_small_grid)
        per_warp = tuning.bytes_per_warp_small_grid
    tile_bytes = block_t * block_h * block_d * in_bytes
    num_warps = min(tuning.max_warps, max(1, tile_bytes // per_warp))
    small = 2 * num_tokens * num_heads * head_size * in_bytes <= tuning.evict_first_max_bytes
    return block_t, block_h, block_d, num_warps, grid, "evict_first" if small else ""


if triton is not None:

    @triton.jit
    def load_kv_tile(key_ptr, value_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr, num_tokens,
                     KEY_STRIDE: tl.constexpr, VALUE_STRIDE: tl.constexpr,
                     NUM_SLOTS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, K_PER_HEAD: tl.constexpr,
                     V_PER_HEAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, LOAD_EVICT: tl.constexpr, PDL: tl.constexpr,
                     PDL_TRIGGER: tl.constexpr):
        """The first part of a K/V write kernel (a tile ``[BLOCK_T tokens, BLOCK_H heads,
        BLOCK_D]`` of K and of V per program, grid (token tiles, head tiles)), up to the stores'
        addresses: (h, offs_d, k, v, km, ks2, ky, vm, vs2, vy, store_mask, slot, block): the
        heads ``[BLOCK_H]``, the elements ``[BLOCK_D]``, both tiles as loaded, the scales'
        constants (fp8_scale_pair), which elements are stored, and each token's slot and cache
        block ``slot // BLOCK_SIZE`` (int64; the offset in the block is left to the caller, whose
        order of the address arithmetic it keeps). Arguments as the kernels' own."""
        pdl_entry(PDL, PDL_TRIGGER)
        # Grid (token tiles, head tiles): programs are dispatched token tile fastest, so the
        # programs in flight write the same heads of many tokens, and no index needs a division.
        offs_t = tl.arange(0, BLOCK_T)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        t = tl.program_id(0) * BLOCK_T + offs_t  # [BLOCK_T]
        h = tl.program_id(1) * BLOCK_H + offs_h  # [BLOCK_H]
        t_in = t < num_tokens
        # The data loads are masked by the token and head bounds only, not by the slot, so they
        # are issued together with the slot's load instead of one memory round trip after it
        # (rows past num_tokens are never read; a padded token's row is read and not stored).
        load_mask = t_in[:, None, None]
        if NUM_HEADS % BLOCK_H != 0:
            load_mask = load_mask & (h < NUM_HEADS)[None, :, None]
        if BLOCK_D != HEAD_SIZE:
            load_mask = load_mask & (offs_d < HEAD_SIZE)[None, None, :]
        t64 = t.to(tl.int64)
        in_hd = (h * HEAD_SIZE)[None, :, None] + offs_d[None, None, :]  # < H * D: 32-bit
        k_off = (t64 * KEY_STRIDE)[:, None, None] + in_hd
        v_off = (t64 * VALUE_STRIDE)[:, None, None] + in_hd
        slot = tl.load(slot_mapping_ptr + t, mask=t_in, other=-1).to(tl.int64)
        # Both loads before either store, so K and V are in flight together.
        k = tl.load(key_ptr + k_off, mask=load_mask, eviction_policy=LOAD_EVICT)
        v = tl.load(value_ptr + v_off, mask=load_mask, eviction_policy=LOAD_EVICT)
        # The scales are read and prepared here, after the data loads are issued: placed
        # before them, the scale's load and division would add a memory round trip to each
        # program's critical path (the data loads cannot move above the division's branch).
        km, ks2, ky, vm, vs2, vy = fp8_scale_pair(k_scale_ptr, v_scale_ptr, h, NUM_HEADS, QUANT,
                                                  K_PER_HEAD, V_PER_HEAD, True)
        # Padding (slot < 0) and out-of-range slots are not stored.
        store_mask = load_mask & ((slot >= 0) & (slot < NUM_SLOTS))[:, None, None]
        block = slot // BLOCK_SIZE
        return h, offs_d, k, v, km, ks2, ky, vm, vs2, vy, store_mask, slot, block

    # num_tokens only bounds masks: specializing on it (divisibility, == 1) would compile a new
    # variant for many token counts without making any access wider.
    @triton.jit(do_not_specialize=["num_tokens"])
    def kv_write_kernel(
        key_ptr,  # [T_pad, H, D], token stride KEY_STRIDE, dense heads
        value_ptr,  # [T_pad, H, D], token stride VALUE_STRIDE, dense heads
        key_cache_ptr,  # flash: [num_blocks, block_size, H, D]; legacy: [num_blocks, H, D / X,
        value_cache_ptr,  # block_size, X] and [num_blocks, H, D, block_size]; strides CACHE
        slot_mapping_ptr,  # [T] int64 or int32
        k_scale_ptr,  # [1] or [H] float32 (fp8 only; None otherwise)
        v_scale_ptr,  # [1] or [H] float32 (fp8 only; None otherwise)
        num_tokens,  # T
        # Fixed by the caches and the inputs' layout, so compiled in: the index math folds and
        # nothing but the pointers and T is read from the parameter bank.
        KEY_STRIDE: tl.constexpr,  # token strides of key and value, in elements
        VALUE_STRIDE: tl.constexpr,
        NUM_SLOTS: tl.constexpr,  # num_blocks * block_size
        NUM_HEADS: tl.constexpr,
        HEAD_SIZE: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block
        QUANT: tl.constexpr,
        K_PER_HEAD: tl.constexpr,  # each scale's own kind (scale_is_per_head)
        V_PER_HEAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        LOAD_EVICT: tl.constexpr,  # the data loads' eviction policy ("" or "evict_first")
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,  # programmatic dependent launch (pdl_entry)
        NATIVE: tl.constexpr,  # fp8 codes by the float8 conversion (triton_support.native_fp8)
        LEGACY: tl.constexpr,  # reshape_and_cache's layout (else the flash layout)
        # The caches' strides in elements. Flash (both caches): (block, slot in block, head).
        # Legacy: key (block, head, d // X, slot, d % X), value (block, head, d, slot), then X.
        CACHE: tl.constexpr,
    ):
        # 16-bit inputs need one correction step of the fp8 division, float32 two (fp8_quotient).
        STEPS: tl.constexpr = 2 if key_ptr.dtype.element_ty == tl.float32 else 1
        h, offs_d, k, v, km, ks2, ky, vm, vs2, vy, store_mask, slot, block = load_kv_tile(
            key_ptr, value_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr, num_tokens,
            KEY_STRIDE, VALUE_STRIDE, NUM_SLOTS, NUM_HEADS, HEAD_SIZE, BLOCK_SIZE, QUANT,
            K_PER_HEAD, V_PER_HEAD, BLOCK_T, BLOCK_H, BLOCK_D, LOAD_EVICT, PDL, PDL_TRIGGER)
        if LEGACY:
            # The key element d of head h at key_cache[b, h, d // X, o, d % X], the value
            # element at value_cache[b, h, d, o].
            KC_B: tl.constexpr = CACHE[0]
            KC_H: tl.constexpr = CACHE[1]
            KC_G: tl.constexpr = CACHE[2]
            KC_S: tl.constexpr = CACHE[3]
            KC_X: tl.constexpr = CACHE[4]
            VC_B: tl.constexpr = CACHE[5]
            VC_H: tl.constexpr = CACHE[6]
            VC_D: tl.constexpr = CACHE[7]
            VC_S: tl.constexpr = CACHE[8]
            X: tl.constexpr = CACHE[9]
            o = slot - block * BLOCK_SIZE
            h64 = h.to(tl.int64)
            d64 = offs_d.to(tl.int64)
            kc_row = block * KC_B + o * KC_S  # int64
            kc_col = (d64 // X) * KC_G + (d64 % X) * KC_X
            kc_off = kc_row[:, None, None] + (h64 * KC_H)[None, :, None] + kc_col[None, None, :]
            vc_row = block * VC_B + o * VC_S
            vc_off = (vc_row[:, None, None] + (h64 * VC_H)[None, :, None]
                      + (d64 * VC_D)[None, None, :])
            store_quantized(key_cache_ptr, kc_off, store_mask, k, km, ks2, ky, QUANT, STEPS,
                            NATIVE)
            store_quantized(value_cache_ptr, vc_off, store_mask, v, vm, vs2, vy, QUANT, STEPS,
                            NATIVE)
        else:
            STRIDE_B: tl.constexpr = CACHE[0]
            STRIDE_S: tl.constexpr = CACHE[1]
            STRIDE_H: tl.constexpr = CACHE[2]
            cache_row = block * STRIDE_B + (slot - block * BLOCK_SIZE) * STRIDE_S  # int64
            cache_col = h.to(tl.int64) * STRIDE_H
            c_off = cache_row[:, None, None] + cache_col[None, :, None] + offs_d[None, None, :]
            store_quantized(key_cache_ptr, c_off, store_mask, k, km, ks2, ky, QUANT, STEPS,
                            NATIVE)
            store_quantized(value_cache_ptr, c_off, store_mask, v, vm, vs2, vy, QUANT, STEPS,
                            NATIVE)

    @triton.jit
    def token_prologue(num_tokens, BLOCK_T: tl.constexpr, PDL: tl.constexpr,
                       PDL_TRIGGER: tl.constexpr):
        """``pdl_entry``, then (t, t_in, t64): the program's ``[BLOCK_T]`` tokens, which of them
        are below ``num_tokens``, and ``t`` as int64."""
        pdl_entry(PDL, PDL_TRIGGER)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_in = t < num_tokens
        t64 = t.to(tl.int64)
        return t, t_in, t64

    @triton.jit
    def cache_offsets(slot, cached_valid, in_row, h, d, num_slots, BLOCK_SIZE: tl.constexpr,
                      stride_b, stride_s, stride_h):
        """The store mask (a cached token with a valid position and a slot in [0, num_slots), an
        element of the row) and the element offsets into either cache."""
        ok = cached_valid & (slot >= 0) & (slot < num_slots)
        store_mask = ok[:, None, None] & in_row
        block = slot // BLOCK_SIZE
        cache_row = block * stride_b + (slot - block * BLOCK_SIZE) * stride_s
        return store_mask, cache_row[:, None, None] + h.to(tl.int64) * stride_h + d


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor, cache_dtype: CacheDType,
             k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, tuning: TritonTuning,
             block_size: int, legacy: bool, cache_strides: tuple[int, ...]) -> None:
    """Launch :func:`kv_write_kernel` on PyTorch's current stream (arguments as validated by the
    public op; ``legacy``, ``cache_strides``: its LEGACY and CACHE, ``block_size``: the caches')."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    t_pad, num_heads, head_size = key.shape
    quant = quant_code(cache_dtype)
    block_t, block_h, block_d, num_warps, grid, evict = tiling(
        num_tokens, num_heads, head_size, key.element_size(), quant != COPY, tuning)
    k_per_head = quant != COPY and scale_is_per_head(k_scale)
    v_per_head = quant != COPY and scale_is_per_head(v_scale)
    pdl, trigger = pdl_launch(key.device, grid[0] * grid[1], tuning.pdl_max_programs,
                              tuning.pdl_trigger_max_programs)
    # A stride along a dim of size 1 never multiplies a nonzero index: 0 there, so that it does
    # not compile another variant (the callers' cache_strides follow the same rule).
    kv_write_kernel[grid](
        key, value, code_view(key_cache), code_view(value_cache), slot_mapping, k_scale, v_scale,
        num_tokens,
        KEY_STRIDE=key.stride(0) if t_pad > 1 else 0,
        VALUE_STRIDE=value.stride(0) if t_pad > 1 else 0,
        NUM_SLOTS=key_cache.shape[0] * block_size, NUM_HEADS=num_heads, HEAD_SIZE=head_size,
        BLOCK_SIZE=block_size, QUANT=quant, K_PER_HEAD=k_per_head, V_PER_HEAD=v_per_head,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, LOAD_EVICT=evict, PDL=pdl,
        PDL_TRIGGER=trigger, NATIVE=triton_support.native_fp8(key.device), LEGACY=legacy,
        CACHE=cache_strides, num_warps=num_warps, launch_pdl=pdl,
    )
