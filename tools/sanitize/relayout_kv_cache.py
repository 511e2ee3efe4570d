"""Memcheck cases of relayout_kv_cache: layout changes (rows moved between head-major and
token-major blocks), head slices, element-by-element rows, through the transfer copy kernel
(kvwrite.kernels.transfer_cuda) against a per-pair torch loop over whole allocations.
``python -m tools.sanitize`` runs every op's ``cases()`` under compute-sanitizer."""

from __future__ import annotations

from tools.sanitize import Cases
from tools.sanitize.transfer_plans import copy_cases

__all__ = ["cases"]


def cases() -> Cases:
    return copy_cases("relayout_kv_cache", [("relayout", None, None), ("relayout", "dst", 4),
                                            ("heads", None, 2), ("strided", "src", None)])
