"""swap_blocks_multi_layer: the public op, its validation (kvwrite.transfer) and its
torch.compile custom op (SPEC §9.2)."""

from __future__ import annotations

import torch

from ... import registry, transfer
from ...kernels import copy_engine

__all__ = ["OP", "swap_blocks_multi_layer"]

OP = "swap_blocks_multi_layer"


@registry.custom_op(OP, mutates=("dst_caches",),
                    args={"src_caches": transfer.TENSORS_ARG, "dst_caches": transfer.TENSORS_ARG, "max_ctas": transfer.MAX_CTAS_ARG})
def swap_blocks_multi_layer(src_caches, dst_caches, block_mapping: torch.Tensor, *,
                            max_ctas=None, engine: str = "auto",
                            implementation: str | None = None) -> None:
    """Copy blocks of every layer in one call: pair ``l`` of the two lists (or tuples) of the
    same length ``L >= 1`` obeys :func:`kvwrite.swap_blocks`' three-argument rules by itself (its
    own dtype, block shape, strides and block counts), with one ``block_mapping`` for all;
    mutates ``dst_caches`` only. Every pair is validated before anything is written (SPEC §9.2,
    §9.5)."""
    plan = transfer.build_swap(src_caches, dst_caches, block_mapping, op=OP,
                               names=("src_caches", "dst_caches"), listed=True,
                               max_ctas=max_ctas, engine=engine)
    copy_engine.execute(OP, plan, implementation)
