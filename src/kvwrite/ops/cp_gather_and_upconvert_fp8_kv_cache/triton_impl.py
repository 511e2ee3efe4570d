"""The Triton implementation of cp_gather_and_upconvert_fp8_kv_cache.

One program writes ``BLOCK_T`` output rows: the row rule (``kernels.triton_gather.gather_rows``
with workspace starts), then the rows' loads all at once: the 4 tiles of 128 codes, the tiles'
float32 scales and the 64 rotary values (each scale one 4-byte load and the rotary values 2-byte
ones where every entry start is aligned to that, ALIGN; else assembled from bytes, so any entry
alignment works); then each tile's codes dequantized by ``fp8_dequant`` and rounded to ``dst``'s
dtype, and the rotary values' 16-bit patterns. Loading a tile's codes only after the previous
tile's stores (the first version) made each program wait for memory five times. Strides are
compile-time constants; T_out and B are not, and nothing is read on the host (CUDA-graph safe).

On CPU it runs under Triton's interpreter, whose float32 -> bfloat16 cast is not round to
nearest even: :func:`unsupported` refuses bfloat16 outputs there.
"""

from __future__ import annotations

import torch

from ...gather import bits_view
from ...kernels import gather_cuda, triton_gather
from ...kernels.triton_gather import TUNING, TritonTuning, fp8_dequant, row_prologue, tl, triton

__all__ = ["TritonTuning", "TUNING", "available", "unsupported", "run"]


available = triton_gather.availability(lambda: _kernel)


def unsupported(src_cache, dst) -> str | None:
    return triton_gather.interpreter_reason(dst.device, dst.dtype)


if triton is not None:

    @triton.jit(do_not_specialize=["t_out", "num_req"])
    def _kernel(
        src_ptr,  # [num_blocks, bs, 656] uint8 via (CBS, CPS, 1)
        src16_ptr,  # the same storage as int16 where ALIGN >= 2 (else src_ptr)
        src32_ptr,  # ... as int32 where ALIGN >= 4 (else src_ptr)
        dst_ptr,  # [T_out, 576] float16/bfloat16, row stride DRS
        dst_bits_ptr,  # the same tensor as int16 (the rotary part's patterns)
        bt_ptr, starts_ptr, ss_ptr,  # block_table, workspace_starts, seq_starts (or None)
        t_out, num_req,
        CBS: tl.constexpr, CPS: tl.constexpr, DRS: tl.constexpr, BLOCK_T: tl.constexpr,
        ALIGN: tl.constexpr,  # 4, 2 or 1: what every entry start is aligned to (bytes)
        NATIVE: tl.constexpr,  # fp8_dequant's (compiled kernels)
        ROW: tl.constexpr,  # the row rule's constants (triton_gather.row_constants)
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,
    ):
        t, ok, blk, off = row_prologue(t_out, num_req, starts_ptr, ss_ptr, bt_ptr, BLOCK_T, ROW,
                                       PDL, PDL_TRIGGER)
        entry = blk * CBS + off * CPS
        row = t * DRS
        col = tl.arange(0, 128)
        g = tl.arange(0, 4)
        k = tl.arange(0, 64)
        m = ok[:, None]
        # Every load of the rows first.
        c0 = tl.load(src_ptr + entry[:, None] + col[None, :], mask=m, other=0)
        c1 = tl.load(src_ptr + entry[:, None] + 128 + col[None, :], mask=m, other=0)
        c2 = tl.load(src_ptr + entry[:, None] + 256 + col[None, :], mask=m, other=0)
        c3 = tl.load(src_ptr + entry[:, None] + 384 + col[None, :], mask=m, other=0)
        if ALIGN >= 4:
            sbits = tl.load(src32_ptr + (blk * (CBS // 4) + off * (CPS // 4) + 128)[:, None]
                            + g[None, :], mask=m, other=0)
        else:
            b = tl.arange(0, 4)
            sb = tl.load(src_ptr + (entry + 512)[:, None, None] + (4 * g)[None, :, None]
                         + b[None, None, :], mask=ok[:, None, None], other=0)
            sbits = tl.sum(sb.to(tl.int32) << (8 * b)[None, None, :], axis=2)
        if ALIGN >= 2:
            pe = tl.load(src16_ptr + (blk * (CBS // 2) + off * (CPS // 2) + 264)[:, None]
                         + k[None, :], mask=m, other=0)
        else:
            lo = tl.load(src_ptr + entry[:, None] + 528 + 2 * k[None, :], mask=m, other=0)
            hi = tl.load(src_ptr + entry[:, None] + 529 + 2 * k[None, :], mask=m, other=0)
            pe = (lo.to(tl.int32) | (hi.to(tl.int32) << 8)).to(tl.int16)
        for j in tl.static_range(4):
            # Tile j's scale: its bits picked as integers (a float sum would turn -0.0 into 0.0).
            s = tl.sum(tl.where(g[None, :] == j, sbits, 0), axis=1).to(tl.float32, bitcast=True)
            if j == 0:
                codes = c0
            elif j == 1:
                codes = c1
            elif j == 2:
                codes = c2
            else:
                codes = c3
            y = fp8_dequant(codes, s[:, None], 1, NATIVE).to(dst_ptr.dtype.element_ty)
            tl.store(dst_ptr + row[:, None] + 128 * j + col[None, :], y, mask=m)
        tl.store(dst_bits_ptr + row[:, None] + 512 + k[None, :], pe, mask=m)


def run(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
        workspace_starts: torch.Tensor, num_req: int, seq_starts: torch.Tensor | None, *,
        tuning: TritonTuning = TUNING) -> None:
    """Launch on PyTorch's current stream; arguments as validated by the public op."""
    num_blocks, block_size = src_cache.shape[:2]
    src = src_cache.view(torch.uint8)
    t_out = dst.shape[0]
    cbs = src.stride(0) if num_blocks > 1 else 0
    cps = src.stride(1) if block_size > 1 else 0
    align = min(4, gather_cuda.align([src.data_ptr(), src.stride(0), src.stride(1)]))
    src16 = src.view(torch.int16) if align >= 2 else src
    src32 = src.view(torch.int32) if align >= 4 else src
    triton_gather.launch_rows(
        _kernel, dst.device, t_out,
        (src, src16, src32, dst, bits_view(dst), block_table, workspace_starts, seq_starts, t_out,
         num_req),
        workspace_starts, seq_starts, block_table, block_size, num_blocks, num_req, tuning,
        workspace=True, CBS=cbs, CPS=cps, DRS=dst.stride(0) if t_out > 1 else 0, ALIGN=align,
        NATIVE=triton_gather.native_fp8(dst.device),
    )
