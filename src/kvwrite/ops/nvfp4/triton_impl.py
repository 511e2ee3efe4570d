"""The Triton implementation of the NVFP4 writes: one kernel for both rules and every addressing.

One program quantizes ``BLOCK_T`` tokens x ``BLOCK_Q`` groups of 16 elements (a flat group index
over the token's ``H * D/16`` groups: heads are dense in the input), for K and for V: it loads
the rows (masked by the token and group bounds only) as each group's two halves of 8 elements,
then the slots, runs the group rule and stores 8 code bytes and one scale byte per group through
the four byte views' strides (vLLM's page layout and FlashInfer's tensors are the same code).
Offsets are 64-bit. A 16-bit input's half is one 16-byte access (float32's two, concatenated in
registers), so each thread holds whole groups: the amax, the scale and the codes' packing take
no shuffles and no shared memory, and each group's scale is computed once (a group spread over
16 or 2 threads computed it in each). Where the rows and the data are 4-byte aligned (``run``
checks the pointers and strides), 16-bit rows are loaded as int32 words (two elements a word)
and the codes stored as words; else element loads and byte stores. Strides, the slot count and
the geometry are compile-time constants (one compiled variant per cache geometry and input
layout); nothing is read on the host per call, so ``run`` is CUDA-graph safe: a replay sees new
inputs, slots and scale tensors.

The group rule (docs/ops/nvfp4.md) is kvwrite.kernels.triton_nvfp4's group_rule_halves (the
transfer pages take it too): each step one IEEE float32 operation rounded to nearest
even, launched here with FMA contraction off (``enable_fp_fusion=False``), no float8 cast,
bfloat16 widened from its bits: so Triton's interpreter (``TRITON_INTERPRET=1``) writes the
GPU's bytes, and the CPU tests compare it in full. Compiled for sm_89 and later (NATIVE), the
scale codes come from Triton's float8 conversion and the packing's shift-in from a funnel shift:
the same bytes in fewer instructions (the GPU tests compare them).
"""

from __future__ import annotations

import dataclasses

import torch

from ...dtypes import CacheDType
from ...kernels import triton_support
from ...kernels.triton_fp8 import IMPORT_ERROR as _IMPORT_ERROR
from ...kernels.triton_fp8 import pdl_entry, tl, triton
from ...kernels.triton_nvfp4 import group_rule_halves, store_code_words, widen, widen_words
from ...kernels.triton_support import GroupTuning, group_tiling
from .op import ScaleLayout
from .rule import GROUP

__all__ = ["TritonTuning", "TUNING", "available", "unsupported", "run"]


def available(device: torch.device) -> str | None:
    return triton_support.available(device, triton, lambda: _nvfp4_kernel, _IMPORT_ERROR)


def unsupported(key, k_data, cache_dtype, v_scale_layout) -> str | None:
    return None


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class TritonTuning(GroupTuning):
    """Launch shapes. ``TUNING`` is what every call uses unless a caller passes another one."""

    # Input bytes of K per program (as many of V), as for reshape_and_cache_flash's 4 KiB tiles.
    # Not measured for this kernel yet.
    tile_bytes: int = 4096
    # Input bytes of K per warp: 1 KiB is 32 groups of 16-bit input, one a thread.
    bytes_per_warp: int = 1024
    max_warps: int = 8


TUNING = TritonTuning()


if triton is not None:

    @triton.jit
    def _load_halves(ptr, t64, q, in3, STRIDE: tl.constexpr, IN_WORDS: tl.constexpr,
                     BF16_BITS: tl.constexpr, F32: tl.constexpr, BT: tl.constexpr,
                     BQ: tl.constexpr):
        """The groups ``q`` of tokens ``t64`` as their halves (elements 0-7, 8-15), each
        [BT, BQ, 8] float32 (masked-off groups read as zeros). A 16-bit input's half is 16
        contiguous bytes, one access: Triton gives each thread whole groups (group_rule_halves
        takes no shuffles). IN_WORDS (16-bit rows, 4-byte aligned rows and even STRIDE): each
        half as 4 int32 words, widened two elements a word (:func:`widen_words`)."""
        if IN_WORDS:
            w = tl.arange(0, 4)
            row = ptr.to(tl.pointer_type(tl.int32)) + (t64 * (STRIDE // 2))[:, None, None] \
                + ((q * 8)[None, :, None] + w[None, None, :])
            x0 = widen_words(tl.load(row, mask=in3, other=0), BF16_BITS, BT, BQ)
            x1 = widen_words(tl.load(row + 4, mask=in3, other=0), BF16_BITS, BT, BQ)
        elif F32:
            # float32: a half is 32 bytes, two 16-byte quarters, concatenated in registers.
            e = tl.arange(0, 4)
            row = ptr + (t64 * STRIDE)[:, None, None] + ((q * 16)[None, :, None]
                                                         + e[None, None, :])
            x0 = _concat4(tl.load(row, mask=in3, other=0), tl.load(row + 4, mask=in3, other=0),
                          BT, BQ)
            x1 = _concat4(tl.load(row + 8, mask=in3, other=0),
                          tl.load(row + 12, mask=in3, other=0), BT, BQ)
        else:
            e = tl.arange(0, 8)
            row = ptr + (t64 * STRIDE)[:, None, None] + ((q * 16)[None, :, None]
                                                         + e[None, None, :])
            x0 = widen(tl.load(row, mask=in3, other=0), BF16_BITS)
            x1 = widen(tl.load(row + 8, mask=in3, other=0), BF16_BITS)
        return x0, x1

    @triton.jit
    def _concat4(a, b, BT: tl.constexpr, BQ: tl.constexpr):
        """[BT, BQ, 4] ``a`` then ``b`` as [BT, BQ, 8] (a's columns 0-3, b's 4-7)."""
        return tl.reshape(tl.permute(tl.join(a, b), (0, 1, 3, 2)), (BT, BQ, 8))

    @triton.jit(do_not_specialize=["num_tokens"])
    def _nvfp4_kernel(
        key_ptr, value_ptr,  # [T_pad, H, D]; token strides KEY_STRIDE / VALUE_STRIDE (elements)
        k_data_ptr, k_sf_ptr,  # uint8 [num_blocks, block_size, H, D/2] / [.., D/16] via strides
        v_data_ptr, v_sf_ptr,
        slot_mapping_ptr,  # [T] int64 or int32
        k_scale_ptr, v_scale_ptr,  # [1] float32 (SCALE_IN_MEMORY), else unused
        k_scale_value, v_scale_value,  # float32 (not SCALE_IN_MEMORY)
        num_tokens,  # T
        KEY_STRIDE: tl.constexpr, VALUE_STRIDE: tl.constexpr,
        KD_SB: tl.constexpr, KD_SS: tl.constexpr, KD_SH: tl.constexpr,  # K data strides (bytes)
        KS_SB: tl.constexpr, KS_SS: tl.constexpr, KS_SH: tl.constexpr,  # K scale strides
        VD_SB: tl.constexpr, VD_SS: tl.constexpr, VD_SH: tl.constexpr,
        VS_SB: tl.constexpr, VS_SS: tl.constexpr, VS_SH: tl.constexpr,
        NUM_SLOTS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        G: tl.constexpr,  # groups per head, D / 16
        NUM_GROUPS: tl.constexpr,  # groups per token, H * G
        FOUR_OVER_SIX: tl.constexpr, V_SWIZZLE: tl.constexpr, BF16_BITS: tl.constexpr,
        SCALE_IN_MEMORY: tl.constexpr,
        IN_WORDS: tl.constexpr,  # 16-bit rows loaded as int32 words (rows 4-byte aligned)
        DATA_WORDS: tl.constexpr,  # code words stored as uint32 (data 4-byte aligned)
        NATIVE: tl.constexpr,  # compiled for sm_89 and later (triton_support.native_fp8)
        F32: tl.constexpr,  # float32 input
        BLOCK_T: tl.constexpr, BLOCK_Q: tl.constexpr,
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,  # programmatic dependent launch
    ):
        pdl_entry(PDL, PDL_TRIGGER)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        t_in = t < num_tokens
        q_in = q < NUM_GROUPS
        t64 = t.to(tl.int64)
        in3 = t_in[:, None, None] & q_in[None, :, None]
        xk0, xk1 = _load_halves(key_ptr, t64, q, in3, KEY_STRIDE, IN_WORDS, BF16_BITS, F32,
                                BLOCK_T, BLOCK_Q)
        xv0, xv1 = _load_halves(value_ptr, t64, q, in3, VALUE_STRIDE, IN_WORDS, BF16_BITS, F32,
                                BLOCK_T, BLOCK_Q)
        if SCALE_IN_MEMORY:
            k = tl.load(k_scale_ptr)
            v = tl.load(v_scale_ptr)
        else:
            k = tl.cast(k_scale_value, tl.float32)
            v = tl.cast(v_scale_value, tl.float32)
        slot = tl.load(slot_mapping_ptr + t, mask=t_in, other=-1).to(tl.int64)
        valid = t_in & (slot >= 0) & (slot < NUM_SLOTS)
        blk = slot // BLOCK_SIZE
        pg = slot - blk * BLOCK_SIZE
        h = q // G
        g = q - h * G
        ok2 = valid[:, None] & q_in[None, :]
        ok3 = ok2[:, :, None]

        sk, ck0, ck1 = group_rule_halves(xk0, xk1, k, FOUR_OVER_SIX, BLOCK_T, BLOCK_Q, NATIVE)
        kd = (blk * KD_SB + pg * KD_SS)[:, None, None] + (h * KD_SH + g * 8)[None, :, None]
        store_code_words(k_data_ptr + kd, ck0, ck1, ok3, DATA_WORDS)
        ks = (blk * KS_SB + pg * KS_SS)[:, None] + (h * KS_SH + g)[None, :]
        tl.store(k_sf_ptr + ks, sk.to(tl.uint8), mask=ok2)

        sv, cv0, cv1 = group_rule_halves(xv0, xv1, v, FOUR_OVER_SIX, BLOCK_T, BLOCK_Q, NATIVE)
        vd = (blk * VD_SB + pg * VD_SS)[:, None, None] + (h * VD_SH + g * 8)[None, :, None]
        store_code_words(v_data_ptr + vd, cv0, cv1, ok3, DATA_WORDS)
        if V_SWIZZLE:
            # Group g of offset t: row 4*(t//4) + g//(G/4), byte 4*(g % (G/4)) + t % 4.
            Q4: tl.constexpr = G // 4
            tp = (pg - pg % 4)[:, None] + (g // Q4)[None, :]
            gp = (4 * (g % Q4))[None, :] + (pg % 4)[:, None]
            vs = (blk * VS_SB)[:, None] + tp * VS_SS + (h * VS_SH)[None, :] + gp
        else:
            vs = (blk * VS_SB + pg * VS_SS)[:, None] + (h * VS_SH + g)[None, :]
        tl.store(v_sf_ptr + vs, sv.to(tl.uint8), mask=ok2)


def _zero_if_one(stride: int, size: int) -> int:
    """A stride along a dim of size 1 never multiplies a nonzero index: 0 there, so that it does
    not compile another variant."""
    return stride if size > 1 else 0


def run(key: torch.Tensor, value: torch.Tensor, k_data: torch.Tensor, k_sf: torch.Tensor,
        v_data: torch.Tensor, v_sf: torch.Tensor, slot_mapping: torch.Tensor,
        cache_dtype: CacheDType, k_scale, v_scale, v_scale_layout: ScaleLayout, *,
        tuning: TritonTuning = TUNING) -> None:
    """Launch the kernel on PyTorch's current stream; arguments as validated by the public op."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    t_pad, num_heads, head_size = key.shape
    groups = head_size // GROUP
    num_blocks, block_size = k_data.shape[:2]
    block_t, block_q, warps = group_tiling(num_tokens, num_heads * groups,
                                           GROUP * key.element_size(), tuning)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_heads * groups, block_q))
    pdl, trigger = triton_support.pdl_launch(key.device, grid[0] * grid[1],
                                             tuning.pdl_max_programs,
                                             tuning.pdl_trigger_max_programs)
    bf16 = key.dtype == torch.bfloat16
    if bf16:
        key, value = key.view(torch.int16), value.view(torch.int16)
    in_memory = isinstance(k_scale, torch.Tensor)

    def strides(view):
        sb, ss, sh, _ = view.stride()
        return (_zero_if_one(sb, num_blocks), _zero_if_one(ss, block_size),
                _zero_if_one(sh, num_heads))

    kd, ks, vd, vs = (strides(x) for x in (k_data, k_sf, v_data, v_sf))
    key_stride = key.stride(0) if t_pad > 1 else 0
    value_stride = value.stride(0) if t_pad > 1 else 0
    # Word accesses where every address they take is 4-byte aligned (the row starts and token
    # strides; the data starts and strides); else element loads and byte stores.
    in_words = key.element_size() == 2 and all(
        x.data_ptr() % 4 == 0 and s % 2 == 0 for x, s in ((key, key_stride),
                                                          (value, value_stride)))
    data_words = all(x.data_ptr() % 4 == 0 for x in (k_data, v_data)) and all(
        s % 4 == 0 for s in kd + vd)
    _nvfp4_kernel[grid](
        key, value, k_data, k_sf, v_data, v_sf, slot_mapping,
        k_scale if in_memory else None, v_scale if in_memory else None,
        0.0 if in_memory else float(k_scale), 0.0 if in_memory else float(v_scale), num_tokens,
        KEY_STRIDE=key_stride, VALUE_STRIDE=value_stride,
        KD_SB=kd[0], KD_SS=kd[1], KD_SH=kd[2], KS_SB=ks[0], KS_SS=ks[1], KS_SH=ks[2],
        VD_SB=vd[0], VD_SS=vd[1], VD_SH=vd[2], VS_SB=vs[0], VS_SS=vs[1], VS_SH=vs[2],
        NUM_SLOTS=num_blocks * block_size, BLOCK_SIZE=block_size, G=groups,
        NUM_GROUPS=num_heads * groups, FOUR_OVER_SIX=cache_dtype is CacheDType.NVFP4_4OVER6,
        V_SWIZZLE=v_scale_layout is ScaleLayout.SWIZZLED, BF16_BITS=bf16,
        SCALE_IN_MEMORY=in_memory, IN_WORDS=in_words, DATA_WORDS=data_words,
        NATIVE=triton_support.native_fp8(key.device), F32=key.dtype == torch.float32,
        BLOCK_T=block_t, BLOCK_Q=block_q, PDL=pdl,
        PDL_TRIGGER=trigger, num_warps=warps, launch_pdl=pdl, enable_fp_fusion=False,
    )
