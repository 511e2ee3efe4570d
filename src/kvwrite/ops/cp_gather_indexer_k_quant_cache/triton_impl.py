"""The Triton implementation of cp_gather_indexer_k_quant_cache.

One program writes ``BLOCK_T`` output rows: the row rule (``kernels.triton_gather.gather_rows``,
no seq_starts), then each row's ``D`` code bytes from its page and its ``4G`` scale bytes (stored
as bytes into a uint8 ``dst_scale``, or assembled four at a time into the float32 bit patterns of
a float32 one, so any page alignment works), through the outputs' strides. Strides and geometry
are compile-time constants; T_out and B are not, and nothing is read on the host (CUDA-graph
safe).
"""

from __future__ import annotations

import torch

from ...gather import bits_view
from ...kernels import triton_gather
from ...kernels.triton_gather import TUNING, TritonTuning, row_prologue, tl, triton
from ...kernels.triton_support import next_pow2

__all__ = ["TritonTuning", "TUNING", "available", "unsupported", "run"]


available = triton_gather.availability(lambda: _kernel)


def unsupported(kv_cache, dst_k, dst_scale) -> str | None:
    return None


if triton is not None:

    @triton.jit(do_not_specialize=["t_out", "num_req"])
    def _kernel(
        src_ptr,  # [num_blocks, bs, D + 4G] uint8, page stride CBS
        k_ptr,  # [T_out, D] uint8 via (KRS, KCS)
        s_ptr,  # [T_out, 4G] uint8 or [T_out, G] int32 (float32 bits) via (SRS, SCS)
        bt_ptr, starts_ptr,  # block_table, cu_seq_lens
        t_out, num_req,
        CBS: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, SB: tl.constexpr,  # SB = 4G
        KRS: tl.constexpr, KCS: tl.constexpr, SRS: tl.constexpr, SCS: tl.constexpr,
        FLOAT_SCALES: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
        BLOCK_T: tl.constexpr,
        ROW: tl.constexpr,  # the row rule's constants (triton_gather.row_constants)
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,
    ):
        t, ok, blk, off = row_prologue(t_out, num_req, starts_ptr, None, bt_ptr, BLOCK_T, ROW,
                                       PDL, PDL_TRIGGER)
        page = blk * CBS
        i = tl.arange(0, BLOCK_D)
        mk = ok[:, None] & (i < D)[None, :]
        codes = tl.load(src_ptr + (page + off * D)[:, None] + i[None, :], mask=mk)
        tl.store(k_ptr + (t * KRS)[:, None] + (i * KCS)[None, :], codes, mask=mk)
        scales = page + BS * D + off * SB
        if FLOAT_SCALES:
            g = tl.arange(0, BLOCK_S)
            b = tl.arange(0, 4)
            ms = ok[:, None, None] & (g < SB // 4)[None, :, None]
            sb = tl.load(src_ptr + scales[:, None, None] + (4 * g)[None, :, None] + b[None, None, :],
                         mask=ms, other=0)
            bits = tl.sum(sb.to(tl.int32) << (8 * b)[None, None, :], axis=2)
            tl.store(s_ptr + (t * SRS)[:, None] + (g * SCS)[None, :], bits,
                     mask=ok[:, None] & (g < SB // 4)[None, :])
        else:
            j = tl.arange(0, BLOCK_S)
            ms = ok[:, None] & (j < SB)[None, :]
            sb = tl.load(src_ptr + scales[:, None] + j[None, :], mask=ms)
            tl.store(s_ptr + (t * SRS)[:, None] + (j * SCS)[None, :], sb, mask=ms)


def run(kv_cache: torch.Tensor, dst_k: torch.Tensor, dst_scale: torch.Tensor,
        block_table: torch.Tensor, cu_seq_lens: torch.Tensor, *,
        tuning: TritonTuning = TUNING) -> None:
    """Launch on PyTorch's current stream; arguments as validated by the public op."""
    num_blocks, block_size, width = kv_cache.shape
    t_out, head_dim = dst_k.shape
    num_req = block_table.shape[0]
    k = dst_k.view(torch.uint8)
    floats = dst_scale.dtype == torch.float32
    s = bits_view(dst_scale)
    rows = t_out > 1
    triton_gather.launch_rows(
        _kernel, dst_k.device, t_out, (kv_cache, k, s, block_table, cu_seq_lens, t_out, num_req),
        cu_seq_lens, None, block_table, block_size, num_blocks, num_req, tuning,
        CBS=kv_cache.stride(0) if num_blocks > 1 else 0, BS=block_size, D=head_dim,
        SB=width - head_dim, KRS=k.stride(0) if rows else 0,
        KCS=k.stride(1) if head_dim > 1 else 0, SRS=s.stride(0) if rows else 0,
        SCS=s.stride(1) if s.shape[1] > 1 else 0, FLOAT_SCALES=floats,
        BLOCK_D=next_pow2(head_dim), BLOCK_S=next_pow2(s.shape[1]),
    )
