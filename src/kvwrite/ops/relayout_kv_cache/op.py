"""relayout_kv_cache: the public op, its validation (kvwrite.transfer) and its torch.compile
custom op (SPEC §9.3)."""

from __future__ import annotations

import torch

from ... import registry, transfer
from ...kernels import copy_engine

__all__ = ["OP", "relayout_kv_cache"]

OP = "relayout_kv_cache"


def _lower(src, dst, block_mapping, head_range, max_ctas, engine, implementation) -> tuple:
    """A call as the custom op takes it: both sides as lists (``listed`` says which they were),
    the head range as a list."""
    listed = not isinstance(src, torch.Tensor)
    return (list(src) if listed else [src], list(dst) if listed else [dst], listed,
            block_mapping, None if head_range is None else list(head_range), max_ctas, engine,
            implementation or "")


def _entry(src: list[torch.Tensor], dst: list[torch.Tensor], listed: bool,
           block_mapping: torch.Tensor, head_range: list[int] | None, max_ctas: int | None,
           engine: str, implementation: str) -> None:
    """relayout_kv_cache as torch.compile sees it: one opaque call that mutates ``dst``."""
    relayout_kv_cache(src if listed else src[0], dst if listed else dst[0], block_mapping,
                      None if head_range is None else tuple(head_range), max_ctas=max_ctas,
                      engine=engine, implementation=implementation or None)


@registry.custom_op(OP, mutates=("dst",), lower=_lower, entry=_entry)
def relayout_kv_cache(src, dst, block_mapping: torch.Tensor, head_range=None, *,
                      max_ctas: int | None = None, engine: str = "auto",
                      implementation: str | None = None) -> None:
    """Copy blocks between two layouts of one logical cache: ``src``, ``dst`` 4-D ``(num_blocks,
    H, N, C)`` views of one dtype with the same N and C, any strides (or two lists of L such
    views, one call for all layers). For each pair ``(i, j)``, each ``k < K``, ``t``, ``c``:
    ``dst[j, hd(k), t, c] = src[i, hs(k), t, c]`` bit for bit; mutates ``dst`` only.

    ``head_range=None``: both sides have the same H, every head. ``(h0, h1)``: K = h1 - h0; a
    side whose H is K holds the slice (indexed by k), the other by h0 + k (H >= h1). Devices,
    mapping, ``max_ctas``, ``engine``, ``implementation``: as :func:`kvwrite.swap_blocks`
    (SPEC §9.3, §9.5)."""
    plan = transfer.build_relayout(src, dst, block_mapping, head_range, max_ctas=max_ctas,
                                   engine=engine)
    copy_engine.execute(OP, plan, implementation)
