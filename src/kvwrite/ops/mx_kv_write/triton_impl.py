"""The Triton implementation of the MX writes (SPEC §10.3): one kernel for both formats, both
scale rules and both scale layouts.

One program quantizes ``BLOCK_T`` tokens x ``BLOCK_Q`` groups of 32 elements (a flat group index
over the token's ``H * D/32`` groups: heads are dense in the input), for K and for V: it loads
the rows (masked by the token and group bounds only), then the slots, runs the group rule
(kernels.triton_mx) and stores 32 (mxfp8) or 16 (mxfp4) code bytes and one scale byte per group
through the views' strides. Offsets are 64-bit. The scale byte's address takes six strides
(block, head, offset // 128, offset % 32, (offset % 128) // 32, group): the interleaved128
layout's own, the linear layout's derived (cuda_impl.scale_strides). Strides, the slot count and
the geometry are compile-time constants; nothing is read on the host per call, so ``run`` is
CUDA-graph safe.

Every step is exact (integer work on bits, products by powers of two, bfloat16 widened from its
bits), so the interpreter (``TRITON_INTERPRET=1``) writes the GPU's bytes. The one exception in
form, not in bytes: compiled mxfp8 kernels on sm_89 and later (``triton_support.native_fp8``)
take the E4M3 codes from Triton's float8 conversion (cvt.rn.satfinite.e4m3x2.f32, the CUDA
kernel's), about half the instructions of the integer steps the interpreter runs; the GPU tests compare them.
Small calls (``TritonTuning.small_call_groups``) spread a group over 4 threads.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ...gather import bits_view
from ...kernels import triton_support
from ...kernels.mx_views import (
    GROUP,
    data_strides,
    is_floor,
    is_fp4,
    is_interleaved,
    scale_strides,
)
from ...kernels.triton_fp8 import IMPORT_ERROR as _IMPORT_ERROR
from ...kernels.triton_fp8 import pdl_entry, tl, triton
from ...kernels.triton_mx import mx_rule
from ...kernels.triton_nvfp4 import widen
from ...kernels.triton_support import GroupTuning, group_tiling

__all__ = ["TritonTuning", "TUNING", "available", "unsupported", "run"]


def available(device: torch.device) -> str | None:
    return triton_support.available(device, triton, lambda: _mx_kernel, _IMPORT_ERROR)


def unsupported(key, key_cache, mode, scale_layout) -> str | None:
    return None


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class TritonTuning(GroupTuning):
    """Launch shapes. ``TUNING`` is what every call uses unless a caller passes another one."""

    # Input bytes of K per program (as many of V), as for reshape_and_cache_flash's 4 KiB tiles.
    # Not measured for this kernel yet.
    tile_bytes: int = 4096
    # Input bytes of K per warp: 2 KiB is 32 groups of 16-bit input, one a thread.
    bytes_per_warp: int = 2048
    max_warps: int = 8
    # Calls of at most small_call_groups groups of K (T * H * D/32; 2048: 64 tokens of H=8,
    # D=128) take small_bytes_per_warp: 512 B is 8 groups of 16-bit input a warp, a group over 4
    # threads (Triton's layout spreads the 32 elements over the lanes; the amax is a shuffle
    # reduction). sm_90 PTX, bfloat16, H=8, D=128, T=1: one warp of 1863 (mxfp8) / 1722 (mxfp4)
    # instructions a thread before, four warps of 558 / 506 (302 mxfp8 with NATIVE) after: the
    # per-thread chain is the small call's time, as in the CUDA small-call kernel. Estimated
    # from those counts, not measured.
    small_call_groups: int = 2048
    small_bytes_per_warp: int = 512


TUNING = TritonTuning()

@functools.lru_cache(maxsize=64)
def _small_tuning(tuning: TritonTuning) -> TritonTuning:
    """``tuning`` with small_bytes_per_warp as its bytes_per_warp (small calls' tiling)."""
    return dataclasses.replace(tuning, bytes_per_warp=tuning.small_bytes_per_warp)


if triton is not None:

    @triton.jit
    def _store_group(data_ptr, sf_ptr, x, blk, pg, h, g, ok2,
                     D_SB: tl.constexpr, D_SS: tl.constexpr, D_SH: tl.constexpr,
                     D_SE: tl.constexpr, S_SB: tl.constexpr, S_SH: tl.constexpr,
                     S_128: tl.constexpr, S_32: tl.constexpr, S_4: tl.constexpr,
                     S_G: tl.constexpr, FP4: tl.constexpr, FLOOR: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_Q: tl.constexpr, NATIVE: tl.constexpr):
        """The rule of groups ``x`` [BLOCK_T, BLOCK_Q, 32] and their stores where ``ok2``."""
        sc, codes = mx_rule(x, FP4, FLOOR, BLOCK_T, BLOCK_Q, NATIVE)
        if FP4:
            NB: tl.constexpr = 16
        else:
            NB: tl.constexpr = 32
        j = tl.arange(0, NB)
        d = (blk * D_SB + pg * D_SS)[:, None, None] + (h * D_SH + g * (NB * D_SE))[None, :, None] \
            + (j * D_SE)[None, None, :]
        tl.store(data_ptr + d, codes, mask=ok2[:, :, None])
        o = (blk * S_SB + (pg // 128) * S_128 + (pg % 32) * S_32 + ((pg // 32) % 4) * S_4)
        s = o[:, None] + (h * S_SH + g * S_G)[None, :]
        tl.store(sf_ptr + s, sc, mask=ok2)

    @triton.jit(do_not_specialize=["num_tokens"])
    def _mx_kernel(
        key_ptr, value_ptr,  # [T_pad, H, D]; token strides KEY_STRIDE / VALUE_STRIDE (elements)
        k_data_ptr, v_data_ptr,  # uint8 [num_blocks, block_size, H, F] via strides
        k_sf_ptr, v_sf_ptr,  # uint8 scale bytes via six strides each
        slot_mapping_ptr,  # [T] int64 or int32
        num_tokens,  # T
        KEY_STRIDE: tl.constexpr, VALUE_STRIDE: tl.constexpr,
        KD_SB: tl.constexpr, KD_SS: tl.constexpr, KD_SH: tl.constexpr, KD_SE: tl.constexpr,
        VD_SB: tl.constexpr, VD_SS: tl.constexpr, VD_SH: tl.constexpr, VD_SE: tl.constexpr,
        KS_SB: tl.constexpr, KS_SH: tl.constexpr, KS_128: tl.constexpr, KS_32: tl.constexpr,
        KS_4: tl.constexpr, KS_G: tl.constexpr,
        VS_SB: tl.constexpr, VS_SH: tl.constexpr, VS_128: tl.constexpr, VS_32: tl.constexpr,
        VS_4: tl.constexpr, VS_G: tl.constexpr,
        NUM_SLOTS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        G: tl.constexpr,  # groups per head, D / 32
        NUM_GROUPS: tl.constexpr,  # groups per token, H * G
        FP4: tl.constexpr, FLOOR: tl.constexpr, BF16_BITS: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_Q: tl.constexpr,
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,  # programmatic dependent launch
        NATIVE: tl.constexpr = False,  # E4M3 by Triton's float8 conversion (native_fp8)
    ):
        pdl_entry(PDL, PDL_TRIGGER)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        e = tl.arange(0, 32)
        t_in = t < num_tokens
        q_in = q < NUM_GROUPS
        t64 = t.to(tl.int64)
        in3 = t_in[:, None, None] & q_in[None, :, None]
        col = (q * 32)[None, :, None] + e[None, None, :]
        xk = tl.load(key_ptr + (t64 * KEY_STRIDE)[:, None, None] + col, mask=in3, other=0)
        xv = tl.load(value_ptr + (t64 * VALUE_STRIDE)[:, None, None] + col, mask=in3, other=0)
        slot = tl.load(slot_mapping_ptr + t, mask=t_in, other=-1).to(tl.int64)
        valid = t_in & (slot >= 0) & (slot < NUM_SLOTS)
        blk = slot // BLOCK_SIZE
        pg = slot - blk * BLOCK_SIZE
        h = (q // G).to(tl.int64)
        g = (q - (q // G) * G).to(tl.int64)
        ok2 = valid[:, None] & q_in[None, :]
        _store_group(k_data_ptr, k_sf_ptr, widen(xk, BF16_BITS), blk, pg, h, g, ok2,
                     KD_SB, KD_SS, KD_SH, KD_SE, KS_SB, KS_SH, KS_128, KS_32, KS_4, KS_G,
                     FP4, FLOOR, BLOCK_T, BLOCK_Q, NATIVE)
        _store_group(v_data_ptr, v_sf_ptr, widen(xv, BF16_BITS), blk, pg, h, g, ok2,
                     VD_SB, VD_SS, VD_SH, VD_SE, VS_SB, VS_SH, VS_128, VS_32, VS_4, VS_G,
                     FP4, FLOOR, BLOCK_T, BLOCK_Q, NATIVE)


def run(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
        value_cache: torch.Tensor, k_scale_cache: torch.Tensor, v_scale_cache: torch.Tensor,
        slot_mapping: torch.Tensor, mode, scale_rule, scale_layout, *,
        tuning: TritonTuning = TUNING) -> None:
    """Launch the kernel on PyTorch's current stream; arguments as validated by the public op."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    t_pad, num_heads, head_size = key.shape
    groups = head_size // GROUP
    num_blocks, block_size = key_cache.shape[:2]
    tiling = _small_tuning(tuning) if num_tokens * num_heads * groups <= \
        tuning.small_call_groups else tuning
    block_t, block_q, warps = group_tiling(num_tokens, num_heads * groups,
                                           GROUP * key.element_size(), tiling)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_heads * groups, block_q))
    pdl, trigger = triton_support.pdl_launch(key.device, grid[0] * grid[1],
                                             tuning.pdl_max_programs,
                                             tuning.pdl_trigger_max_programs)
    bf16 = key.dtype == torch.bfloat16
    if bf16:
        key, value = key.view(torch.int16), value.view(torch.int16)
    # One-byte caches (op.py checks their dtypes), so their uint8 views, same strides.
    kc, vc, ksc, vsc = (bits_view(x)
                        for x in (key_cache, value_cache, k_scale_cache, v_scale_cache))
    kd, vd = data_strides(kc), data_strides(vc)
    inter = is_interleaved(scale_layout)
    ks, vs = scale_strides(ksc, inter), scale_strides(vsc, inter)
    _mx_kernel[grid](
        key, value, kc, vc, ksc, vsc, slot_mapping, num_tokens,
        KEY_STRIDE=key.stride(0) if t_pad > 1 else 0,
        VALUE_STRIDE=value.stride(0) if t_pad > 1 else 0,
        KD_SB=kd[0], KD_SS=kd[1], KD_SH=kd[2], KD_SE=kd[3],
        VD_SB=vd[0], VD_SS=vd[1], VD_SH=vd[2], VD_SE=vd[3],
        KS_SB=ks[0], KS_SH=ks[1], KS_128=ks[2], KS_32=ks[3], KS_4=ks[4], KS_G=ks[5],
        VS_SB=vs[0], VS_SH=vs[1], VS_128=vs[2], VS_32=vs[3], VS_4=vs[4], VS_G=vs[5],
        NUM_SLOTS=num_blocks * block_size, BLOCK_SIZE=block_size, G=groups,
        NUM_GROUPS=num_heads * groups, FP4=is_fp4(mode), FLOOR=is_floor(scale_rule),
        BF16_BITS=bf16, BLOCK_T=block_t, BLOCK_Q=block_q, PDL=pdl, PDL_TRIGGER=trigger,
        NATIVE=not is_fp4(mode) and triton_support.native_fp8(key.device), num_warps=warps, launch_pdl=pdl,
        enable_fp_fusion=False,
    )
