"""The plain-PyTorch implementation of cp_gather_cache: the reference oracle and the baseline a
user would write. CPU and CUDA, any dtype, entry shape and strides. Not graph-safe: the row count
of the rule syncs with the host."""

from __future__ import annotations

import torch

from ...gather import bits_view, request_rows

__all__ = ["available", "unsupported", "run"]


def available(device: torch.device) -> str | None:
    return None


def unsupported(src_cache, dst) -> str | None:
    return None


def run(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
        cu_seq_lens: torch.Tensor, seq_starts: torch.Tensor | None) -> None:
    num_blocks, block_size = src_cache.shape[:2]
    t, blk, off = request_rows(cu_seq_lens, seq_starts, block_table, cu_seq_lens.shape[0] - 1,
                               dst.shape[0], block_size, num_blocks)
    bits_view(dst)[t] = bits_view(src_cache)[blk, off]
