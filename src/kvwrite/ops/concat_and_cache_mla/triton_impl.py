"""The Triton implementation of concat_and_cache_mla: one kernel for every mode.

One program writes ``BLOCK_T`` tokens: it reads their slots, loads their ``kv_c`` and ``k_pe``
rows (masked by the token bound only, so the loads do not wait for the slots), converts them and
stores them through the cache strides. Offsets are 64-bit. The strides, the slot count and the
geometry are compile-time constants (one compiled variant per cache geometry and input layout);
nothing is read on the host per call, so ``run`` is CUDA-graph safe: a replay sees new inputs,
slots and scale.

- "auto": the bits are copied; "fp8_e4m3"/"fp8_e5m2": the fp8 rule with the one scale, exactly
  (``kvwrite.kernels.triton_fp8``: the true float32 quotient without a division per element).
- "fp8_ds_mla": ``kv_c`` is loaded as ``[BLOCK_T, 4, 128]``; each tile's amax is a reduction
  over the tile with NaN replaced by 0 (fmaxf's rule, from 0), ``r = div_rn(amax, 448)`` a true
  division, ``s`` from it by the rule (the constexpr ``POW2``: ``ue8m0_round_up(max(r,
  float32(1e-4)))``, else ``max(r, FLT_MIN)``), and each element is e4m3 of the exact quotient
  ``x / s``. The scales and the rotary part are stored as bytes (``k_pe`` is read through a byte
  view), so any cache row alignment works; with ``P = 0`` (NoPE) the rotary bytes are zeros.

On CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``), where the codes come from
``fp8_bytes``'s integer steps (``NATIVE`` false), exact; its bfloat16 -> float32 widening is not
for subnormals (``kvwrite.kernels.triton_support.interpreter_inexact``), which an fp8 mode's
scale may turn into codes: :func:`unsupported` refuses the fp8 modes of bfloat16 input there.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ...dtypes import SCALE_FLOOR_1E4_BITS
from ...kernels import triton_support
from ...kernels.triton_fp8 import COPY as _COPY
from ...kernels.triton_fp8 import E4M3 as _E4M3
from ...kernels.triton_fp8 import E5M2 as _E5M2
from ...kernels.triton_fp8 import IMPORT_ERROR as _IMPORT_ERROR
from ...kernels.triton_fp8 import (
    code_view,
    fp8_bytes,
    fp8_quotient,
    fp8_scale,
    store_quantized,
    tl,
    triton,
    ue8m0_round_up,
)
from ...kernels.triton_kv import token_prologue
from ...kernels.triton_support import PdlTuning, next_pow2
from .op import (
    DEFAULT_DS_MLA_SCALE,
    DS_MLA_L,
    DS_MLA_P,
    DS_MLA_PE_OFFSET,
    DS_MLA_SCALES_OFFSET,
    DS_MLA_TILE,
    DsMlaScale,
    MlaMode,
)

__all__ = ["TritonTuning", "TUNING", "available", "unsupported", "run"]

_DS = 3  # MODE code of fp8_ds_mla (0-2 are triton_fp8's COPY, E4M3, E5M2)
_MODE = {MlaMode.AUTO: _COPY, MlaMode.FP8_E4M3: _E4M3, MlaMode.FP8_E5M2: _E5M2,
         MlaMode.FP8_DS_MLA: _DS}


def available(device: torch.device) -> str | None:
    return triton_support.available(device, triton, lambda: _mla_kernel, _IMPORT_ERROR)


def unsupported(kv_c: torch.Tensor, kv_cache: torch.Tensor, mode: MlaMode) -> str | None:
    if kv_c.device.type == "cuda" or mode is MlaMode.AUTO:
        return None
    fp8 = torch.float8_e5m2 if mode is MlaMode.FP8_E5M2 else torch.float8_e4m3fn
    return triton_support.inexact_cast_reason(kv_c.dtype, fp8)


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class TritonTuning(PdlTuning):
    """Launch shapes. ``TUNING`` is what every call uses unless a caller passes another one."""

    # Input bytes per program (BLOCK_T tokens of kv_c + k_pe), as for reshape_and_cache_flash's
    # 4 KiB tiles; a token's row (1152 bytes for L=512, P=64, 16-bit) is never split.
    tile_bytes: int = 4096
    # fp8_ds_mla: 2 KiB (one token of 16-bit input per program, 2 warps) vs 4 KiB (2 tokens, 4
    # warps), H100, 20-call graphs, rotated L2: T=65536 47.8 vs 52.9 us, T=16384 13.6 vs 14.8
    # us, T=16 2.15 us both (python -m tools.probes mla).
    tile_bytes_ds: int = 2048
    # Input bytes per warp: 16-byte accesses for 16-bit copies, 32 B per thread for fp8.
    bytes_per_warp: int = 512
    max_warps: int = 8
    # Large fp8 calls (more than large_call_bytes of kv_c and k_pe input; fp8_ds_mla: more than
    # large_call_bytes_ds) take tiles of large_tile_bytes (large_tile_bytes_ds) with
    # large_bytes_per_warp of input per warp: two tokens of 16-bit input per warp, so each
    # thread quantizes twice the elements. H200, rotated L2 (docs/tuning-log.md change 41):
    # fp8, 4 tokens in 2 warps instead of 2 in 4: T=65536 33.8 -> 29.5 us (79.0 -> 90.6% of
    # copy bandwidth), T=16384 9.89 -> 8.98, but T=4096 3.99 -> 4.14; fp8_ds_mla, 2 tokens in
    # 1 warp instead of 1 in 2: T=65536 42.5 -> 35.8 us, T=16384 12.40 -> 10.67, T=4096 4.59 ->
    # 4.54 (hot 3.98 -> 3.15), but T=1024 2.76 -> 2.85.
    large_call_bytes: int = 8 << 20
    large_call_bytes_ds: int = 4 << 20
    large_tile_bytes: int = 8192
    large_tile_bytes_ds: int = 4096
    large_bytes_per_warp: int = 2304


TUNING = TritonTuning()


@functools.lru_cache(maxsize=256)
def _tiling(num_tokens: int, row_bytes: int, tuning: TritonTuning = TUNING,
            mode: int = _COPY) -> tuple[int, int]:
    """(BLOCK_T, num_warps): as many whole rows as fit the tile (a power of two, at most T
    rounded up to one). ``mode``: the kernel's MODE code; large calls of the fp8 modes take the
    large tiles."""
    ds = mode == _DS
    tile = tuning.tile_bytes_ds if ds else tuning.tile_bytes
    per_warp = tuning.bytes_per_warp
    large = tuning.large_call_bytes_ds if ds else tuning.large_call_bytes
    if mode != _COPY and num_tokens * row_bytes > large:
        tile = tuning.large_tile_bytes_ds if ds else tuning.large_tile_bytes
        per_warp = tuning.large_bytes_per_warp
    block_t = 1
    while block_t * 2 * row_bytes <= tile and block_t < next_pow2(num_tokens):
        block_t *= 2
    warps = min(tuning.max_warps, max(1, block_t * row_bytes // per_warp))
    return block_t, 1 << (warps.bit_length() - 1)


if triton is not None:
    # Byte offsets of the scales and the rotary part in an fp8_ds_mla entry.
    SCALES_OFFSET = tl.constexpr(DS_MLA_SCALES_OFFSET)
    PE_OFFSET = tl.constexpr(DS_MLA_PE_OFFSET)
    PE_BYTES = tl.constexpr(2 * DS_MLA_P)
    FLOOR_1E4_BITS = tl.constexpr(SCALE_FLOOR_1E4_BITS)  # float32(1e-4), the "pow2" floor

    @triton.jit(do_not_specialize=["num_tokens"])
    def _mla_kernel(
        kv_c_ptr,  # [T_pad, L], token stride KV_C_STRIDE (elements)
        k_pe_ptr,  # [T_pad, P], token stride K_PE_STRIDE; fp8_ds_mla: its bytes [T_pad, 2P]
        cache_ptr,  # [num_blocks, block_size, E] via (STRIDE_B, STRIDE_S, 1)
        slot_mapping_ptr,  # [T] int64 or int32
        scale_ptr,  # [1] float32 (fp8_e4m3/e5m2 only; None otherwise)
        num_tokens,  # T
        KV_C_STRIDE: tl.constexpr,
        K_PE_STRIDE: tl.constexpr,
        STRIDE_B: tl.constexpr,  # cache strides in cache elements (bytes for fp8_ds_mla)
        STRIDE_S: tl.constexpr,
        NUM_SLOTS: tl.constexpr,  # num_blocks * block_size
        BLOCK_SIZE: tl.constexpr,
        L: tl.constexpr,
        P: tl.constexpr,
        BLOCK_L: tl.constexpr,  # L and P rounded up to powers of two (masked)
        BLOCK_P: tl.constexpr,
        MODE: tl.constexpr,  # COPY, E4M3, E5M2 or 3 (fp8_ds_mla)
        POW2: tl.constexpr,  # fp8_ds_mla's tile scale rule: "pow2" (True) or "amax"
        BLOCK_T: tl.constexpr,
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,  # programmatic dependent launch (pdl_entry)
        NATIVE: tl.constexpr,  # fp8 codes by the float8 conversion (triton_support.native_fp8)
    ):
        t, t_in, t64 = token_prologue(num_tokens, BLOCK_T, PDL, PDL_TRIGGER)
        slot = tl.load(slot_mapping_ptr + t, mask=t_in, other=-1).to(tl.int64)
        # Padding (slot < 0) and out-of-range slots are not stored.
        valid = t_in & (slot >= 0) & (slot < NUM_SLOTS)
        block = slot // BLOCK_SIZE
        row = block * STRIDE_B + (slot - block * BLOCK_SIZE) * STRIDE_S  # int64
        if MODE == 3:
            TILES: tl.constexpr = L // 128
            j = tl.arange(0, TILES)
            k = tl.arange(0, 128)
            col = (j * 128)[None, :, None] + k[None, None, :]  # [1, TILES, 128]
            x = tl.load(kv_c_ptr + (t64 * KV_C_STRIDE)[:, None, None] + col,
                        mask=t_in[:, None, None])
            pb = tl.arange(0, PE_BYTES)
            if P == 0:  # NoPE: the rotary bytes are zeros
                pe = tl.zeros((BLOCK_T, PE_BYTES), tl.uint8)
            else:
                pe = tl.load(k_pe_ptr + (t64 * K_PE_STRIDE)[:, None] + pb[None, :],
                             mask=t_in[:, None])
            xf = x.to(tl.float32)
            a = tl.where(xf == xf, tl.abs(xf), 0.0)  # NaN ignored, as fmaxf does
            amax = tl.max(a, axis=2)  # [BLOCK_T, TILES]
            r = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
            if POW2:
                floor = tl.full(r.shape, FLOOR_1E4_BITS, tl.int32).to(tl.float32, bitcast=True)
                s = ue8m0_round_up(tl.maximum(r, floor))
            else:
                s = tl.maximum(r, 1.1754943508222875e-38)  # FLT_MIN = 2^-126
            m, s2, y = fp8_scale(s)
            q = fp8_quotient(xf, m[:, :, None], s2[:, :, None], y[:, :, None], 448.0, 1)
            codes = fp8_bytes(q, 1, NATIVE)
            ok3 = valid[:, None, None]
            tl.store(cache_ptr + row[:, None, None] + col, codes, mask=ok3)
            b = tl.arange(0, 4)
            sbits = s.to(tl.int32, bitcast=True)
            sbytes = ((sbits[:, :, None] >> (b * 8)[None, None, :]) & 255).to(tl.uint8)
            tl.store(cache_ptr + row[:, None, None] + SCALES_OFFSET + (j * 4)[None, :, None]
                     + b[None, None, :], sbytes, mask=ok3)
            tl.store(cache_ptr + row[:, None] + PE_OFFSET + pb[None, :], pe, mask=valid[:, None])
        else:
            # 16-bit inputs need one correction step of the fp8 quotient, float32 two.
            STEPS: tl.constexpr = 2 if kv_c_ptr.dtype.element_ty == tl.float32 else 1
            offs_l = tl.arange(0, BLOCK_L)
            offs_p = tl.arange(0, BLOCK_P)
            in_l = t_in[:, None] & (offs_l < L)[None, :]
            in_p = t_in[:, None] & (offs_p < P)[None, :]
            x = tl.load(kv_c_ptr + (t64 * KV_C_STRIDE)[:, None] + offs_l[None, :], mask=in_l)
            pe = tl.load(k_pe_ptr + (t64 * K_PE_STRIDE)[:, None] + offs_p[None, :], mask=in_p)
            if MODE == 0:
                m, s2, y = 1.0, 1.0, 1.0
            else:
                m, s2, y = fp8_scale(tl.load(scale_ptr))
            store_quantized(cache_ptr, row[:, None] + offs_l[None, :], in_l & valid[:, None],
                            x, m, s2, y, MODE, STEPS, NATIVE)
            store_quantized(cache_ptr, row[:, None] + L + offs_p[None, :], in_p & valid[:, None],
                            pe, m, s2, y, MODE, STEPS, NATIVE)

assert DS_MLA_TILE == 128 and DS_MLA_L % DS_MLA_TILE == 0  # the kernel's tile shape


def run(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
        mode: MlaMode, scale: torch.Tensor | None, *,
        ds_scale: DsMlaScale = DEFAULT_DS_MLA_SCALE, tuning: TritonTuning = TUNING) -> None:
    """Launch the kernel on PyTorch's current stream; arguments as validated by the public op."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    t_pad, L = kv_c.shape
    P = k_pe.shape[1]
    code = _MODE[mode]
    if code == _DS:
        # The rotary part is copied as bytes; NoPE (P = 0) reads none (kv_c stands in for the
        # pointer: an empty tensor's may be null).
        k_pe = k_pe.view(torch.uint8) if P else kv_c
    block_t, warps = _tiling(num_tokens, (L + P) * kv_c.element_size(), tuning, code)
    num_blocks, block_size = kv_cache.shape[:2]
    # A stride along a dim of size 1 never multiplies a nonzero index: 0 there, so that it does
    # not compile another variant.
    grid = (triton.cdiv(num_tokens, block_t),)
    pdl, trigger = triton_support.pdl_launch(kv_c.device, grid[0], tuning.pdl_max_programs,
                                             tuning.pdl_trigger_max_programs)
    _mla_kernel[grid](
        kv_c, k_pe, code_view(kv_cache), slot_mapping, scale if code in (_E4M3, _E5M2) else None,
        num_tokens,
        KV_C_STRIDE=kv_c.stride(0) if t_pad > 1 else 0,
        K_PE_STRIDE=k_pe.stride(0) if t_pad > 1 and P else 0,
        STRIDE_B=kv_cache.stride(0) if num_blocks > 1 else 0,
        STRIDE_S=kv_cache.stride(1) if block_size > 1 else 0,
        NUM_SLOTS=num_blocks * block_size, BLOCK_SIZE=block_size, L=L, P=P,
        BLOCK_L=next_pow2(L), BLOCK_P=next_pow2(P), MODE=code,
        POW2=code == _DS and ds_scale is DsMlaScale.POW2, BLOCK_T=block_t, PDL=pdl,
        PDL_TRIGGER=trigger, NATIVE=triton_support.native_fp8(kv_c.device), num_warps=warps,
        launch_pdl=pdl,
    )
