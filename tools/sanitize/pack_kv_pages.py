"""Memcheck cases of pack_kv_pages: quantized transfer pages (fp8_e4m3, fp8_e5m2, nvfp4) written
by the transfer page kernel (kvwrite.kernels.transfer_cuda) against the torch rules over whole
allocations (misaligned chunks of a padded pool, head ranges, more layers than a launch's
slots, pinned pages). ``python -m tools.sanitize`` runs every op's ``cases()``."""

from __future__ import annotations

from tools.sanitize import Cases
from tools.sanitize.transfer_plans import page_cases

__all__ = ["cases"]


def cases() -> Cases:
    return page_cases("pack")
