"""pack_kv_pages in plain PyTorch: each mapped block of every layer gathered, permuted into the
page's order (head, layer, part, token, element) and written as whole head chunks: raw bytes, or
float32 sigma(l, s) then codes (fp8: kvwrite.dtypes.quantize; nvfp4: the NVFP4 group rule of
kvwrite.ops.nvfp4.rule) then zeros (SPEC §9.4)."""

from __future__ import annotations

import torch

from ...dtypes import CacheDType, quantize
from ...transfer import TransferPlan, mapped_pairs
from ..nvfp4.rule import GROUP, pack_codes, quantize_groups

__all__ = ["available", "unsupported", "run", "gather_blocks"]


def available(device: torch.device) -> str | None:
    return None


def unsupported(plan: TransferPlan) -> str | None:
    return None


def gather_blocks(caches, i: torch.Tensor, h0: int, k: int, parts: int) -> torch.Tensor:
    """Blocks ``i`` of every layer, heads ``[h0, h0 + k)``, as ``[n, K, L, S, N, E]`` (the page
    order: head, layer, part, token, element)."""
    x = torch.stack([t.index_select(0, i.to(t.device)).narrow(1, h0, k) for t in caches], dim=2)
    n, K, L, N, C = x.shape
    return x.reshape(n, K, L, N, parts, C // parts).permute(0, 1, 2, 4, 3, 5)


def _sigma(scale: torch.Tensor, layers: int, parts: int, heads: int, h0: int, k: int
           ) -> torch.Tensor:
    """sigma(l, s) of head chunk k as float32 ``[K, L, S]`` (scale broadcast to [L, S, H_c])."""
    return torch.broadcast_to(scale, (layers, parts, heads)).narrow(2, h0, k).permute(2, 0, 1)


def run(plan: TransferPlan) -> None:
    a = plan.args
    caches, pages = a["caches"], a["pages"]
    i, j = mapped_pairs(plan, [t.shape[0] for t in caches], [pages.shape[0]])
    if i.numel() == 0:
        return
    fmt, S, K, hb = a["page_format"], a["kv_split"], a["heads"], a["chunk_bytes"]
    x = gather_blocks(caches, i, a["cache_head"], K, S)          # [n, K, L, S, N, E]
    n, _, L, _, N, E = x.shape
    if fmt == "raw":
        chunks = x.contiguous().view(torch.uint8).reshape(n, K, hb)
    else:
        sigma = _sigma(a["scale"], L, S, caches[0].shape[1], a["cache_head"], K).to(x.device)
        chunks = torch.zeros(n, K, hb, dtype=torch.uint8, device=x.device)
        head = 4 * L * S
        chunks[:, :, :head] = sigma.contiguous().view(torch.uint8).reshape(1, K, head)
        codes = chunks[:, :, head:]
        for l_ in range(L):
            for s in range(S):
                r = l_ * S + s
                if fmt == "nvfp4":
                    _nvfp4_part(x[:, :, l_, s], sigma[:, l_, s], codes, r, L * S, N, E)
                else:
                    # [n, K, N, E] as quantize's rows [T, H, D] with one scale per head k.
                    rows = x[:, :, l_, s].permute(0, 2, 1, 3).reshape(n * N, K, E)
                    q = quantize(rows, CacheDType(fmt), sigma[:, l_, s].contiguous(), torch.uint8)
                    codes[:, :, r * N * E:(r + 1) * N * E] = (
                        q.reshape(n, N, K, E).permute(0, 2, 1, 3).reshape(n, K, N * E))
    rows = pages.narrow(1, a["page_head"] * hb, K * hb)
    rows.index_copy_(0, j.to(pages.device), chunks.reshape(n, K * hb).to(pages.device))


def _nvfp4_part(x: torch.Tensor, sigma: torch.Tensor, codes: torch.Tensor, r: int, rows: int,
                N: int, E: int) -> None:
    """Part ``r = l*S + s`` (``x`` [n, K, N, E]) of every head chunk: its codes (two a byte,
    from ``r*N*E/2``) and group scale bytes (from ``rows*N*E/2 + r*N*E/16``) into ``codes``
    (the chunks past the sigmas), each head with its own sigma."""
    n, K = x.shape[:2]
    data, scales = rows * N * E // 2, r * N * E // GROUP
    for k in range(K):
        c, sb = quantize_groups(x[:, k].reshape(-1, GROUP), sigma[k])
        at = r * N * E // 2
        codes[:, k, at:at + N * E // 2] = pack_codes(c.reshape(n, N * E))
        codes[:, k, data + scales:data + scales + N * E // GROUP] = sb.reshape(n, N * E // GROUP)
