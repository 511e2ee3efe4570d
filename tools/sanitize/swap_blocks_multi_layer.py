"""Memcheck cases of swap_blocks_multi_layer: several layers of different layouts and block
counts in one call of the transfer copy kernel (kvwrite.kernels.transfer_cuda) against a per-pair
torch loop over whole allocations. ``python -m tools.sanitize`` runs every op's ``cases()``."""

from __future__ import annotations

import torch

from tools.sanitize import Cases
from tools.sanitize.transfer_plans import PAIRS, copy_views, run_copy_case

__all__ = ["cases"]


def _layers(pinned):
    views = []
    for kind in ("dense", "odd", "block_bytes", "dense", "strided"):
        views += copy_views(kind, "cuda", pinned)
    # 36 layers of one geometry: two launches (32 slots)
    views += [(torch.randn(5, 2, 2, 8, device="cuda"), torch.randn(6, 2, 2, 8, device="cuda"))
              for _ in range(36)]
    return views


def cases() -> Cases:
    def check(pinned, max_ctas):
        return lambda: run_copy_case("swap_blocks_multi_layer", _layers(pinned), PAIRS,
                                     _run(), max_ctas=max_ctas)
    return [(f"mixed-{pinned or 'device'}-ctas{max_ctas or 'all'}", check(pinned, max_ctas))
            for pinned, max_ctas in ((None, None), (None, 1), ("src", 4), ("dst", 4))]


def _run():
    from kvwrite.kernels.transfer_cuda import run
    return run
