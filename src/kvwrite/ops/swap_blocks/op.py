"""swap_blocks: the public op, its validation (kvwrite.transfer) and its torch.compile custom op
(SPEC §9.2)."""

from __future__ import annotations

import torch

from ... import registry, transfer
from ...kernels import copy_engine

__all__ = ["OP", "swap_blocks"]

OP = "swap_blocks"


def _lower(src, dst, block_mapping, sized_block_mapping, max_ctas, engine, implementation
           ) -> tuple:
    """A call as the custom op takes it: the mapping always third, the four-argument form's
    block size after it (None for the three-argument form)."""
    if isinstance(block_mapping, torch.Tensor):
        return src, dst, block_mapping, None, max_ctas, engine, implementation or ""
    return src, dst, sized_block_mapping, block_mapping, max_ctas, engine, implementation or ""


def _entry(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor,
           block_size_in_bytes: int | None, max_ctas: int | None, engine: str,
           implementation: str) -> None:
    """swap_blocks as torch.compile sees it: one opaque call that mutates ``dst``."""
    head = (block_mapping,) if block_size_in_bytes is None else (block_size_in_bytes,
                                                                  block_mapping)
    swap_blocks(src, dst, *head, max_ctas=max_ctas, engine=engine,
                implementation=implementation or None)


@registry.custom_op(OP, mutates=("dst",), lower=_lower, entry=_entry)
def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping, sized_block_mapping=None,
                *, max_ctas: int | None = None, engine: str = "auto",
                implementation: str | None = None) -> None:
    """Copy blocks: for each pair ``(i, j)`` of ``block_mapping`` (``[n, 2]`` int64 or int32),
    every element of ``dst[j]`` gets the bits of ``src[i]``'s element at the same index; mutates
    ``dst`` only (SPEC §9.2).

    ``src``, ``dst``: one dtype, ``src.shape[1:] == dst.shape[1:]``, any strides; on one GPU, one
    on the GPU and the other in pinned host memory, on two GPUs of the host with peer access
    (the work runs on ``dst``'s, on its current stream), or both on the host. They may be the same
    view (a copy inside one cache: then no id may be both a source and a destination).

    vLLM's form ``swap_blocks(src, dst, block_size_in_bytes, block_mapping)`` (an ``int`` third
    argument): block ``i`` of a side is the ``block_size_in_bytes`` bytes ``i * stride(0) *
    element_size()`` bytes after its ``data_ptr()``, whatever its other dims and dtype.

    A CPU ``block_mapping`` is checked now (ids in range, distinct destinations); one on the
    GPU is read by the kernel (pairs with an id out of range are skipped). ``max_ctas``: at most
    that many CTAs per kernel; ``engine``: "auto", "sm" or "ce" (copy engines, raw host<->device
    calls with a CPU mapping); ``implementation``: "cuda", "triton" or "torch" (SPEC §9.5).
    """
    if isinstance(block_mapping, int) and not isinstance(block_mapping, bool):
        if sized_block_mapping is None:
            raise TypeError("block_mapping: swap_blocks(src, dst, block_size_in_bytes, "
                            "block_mapping) expects a fourth argument, got none")
        plan = transfer.build_swap_bytes(src, dst, block_mapping, sized_block_mapping,
                                         max_ctas=max_ctas, engine=engine)
    else:
        if sized_block_mapping is not None:
            raise TypeError(f"block_size_in_bytes: swap_blocks(src, dst, block_size_in_bytes, "
                            f"block_mapping) expects an int third argument, got "
                            f"{type(block_mapping).__name__}")
        plan = transfer.build_swap(src, dst, block_mapping, max_ctas=max_ctas, engine=engine)
    copy_engine.execute(OP, plan, implementation)
