"""The Triton implementation of gather_cache_flash.

One program writes ``BLOCK_T`` output rows: the row rule (``kernels.triton_gather.gather_rows``),
then the key's and the value's ``H * D`` elements in steps of ``CHUNK`` (head ``i // D``, element
``i % D``), copied as integers of the element size or dequantized by ``fp8_dequant`` with the
per-tensor scale or the head's and rounded to the outputs' dtype. Strides and geometry are
compile-time constants; T_out and B are not, and nothing is read on the host (CUDA-graph safe).

On CPU it runs under Triton's interpreter, whose float32 -> bfloat16 cast is not round to
nearest even: :func:`unsupported` refuses fp8 reads into bfloat16 there.
"""

from __future__ import annotations

import torch

from ...dtypes import CacheDType, scale_is_per_head
from ...gather import bits_view
from ...kernels import triton_gather
from ...kernels.triton_gather import TUNING, TritonTuning, fp8_dequant, row_prologue, tl, triton

__all__ = ["TritonTuning", "TUNING", "available", "unsupported", "run"]

_FMT = {CacheDType.FP8_E4M3: 1, CacheDType.FP8_E5M2: 2}


available = triton_gather.availability(lambda: _kernel)


def unsupported(key_cache, key_out, cache_dtype: CacheDType) -> str | None:
    if not cache_dtype.is_fp8:
        return None
    return triton_gather.interpreter_reason(key_out.device, key_out.dtype)


if triton is not None:

    @triton.jit
    def _gather_heads(src_ptr, dst_ptr, scale_ptr, ok, src_row, dst_row, H: tl.constexpr,
                      D: tl.constexpr, HS: tl.constexpr, OS: tl.constexpr, CHUNK: tl.constexpr,
                      FMT: tl.constexpr, PER_HEAD: tl.constexpr, NATIVE: tl.constexpr):
        """One cache's heads of the rows (src_row: entry offsets, dst_row: output row offsets)."""
        for c0 in tl.range(0, H * D, CHUNK):
            i = c0 + tl.arange(0, CHUNK)
            h = i // D
            d = i % D
            in_e = i < H * D
            m = ok[:, None] & in_e[None, :]
            x = tl.load(src_ptr + src_row[:, None] + (h * HS + d)[None, :], mask=m)
            if FMT == 0:
                y = x
            else:
                if PER_HEAD:
                    s = tl.load(scale_ptr + h, mask=in_e, other=1.0)[None, :]
                else:
                    s = tl.load(scale_ptr)
                y = fp8_dequant(x, s, FMT, NATIVE).to(dst_ptr.dtype.element_ty)
            tl.store(dst_ptr + dst_row[:, None] + (h * OS + d)[None, :], y, mask=m)

    @triton.jit(do_not_specialize=["t_out", "num_req"])
    def _kernel(
        k_ptr, v_ptr,  # caches [num_blocks, bs, H, D] via (CBS, CPS, HS, 1): bits or fp8 codes
        ko_ptr, vo_ptr,  # outputs [T_out, H, D] via (KRS, KHS, 1) and (VRS, VHS, 1)
        ks_ptr, vs_ptr,  # fp8: scales [1] or [H], else None
        bt_ptr, starts_ptr, ss_ptr,  # block_table, cu_seq_lens, seq_starts (or None)
        t_out, num_req,
        CBS: tl.constexpr, CPS: tl.constexpr, HS: tl.constexpr,
        KRS: tl.constexpr, KHS: tl.constexpr, VRS: tl.constexpr, VHS: tl.constexpr,
        H: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, FMT: tl.constexpr,
        NATIVE: tl.constexpr,  # fp8_dequant's (compiled kernels)
        K_PER_HEAD: tl.constexpr, V_PER_HEAD: tl.constexpr, BLOCK_T: tl.constexpr,
        ROW: tl.constexpr,  # the row rule's constants (triton_gather.row_constants)
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,
    ):
        t, ok, blk, off = row_prologue(t_out, num_req, starts_ptr, ss_ptr, bt_ptr, BLOCK_T, ROW,
                                       PDL, PDL_TRIGGER)
        src_row = blk * CBS + off * CPS
        _gather_heads(k_ptr, ko_ptr, ks_ptr, ok, src_row, t * KRS, H, D, HS, KHS, CHUNK, FMT,
                      K_PER_HEAD, NATIVE)
        _gather_heads(v_ptr, vo_ptr, vs_ptr, ok, src_row, t * VRS, H, D, HS, VHS, CHUNK, FMT,
                      V_PER_HEAD, NATIVE)


def run(key_cache: torch.Tensor, value_cache: torch.Tensor, key_out: torch.Tensor,
        value_out: torch.Tensor, block_table: torch.Tensor, cu_seq_lens: torch.Tensor,
        seq_starts: torch.Tensor | None, cache_dtype: CacheDType, k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None, *, tuning: TritonTuning = TUNING) -> None:
    """Launch on PyTorch's current stream; arguments as validated by the public op."""
    num_blocks, block_size, num_heads, head_size = key_cache.shape
    num_req = cu_seq_lens.shape[0] - 1
    t_out = key_out.shape[0]
    fp8 = cache_dtype.is_fp8
    if fp8:
        kc, vc, ko, vo = key_cache.view(torch.uint8), value_cache.view(torch.uint8), key_out, \
            value_out
    else:
        kc, vc, ko, vo = (bits_view(x) for x in (key_cache, value_cache, key_out, value_out))
    rows = t_out > 1
    triton_gather.launch_rows(
        _kernel, key_out.device, t_out,
        (kc, vc, ko, vo, k_scale, v_scale, block_table, cu_seq_lens, seq_starts, t_out, num_req),
        cu_seq_lens, seq_starts, block_table, block_size, num_blocks, num_req, tuning,
        CBS=kc.stride(0) if num_blocks > 1 else 0, CPS=kc.stride(1) if block_size > 1 else 0,
        HS=kc.stride(2) if num_heads > 1 else 0,
        KRS=ko.stride(0) if rows else 0, KHS=ko.stride(1) if num_heads > 1 else 0,
        VRS=vo.stride(0) if rows else 0, VHS=vo.stride(1) if num_heads > 1 else 0,
        H=num_heads, D=head_size, CHUNK=triton_gather.chunk_width(num_heads * head_size),
        FMT=_FMT.get(cache_dtype, 0), NATIVE=triton_gather.native_fp8(key_out.device),
        K_PER_HEAD=fp8 and scale_is_per_head(k_scale), V_PER_HEAD=fp8 and scale_is_per_head(v_scale),
    )
