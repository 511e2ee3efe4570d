"""The Triton implementation of indexer_k_quant_and_cache.

One program writes ``BLOCK_T`` tokens: it loads their rows as ``[BLOCK_T, BLOCK_G, BLOCK_Q]``
(groups and group elements rounded up to powers of two, masked; the loads masked by the token
bound only, so they do not wait for the slots), reduces each group's amax with NaN replaced by 0
(fmaxf's rule, from 0), computes ``s = div_rn(max(amax, float32(1e-4)), 448)`` (a true
division), rounds it up to a power of two from its bits for "ue8m0" and "mxfp8", and stores
each element as e4m3 of the exact quotient ``x / s`` (``kvwrite.kernels.triton_fp8``: no division
per element) and each scale as 4 bytes (its float32 bits, or for "mxfp8" its biased exponent 4
times), through the page layout (codes at ``page + o*D``, scales at ``page +
block_size*D + 4*(o*G + g)``). Offsets are 64-bit; strides and the geometry are compile-time
constants; nothing is read on the host per call, so ``run`` is CUDA-graph safe.

On CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``), where the codes come from
``fp8_bytes``'s integer steps (``NATIVE`` false): exact, for every input dtype (its bfloat16 ->
float32 widening mangles only subnormals, whose quotients by a scale of at least 1e-4 / 448 are
±0 codes either way, their sign kept; the floor keeps their amax out of the scale).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ...kernels import triton_support
from ...kernels.triton_fp8 import IMPORT_ERROR as _IMPORT_ERROR
from ...kernels.triton_fp8 import fp8_bytes, fp8_quotient, fp8_scale, tl, triton, ue8m0_round_up
from ...kernels.triton_kv import token_prologue
from ...kernels.triton_support import PdlTuning, next_pow2
from .op import E4M3_MAX, SCALE_FLOOR_BITS, ScaleFormat

__all__ = ["TritonTuning", "TUNING", "available", "unsupported", "run"]


def available(device: torch.device) -> str | None:
    return triton_support.available(device, triton, lambda: _indexer_kernel, _IMPORT_ERROR)


def unsupported(k: torch.Tensor, kv_cache: torch.Tensor, fmt: ScaleFormat) -> str | None:
    return None


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class TritonTuning(PdlTuning):
    """Launch shapes. ``TUNING`` is what every call uses unless a caller passes another one. Not
    measured yet: concat_and_cache_mla's fp8_ds_mla tiles (2 KiB of input per program, 512 bytes
    per warp), whose per-token work is the same."""

    tile_bytes: int = 2048
    bytes_per_warp: int = 512
    max_warps: int = 8


TUNING = TritonTuning()


@functools.lru_cache(maxsize=256)
def _tiling(num_tokens: int, row_bytes: int, tuning: TritonTuning = TUNING) -> tuple[int, int]:
    """(BLOCK_T, num_warps): as many whole (padded) rows as fit the tile (a power of two, at
    most T rounded up to one)."""
    block_t = 1
    while block_t * 2 * row_bytes <= tuning.tile_bytes and block_t < next_pow2(num_tokens):
        block_t *= 2
    warps = min(tuning.max_warps, max(1, block_t * row_bytes // tuning.bytes_per_warp))
    return block_t, 1 << (warps.bit_length() - 1)


if triton is not None:
    FLOOR_BITS = tl.constexpr(SCALE_FLOOR_BITS)  # float32(1e-4)
    FMAX = tl.constexpr(E4M3_MAX)

    @triton.jit(do_not_specialize=["num_tokens"])
    def _indexer_kernel(
        k_ptr,  # [T_pad, D], token stride K_STRIDE (elements)
        cache_ptr,  # uint8 pages of BLOCK_SIZE * (D + 4G) bytes, page stride STRIDE_B
        slot_mapping_ptr,  # [T] int64 or int32
        num_tokens,  # T
        K_STRIDE: tl.constexpr,
        STRIDE_B: tl.constexpr,
        NUM_SLOTS: tl.constexpr,  # num_blocks * block_size
        BLOCK_SIZE: tl.constexpr,
        D: tl.constexpr,
        Q: tl.constexpr,  # quant_block_size
        G: tl.constexpr,  # D / Q
        BLOCK_G: tl.constexpr,  # G and Q rounded up to powers of two (masked)
        BLOCK_Q: tl.constexpr,
        UE8M0: tl.constexpr,  # power-of-two scales ("ue8m0" and "mxfp8")
        MXFP8: tl.constexpr,  # scale bytes: the biased exponent 4 times, not the float32 bits
        BLOCK_T: tl.constexpr,
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,  # programmatic dependent launch (pdl_entry)
        NATIVE: tl.constexpr,  # fp8 codes by the float8 conversion (triton_support.native_fp8)
    ):
        t, t_in, t64 = token_prologue(num_tokens, BLOCK_T, PDL, PDL_TRIGGER)
        g = tl.arange(0, BLOCK_G)
        j = tl.arange(0, BLOCK_Q)
        col = (g * Q)[None, :, None] + j[None, None, :]  # [1, BLOCK_G, BLOCK_Q]
        in_g = (g < G)[None, :, None]
        in_gq = in_g & (j < Q)[None, None, :]
        x = tl.load(k_ptr + (t64 * K_STRIDE)[:, None, None] + col,
                    mask=t_in[:, None, None] & in_gq, other=0.0)
        slot = tl.load(slot_mapping_ptr + t, mask=t_in, other=-1).to(tl.int64)
        # Padding (slot < 0) and out-of-range slots are not stored.
        valid = t_in & (slot >= 0) & (slot < NUM_SLOTS)
        # 16-bit inputs need one correction step of the quotient, float32 two.
        STEPS: tl.constexpr = 2 if k_ptr.dtype.element_ty == tl.float32 else 1
        xf = x.to(tl.float32)
        a = tl.where(xf == xf, tl.abs(xf), 0.0)  # NaN ignored, as fmaxf does
        amax = tl.max(a, axis=2)  # [BLOCK_T, BLOCK_G]
        floor = tl.full(amax.shape, FLOOR_BITS, tl.int32).to(tl.float32, bitcast=True)
        s = tl.math.div_rn(tl.maximum(amax, floor), tl.full(amax.shape, FMAX, tl.float32))
        if UE8M0:
            s = ue8m0_round_up(s)  # s > 0
        m, s2, y = fp8_scale(s)
        q = fp8_quotient(xf, m[:, :, None], s2[:, :, None], y[:, :, None], FMAX, STEPS)
        codes = fp8_bytes(q, 1, NATIVE)
        block = slot // BLOCK_SIZE
        o = slot - block * BLOCK_SIZE
        page = block * STRIDE_B  # int64
        ok = valid[:, None, None]
        tl.store(cache_ptr + (page + o * D)[:, None, None] + col, codes, mask=ok & in_gq)
        b = tl.arange(0, 4)
        sbits = s.to(tl.int32, bitcast=True)
        if MXFP8:
            # s > 0 (a power of two or +inf): bits >> 23 is its biased exponent, 0xFF for +inf.
            sbytes = ((sbits[:, :, None] >> 23) + 0 * b[None, None, :]).to(tl.uint8)
        else:
            sbytes = ((sbits[:, :, None] >> (b * 8)[None, None, :]) & 255).to(tl.uint8)
        tl.store(cache_ptr + (page + BLOCK_SIZE * D + o * (4 * G))[:, None, None]
                 + (g * 4)[None, :, None] + b[None, None, :], sbytes, mask=ok & in_g)


def run(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
        quant_block_size: int, fmt: ScaleFormat, *, tuning: TritonTuning = TUNING) -> None:
    """Launch the kernel on PyTorch's current stream; arguments as validated by the public op."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    t_pad, head_dim = k.shape
    num_blocks, block_size, _ = kv_cache.shape
    q = quant_block_size
    groups = head_dim // q
    block_g, block_q = next_pow2(groups), next_pow2(q)
    block_t, warps = _tiling(num_tokens, block_g * block_q * k.element_size(), tuning)
    grid = (triton.cdiv(num_tokens, block_t),)
    pdl, trigger = triton_support.pdl_launch(k.device, grid[0], tuning.pdl_max_programs,
                                             tuning.pdl_trigger_max_programs)
    # A stride along a dim of size 1 never multiplies a nonzero index: 0 there, so that it does
    # not compile another variant.
    _indexer_kernel[grid](
        k, kv_cache, slot_mapping, num_tokens,
        K_STRIDE=k.stride(0) if t_pad > 1 else 0,
        STRIDE_B=kv_cache.stride(0) if num_blocks > 1 else 0,
        NUM_SLOTS=num_blocks * block_size, BLOCK_SIZE=block_size, D=head_dim, Q=q, G=groups,
        BLOCK_G=block_g, BLOCK_Q=block_q, UE8M0=fmt.power_of_two,
        MXFP8=fmt.exponent_bytes, BLOCK_T=block_t,
        PDL=pdl, PDL_TRIGGER=trigger, NATIVE=triton_support.native_fp8(k.device),
        num_warps=warps, launch_pdl=pdl,
    )
