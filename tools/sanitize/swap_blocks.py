"""Memcheck cases of swap_blocks: the transfer copy kernel (kvwrite.kernels.transfer_cuda) on the
GPU against a per-pair torch loop over whole allocations: same layouts, odd strides and pointers,
the 4-argument form's byte blocks (short and 1 MiB), pinned host sides, out-of-range ids.
``python -m tools.sanitize`` runs every op's ``cases()`` under compute-sanitizer."""

from __future__ import annotations

from tools.sanitize import Cases
from tools.sanitize.transfer_plans import copy_cases

__all__ = ["cases"]


def cases() -> Cases:
    return copy_cases("swap_blocks", [("dense", None, None), ("odd", None, 1),
                                      ("bytes", None, 2), ("block_bytes", "src", 4),
                                      ("long_rows", "dst", None), ("dense", "dst", 4)])
