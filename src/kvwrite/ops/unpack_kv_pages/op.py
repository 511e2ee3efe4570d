"""unpack_kv_pages: the public op, its validation (kvwrite.transfer) and its torch.compile
custom op (SPEC §9.4)."""

from __future__ import annotations

import torch

from ... import registry, transfer
from ...kernels import copy_engine

__all__ = ["OP", "unpack_kv_pages"]

OP = "unpack_kv_pages"


@registry.custom_op(OP, mutates=("caches",),
                    args={"caches": transfer.TENSORS_ARG,
                          "head_range": transfer.HEAD_RANGE_ARG, "max_ctas": transfer.MAX_CTAS_ARG})
def unpack_kv_pages(pages: torch.Tensor, caches, block_mapping: torch.Tensor, *,
                    kv_split: int = 1, head_range=None, page_format: str = "raw",
                    max_ctas=None, engine: str = "auto",
                    implementation: str | None = None) -> None:
    """Unpack transfer pages into the caches: for each pair ``(p, b)`` (page row, cache block)
    and each ``k``, ``l``, ``s``, ``t``, ``e``: ``caches[l][b, hc(k), t, s*E + e]`` = element
    ``q`` of chunk ``hp(k)`` of row ``p``, decoded (fp8: ``D(code, sigma)``; nvfp4:
    ``RN(value(c) * float(S) * sigma)``; rounded to the caches' dtype; raw: its bits); mutates
    ``caches`` only. Arguments as :func:`kvwrite.pack_kv_pages`' (no scale: each chunk holds
    its sigmas) (SPEC §9.4, §9.5)."""
    plan = transfer.build_unpack(pages, caches, block_mapping, kv_split=kv_split,
                                 head_range=head_range, page_format=page_format,
                                 max_ctas=max_ctas, engine=engine)
    copy_engine.execute(OP, plan, implementation)
