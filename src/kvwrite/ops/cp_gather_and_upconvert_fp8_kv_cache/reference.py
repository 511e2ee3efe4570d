"""The plain-PyTorch implementation of cp_gather_and_upconvert_fp8_kv_cache: the reference oracle
and the baseline a user would write. CPU and CUDA, any strides. Not graph-safe: the row count of
the rule syncs with the host."""

from __future__ import annotations

import torch

from ...gather import bits_view, fp8_dequant, request_rows
from ..concat_and_cache_mla.op import DS_MLA_L, DS_MLA_PE_OFFSET, DS_MLA_SCALES_OFFSET, DS_MLA_TILE

__all__ = ["available", "unsupported", "run", "upconvert_rows"]


def available(device: torch.device) -> str | None:
    return None


def unsupported(src_cache, dst) -> str | None:
    return None


def upconvert_rows(entries: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``[n, 576]`` rows of ``out_dtype`` from ``[n, 656]`` fp8_ds_mla entries (uint8)."""
    n = entries.shape[0]
    tiles = DS_MLA_L // DS_MLA_TILE
    codes = entries[:, :DS_MLA_L].reshape(n, tiles, DS_MLA_TILE)
    scales = entries[:, DS_MLA_SCALES_OFFSET:DS_MLA_SCALES_OFFSET + 4 * tiles].contiguous()
    kv = fp8_dequant(codes, torch.float8_e4m3fn, scales.view(torch.float32)[:, :, None], out_dtype)
    pe = entries[:, DS_MLA_PE_OFFSET:].contiguous().view(out_dtype)
    return torch.cat([kv.reshape(n, DS_MLA_L), pe], dim=1)


def run(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
        workspace_starts: torch.Tensor, num_req: int, seq_starts: torch.Tensor | None) -> None:
    num_blocks, block_size = src_cache.shape[:2]
    t, blk, off = request_rows(workspace_starts, seq_starts, block_table, num_req, dst.shape[0],
                               block_size, num_blocks, workspace=True)
    rows = upconvert_rows(src_cache.view(torch.uint8)[blk, off], dst.dtype)
    bits_view(dst)[t] = bits_view(rows)
