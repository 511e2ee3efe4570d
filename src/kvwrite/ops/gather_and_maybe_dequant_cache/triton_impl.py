"""The Triton implementation of gather_and_maybe_dequant_cache.

One program writes ``BLOCK_T`` output rows: the row rule (``kernels.triton_gather.gather_rows``:
each row's owner by comparison with every request, its position, its block-table entry), then the
entry in steps of ``CHUNK`` columns, copied as integers of the element size ("auto") or
dequantized by ``fp8_dequant`` and rounded to ``dst``'s dtype. Strides and geometry are
compile-time constants; T_out and B are not, and nothing is read on the host, so a replayed CUDA
graph sees new index tensors and scales.

On CPU it runs under Triton's interpreter, whose float32 -> bfloat16 cast is not round to
nearest even: :func:`unsupported` refuses fp8 reads into bfloat16 there.
"""

from __future__ import annotations

import torch

from ...gather import bits_view
from ...kernels import triton_gather
from ...kernels.triton_fp8 import pdl_entry
from ...kernels.triton_gather import TUNING, TritonTuning, fp8_dequant, gather_rows, tl, triton
from ..concat_and_cache_mla.op import MlaMode

__all__ = ["TritonTuning", "TUNING", "available", "unsupported", "run"]

_FMT = {MlaMode.AUTO: 0, MlaMode.FP8_E4M3: 1, MlaMode.FP8_E5M2: 2}


available = triton_gather.availability(lambda: _kernel)


def unsupported(src_cache, dst, mode: MlaMode) -> str | None:
    return None if mode is MlaMode.AUTO else triton_gather.interpreter_reason(dst.device, dst.dtype)


if triton is not None:

    @triton.jit(do_not_specialize=["t_out", "num_req"])
    def _kernel(
        src_ptr,  # [num_blocks, bs, E] via (CBS, CPS, 1): bits as integers ("auto") or fp8 codes
        dst_ptr,  # [>= t_out, E], row stride DRS (integers of the element size for "auto")
        scale_ptr,  # [1] float32 (fp8 modes), else None
        bt_ptr, starts_ptr, ss_ptr,  # block_table, cu_seq_lens, seq_starts (or None)
        t_out, num_req,
        CBS: tl.constexpr, CPS: tl.constexpr, DRS: tl.constexpr,
        E: tl.constexpr, CHUNK: tl.constexpr,
        FMT: tl.constexpr,  # 0 copy, 1 e4m3, 2 e5m2
        NATIVE: tl.constexpr,  # fp8_dequant's (compiled kernels)
        BLOCK_T: tl.constexpr,
        ROW: tl.constexpr,  # the row rule's constants (triton_gather.row_constants)
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,
    ):
        pdl_entry(PDL, PDL_TRIGGER)
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        if FMT != 0:
            s = tl.load(scale_ptr)
        ok, blk, off = gather_rows(t, t_out, num_req, starts_ptr, ss_ptr, bt_ptr, ROW)
        src_row = blk * CBS + off * CPS
        dst_row = t * DRS
        for c0 in tl.range(0, E, CHUNK):
            cols = c0 + tl.arange(0, CHUNK)
            m = ok[:, None] & (cols < E)[None, :]
            x = tl.load(src_ptr + src_row[:, None] + cols[None, :], mask=m)
            if FMT == 0:  # noqa: SIM108 (a compile-time branch)
                y = x
            else:
                y = fp8_dequant(x, s, FMT, NATIVE).to(dst_ptr.dtype.element_ty)
            tl.store(dst_ptr + dst_row[:, None] + cols[None, :], y, mask=m)


def run(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
        cu_seq_lens: torch.Tensor, seq_starts: torch.Tensor | None, num_tokens: int,
        mode: MlaMode, scale: torch.Tensor | None, *, tuning: TritonTuning = TUNING) -> None:
    """Launch on PyTorch's current stream; arguments as validated by the public op."""
    num_blocks, block_size, entry = src_cache.shape
    num_req = cu_seq_lens.shape[0] - 1
    if mode is MlaMode.AUTO:
        src, out = bits_view(src_cache), bits_view(dst)
    else:
        src, out = src_cache.view(torch.uint8), dst
    triton_gather.launch_rows(
        _kernel, dst.device, num_tokens,
        (src, out, scale, block_table, cu_seq_lens, seq_starts, num_tokens, num_req),
        cu_seq_lens, seq_starts, block_table, block_size, num_blocks, num_req, tuning,
        CBS=src.stride(0) if num_blocks > 1 else 0, CPS=src.stride(1) if block_size > 1 else 0,
        DRS=out.stride(0) if dst.shape[0] > 1 else 0, E=entry,
        CHUNK=triton_gather.chunk_width(entry), FMT=_FMT[mode],
        NATIVE=triton_gather.native_fp8(dst.device),
    )
