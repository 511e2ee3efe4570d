"""pack_kv_pages: the public op, its validation (kvwrite.transfer) and its torch.compile custom
op (SPEC §9.4)."""

from __future__ import annotations

import torch

from ... import registry, transfer
from ...kernels import copy_engine

__all__ = ["OP", "pack_kv_pages"]

OP = "pack_kv_pages"


@registry.custom_op(OP, mutates=("pages",),
                    args={"caches": transfer.TENSORS_ARG,
                          "head_range": transfer.HEAD_RANGE_ARG, "max_ctas": transfer.MAX_CTAS_ARG})
def pack_kv_pages(caches, pages: torch.Tensor, block_mapping: torch.Tensor, *, kv_split: int = 1,
                  head_range=None, page_format: str = "raw",
                  scale: torch.Tensor | None = None, max_ctas=None, engine: str = "auto",
                  implementation: str | None = None) -> None:
    """Pack one block of every layer into a transfer page, heads outermost: for each pair
    ``(b, p)`` (cache block, page row) and each head ``k``, head chunk ``hp(k)`` of row ``p`` of
    ``pages`` is written whole (sigmas, codes, zero tail) from head ``hc(k)`` of block ``b`` of
    every layer; mutates ``pages`` only.

    ``caches``: a list of L >= 1 logical ``(num_blocks, H_c, N, C)`` views of one dtype and
    shape past the first dim; ``kv_split`` S divides C; ``pages``: uint8 ``[num_pages, P]`` with
    a unit last stride, ``P = H_p * kv_page_bytes(L, 1, N, C, dtype, kv_split=S,
    page_format=...)``; ``head_range`` as :func:`kvwrite.relayout_kv_cache`'s; ``page_format``
    "raw", "fp8" (= "fp8_e4m3"), "fp8_e5m2" or "nvfp4"; ``scale`` (quantized formats): float32
    on the caches' device, broadcastable to ``[L, S, H_c]``, read on the device (SPEC §9.4,
    §9.5)."""
    plan = transfer.build_pack(caches, pages, block_mapping, kv_split=kv_split,
                               head_range=head_range, page_format=page_format, scale=scale,
                               max_ctas=max_ctas, engine=engine)
    copy_engine.execute(OP, plan, implementation)
