"""unpack_kv_pages in plain PyTorch: the mapped page rows' head chunks read in the page's order
(head, layer, part, token, element), decoded (fp8: kvwrite.gather.fp8_dequant; nvfp4:
kvwrite.ops.nvfp4's dequantize_groups), rounded to the caches' dtype and scattered into each
layer's blocks (SPEC §9.4)."""

from __future__ import annotations

import torch

from ...dtypes import CacheDType
from ...gather import bits_view, fp8_dequant
from ...transfer import TransferPlan, mapped_pairs
from ..nvfp4.readers import dequantize_groups
from ..nvfp4.rule import GROUP, unpack_codes

__all__ = ["available", "unsupported", "run"]


def available(device: torch.device) -> str | None:
    return None


def unsupported(plan: TransferPlan) -> str | None:
    return None


def run(plan: TransferPlan) -> None:
    a = plan.args
    caches, pages = a["caches"], a["pages"]
    i, j = mapped_pairs(plan, [pages.shape[0]], [t.shape[0] for t in caches])
    if i.numel() == 0:
        return
    fmt, S, K, hb = a["page_format"], a["kv_split"], a["heads"], a["chunk_bytes"]
    L, (_, _, N, C) = len(caches), caches[0].shape
    E, dtype = C // S, caches[0].dtype
    chunks = pages.index_select(0, i.to(pages.device)).narrow(1, a["page_head"] * hb, K * hb)
    chunks = chunks.reshape(-1, K, hb)
    n = chunks.shape[0]
    if fmt == "raw":
        es = caches[0].element_size()
        body = chunks[:, :, :L * N * C * es].reshape(n, K, L, S, N, E * es).contiguous()
        x = bits_view(body.view(dtype) if dtype != torch.uint8 else body)
    else:
        head = 4 * L * S
        sigma = chunks[:, :, :head].contiguous().view(torch.float32).reshape(n, K, L, S, 1, 1)
        if fmt == "nvfp4":
            data = chunks[:, :, head:head + L * N * C // 2].reshape(n, K, L, S, N, E // 2)
            at = head + L * N * C // 2
            sb = chunks[:, :, at:at + L * N * C // GROUP].reshape(n, K, L, S, N, E // GROUP)
            codes = unpack_codes(data).reshape(n, K, L, S, N, E // GROUP, GROUP)
            x = dequantize_groups(codes, sb, sigma[..., None]).reshape(n, K, L, S, N, E)
            x = x.to(dtype)
        else:
            codes = chunks[:, :, head:head + L * N * C].reshape(n, K, L, S, N, E)
            x = fp8_dequant(codes, CacheDType(fmt).fp8_dtype, sigma, dtype)
    x = x.permute(0, 1, 2, 4, 3, 5).reshape(n, K, L, N, C)      # [n, K, L, N, C]
    for l_, t in enumerate(caches):
        vals = x[:, :, l_]
        if fmt == "raw":
            vals = vals.contiguous()
        bits_view(t.narrow(1, a["cache_head"], K)).index_copy_(
            0, j.to(t.device), bits_view(vals).to(t.device))
