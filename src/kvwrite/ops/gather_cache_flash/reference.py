"""The plain-PyTorch implementation of gather_cache_flash: the reference oracle and the baseline a
user would write. CPU and CUDA, any strides. Not graph-safe: the row count of the rule syncs with
the host."""

from __future__ import annotations

import torch

from ...dtypes import CacheDType
from ...gather import bits_view, fp8_dequant, request_rows

__all__ = ["available", "unsupported", "run"]


def available(device: torch.device) -> str | None:
    return None


def unsupported(key_cache, key_out, cache_dtype) -> str | None:
    return None


def run(key_cache: torch.Tensor, value_cache: torch.Tensor, key_out: torch.Tensor,
        value_out: torch.Tensor, block_table: torch.Tensor, cu_seq_lens: torch.Tensor,
        seq_starts: torch.Tensor | None, cache_dtype: CacheDType, k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None) -> None:
    num_blocks, block_size = key_cache.shape[:2]
    t, blk, off = request_rows(cu_seq_lens, seq_starts, block_table, cu_seq_lens.shape[0] - 1,
                               key_out.shape[0], block_size, num_blocks)
    for cache, out, scale in ((key_cache, key_out, k_scale), (value_cache, value_out, v_scale)):
        rows = cache[blk, off]
        if cache_dtype.is_fp8:
            s = scale.reshape(1, -1, 1)
            out[t] = fp8_dequant(rows, cache_dtype.fp8_dtype, s, out.dtype)
        else:
            bits_view(out)[t] = bits_view(rows)
