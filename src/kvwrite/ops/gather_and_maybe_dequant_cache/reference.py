"""The plain-PyTorch implementation of gather_and_maybe_dequant_cache: the reference oracle and the
baseline a user would write. CPU and CUDA, any strides. Not graph-safe: the row count of the
rule syncs with the host."""

from __future__ import annotations

import torch

from ...gather import bits_view, fp8_dequant, request_rows
from ..concat_and_cache_mla.op import MlaMode

__all__ = ["available", "unsupported", "run"]


def available(device: torch.device) -> str | None:
    return None


def unsupported(src_cache, dst, mode) -> str | None:
    return None


def run(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
        cu_seq_lens: torch.Tensor, seq_starts: torch.Tensor | None, num_tokens: int,
        mode: MlaMode, scale: torch.Tensor | None) -> None:
    num_blocks, block_size = src_cache.shape[:2]
    t, blk, off = request_rows(cu_seq_lens, seq_starts, block_table, cu_seq_lens.shape[0] - 1,
                               num_tokens, block_size, num_blocks)
    rows = src_cache[blk, off]
    if mode is MlaMode.AUTO:
        bits_view(dst)[t] = bits_view(rows)
    else:
        dst[t] = fp8_dequant(rows, mode.fp8_dtype, scale, dst.dtype)
