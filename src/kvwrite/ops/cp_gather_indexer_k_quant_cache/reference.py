"""The plain-PyTorch implementation of cp_gather_indexer_k_quant_cache: the reference oracle and
the baseline a user would write. CPU and CUDA, any output strides. Not graph-safe: the row count
of the rule syncs with the host."""

from __future__ import annotations

import torch

from ...gather import bits_view, request_rows

__all__ = ["available", "unsupported", "run", "pages"]


def available(device: torch.device) -> str | None:
    return None


def unsupported(kv_cache, dst_k, dst_scale) -> str | None:
    return None


def pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as ``[num_blocks, bs * (D + 4G)]`` bytes: each block's page (a view)."""
    nb, bs, width = kv_cache.shape
    return kv_cache.as_strided((nb, bs * width), (kv_cache.stride(0), 1),
                               kv_cache.storage_offset())


def run(kv_cache: torch.Tensor, dst_k: torch.Tensor, dst_scale: torch.Tensor,
        block_table: torch.Tensor, cu_seq_lens: torch.Tensor) -> None:
    num_blocks, block_size, width = kv_cache.shape
    head_dim = dst_k.shape[1]
    scale_bytes = width - head_dim
    t, blk, off = request_rows(cu_seq_lens, None, block_table, block_table.shape[0],
                               dst_k.shape[0], block_size, num_blocks)
    page = pages(kv_cache)
    dev = kv_cache.device
    codes = page[blk[:, None], off[:, None] * head_dim + torch.arange(head_dim, device=dev)]
    scales = page[blk[:, None], block_size * head_dim + off[:, None] * scale_bytes
                  + torch.arange(scale_bytes, device=dev)]
    dst_k.view(torch.uint8)[t] = codes
    if dst_scale.dtype == torch.uint8:
        dst_scale[t] = scales
    else:
        bits_view(dst_scale)[t] = scales.contiguous().view(torch.int32)
